//! One turn of the engine loop at a time: intake of commands, admission, the prompt chunks and
//! decode steps of the running sequences, and their retirement.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::Instant;

use kakeya_models::linear::QUANT_MAX_ROWS;
use kakeya_runtime::{CostLine, Costs, KvSetup, PrefixCache, SpecConfig};

use super::group::{Beside, PRIOR_ROW_COST, draft_threshold, prompt_batch, verify_group};
use super::seq::Seq;
use super::{Command, EngineParts, Event, Job};
use crate::metrics::Metrics;

/// The engine's state between turns: what waits, what runs, and what the turns measured.
pub(super) struct Scheduler<'m> {
    parts: &'m EngineParts,
    setup: KvSetup<'m>,
    metrics: &'m Metrics,
    waiting: &'m AtomicUsize,
    pub(super) queue: VecDeque<Job>,
    pub(super) active: Vec<Seq<'m>>,
    prefix: PrefixCache<'m>,
    /// Prompt rows per turn (at least one).
    chunk: usize,
    /// Seconds of the stacked decode forwards against their rows: what a draft row beside
    /// other sequences costs.
    costs: CostLine,
    /// Or the model of them the speculation settings give (tests, simulations).
    modelled: Option<(f64, f64)>,
    /// Most rows one forward may carry and keep every row's bits.
    max_rows: usize,
}

impl<'m> Scheduler<'m> {
    pub(super) fn new(
        parts: &'m EngineParts,
        setup: KvSetup<'m>,
        metrics: &'m Metrics,
        waiting: &'m AtomicUsize,
    ) -> Self {
        let model = &parts.model;
        let prefix_budget = if PrefixCache::applies(model, &parts.policy) {
            parts.prefix_cache_bytes
        } else {
            0
        };
        let modelled = match parts.speculation {
            Some((
                _,
                SpecConfig {
                    costs:
                        Costs::Linear {
                            step_us, row_us, ..
                        },
                    ..
                },
            )) => Some((f64::from(step_us) * 1e-6, f64::from(row_us) * 1e-6)),
            _ => None,
        };
        Self {
            parts,
            setup,
            metrics,
            waiting,
            queue: VecDeque::new(),
            active: Vec::new(),
            prefix: PrefixCache::new(prefix_budget),
            chunk: parts.prefill_chunk.max(1),
            costs: CostLine::new(PRIOR_ROW_COST),
            modelled,
            max_rows: if model.rows_invariant_at_any_count() {
                usize::MAX
            } else {
                QUANT_MAX_ROWS
            },
        }
    }

    /// The commands that arrived, blocking while nothing runs or waits (and releasing free
    /// memory after a while idle); `None` when every sender is gone.
    pub(super) fn intake(&self, commands: &Receiver<Command>) -> Option<Vec<Command>> {
        let mut now = Vec::new();
        if self.active.is_empty() && self.queue.is_empty() {
            let next = match commands.recv_timeout(crate::memory::TRIM_AFTER_IDLE) {
                Err(RecvTimeoutError::Timeout) => {
                    crate::memory::release_free_memory();
                    commands.recv().ok()
                }
                got => got.ok(),
            };
            now.push(next?);
        }
        loop {
            match commands.try_recv() {
                Ok(c) => now.push(c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    now.push(Command::Shutdown);
                    break;
                }
            }
        }
        Some(now)
    }

    /// Queues new jobs; fails every request on an abort or a shutdown. True: shut down.
    pub(super) fn apply(&mut self, commands: Vec<Command>) -> bool {
        for c in commands {
            match c {
                Command::Job(job) => self.queue.push_back(job),
                Command::Abort | Command::Shutdown => {
                    let failed = || Event::Failed(503, "the server is shutting down".into());
                    for job in self.queue.drain(..) {
                        self.waiting.fetch_sub(1, Ordering::SeqCst);
                        let _ = job.events.send(failed());
                        self.metrics.ended(true);
                    }
                    for s in self.active.drain(..) {
                        let _ = s.job.events.send(failed());
                        self.metrics.ended(true);
                    }
                    self.metrics.state(0, 0, 0);
                    if matches!(c, Command::Shutdown) {
                        return true;
                    }
                }
            }
        }
        false
    }

    /// Frees the sequences and queued jobs whose clients went away.
    pub(super) fn drop_abandoned(&mut self) {
        let (metrics, waiting) = (self.metrics, self.waiting);
        self.active.retain(|s| {
            let gone = s.job.events.is_closed();
            if gone {
                metrics.ended(true);
            }
            !gone
        });
        self.queue.retain(|j| {
            let gone = j.events.is_closed();
            if gone {
                waiting.fetch_sub(1, Ordering::SeqCst);
                metrics.ended(true);
            }
            !gone
        });
    }

    /// Starts queued jobs, up to `max_seqs` running sequences; a job that cannot start (a
    /// prompt too long, say) fails with a 400.
    pub(super) fn admit(&mut self) {
        let p = self.parts;
        while self.active.len() < p.max_seqs.max(1) {
            let Some(job) = self.queue.pop_front() else {
                break;
            };
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            self.metrics.admitted(job.prompt.len());
            match Seq::new(
                job,
                &p.model,
                self.setup,
                p.drafter.as_ref(),
                p.table.as_ref(),
                p.speculation,
                &mut self.prefix,
            ) {
                Ok(s) => self.active.push(s),
                Err(failed) => {
                    let (job, e) = *failed;
                    let _ = job.events.send(Event::Failed(400, e.to_string()));
                    self.metrics.ended(true);
                }
            }
        }
    }

    /// One turn of work: prompt chunks, then decoding. Returns the sequences that failed,
    /// with why.
    pub(super) fn advance(&mut self) -> Vec<(usize, String)> {
        // Prompt chunks, oldest sequence first, up to `chunk` prompt rows in all (at least
        // one chunk), in the same forward as the decoding sequences' steps when that gives
        // every row its own bits (GGUF blocks on the CPU, or rows within the row-order
        // kernel's 16), else the oldest one's chunk in a forward of its own.
        let mut failed: Vec<(usize, String)> = Vec::new();
        let active = &mut self.active;
        let prefilling: Vec<usize> = (0..active.len())
            .filter(|&i| active[i].prefilled < active[i].job.prompt.len())
            .collect();
        let decoding: Vec<usize> = (0..active.len())
            .filter(|&i| active[i].decoding())
            .collect();
        let batch = prompt_batch(
            active,
            &prefilling,
            &decoding,
            self.chunk,
            &self.parts.model,
        );
        if !batch.is_empty() {
            // The decoding sequences step beside the prompt chunks, without drafts (and take
            // no other step this turn).
            let group = verify_group(
                active,
                &decoding,
                &batch,
                self.chunk,
                None,
                self.max_rows,
                self.metrics,
            );
            if let Err(e) = group {
                failed.extend(decoding.iter().chain(&batch).map(|&j| (j, e.to_string())));
            }
            return failed;
        }
        if let Some(&i) = prefilling.first() {
            self.metrics.prompt_chunks(1);
            if let Err(e) = active[i].prefill_chunk(self.chunk) {
                failed.push((i, e.to_string()));
            }
        }
        self.decode(&decoding, &mut failed);
        failed
    }

    /// Decoding: one speculative block when a sequence runs alone, else stacked plain steps
    /// (with the lookups' drafts that pay for their rows).
    fn decode(&mut self, decoding: &[usize], failed: &mut Vec<(usize, String)>) {
        let still_prefilling = self.active.iter().any(|s| s.prefilled < s.job.prompt.len());
        if decoding.len() == 1
            && !still_prefilling
            && self.queue.is_empty()
            && self.active[decoding[0]].dec.is_some()
            && self.active[decoding[0]].proposer.is_some()
        {
            let i = decoding[0];
            if let Err(e) = self.active[i].block(self.metrics) {
                failed.push((i, e.to_string()));
            }
            return;
        }
        let threshold =
            draft_threshold(self.modelled.or(self.costs.coefficients()), decoding.len());
        // One forward for every decoding sequence where any row count keeps each row's
        // bits (GGUF blocks on the CPU), else groups within the block kernel's rows.
        let per_forward = if self.max_rows == usize::MAX {
            decoding.len().max(1)
        } else {
            QUANT_MAX_ROWS
        };
        for group in decoding.chunks(per_forward) {
            let t0 = Instant::now();
            let beside = Beside {
                threshold,
                sampled: self.parts.sampled_blocks,
                rows: self.parts.beside_rows,
            };
            match verify_group(
                &mut self.active,
                group,
                &[],
                self.chunk,
                Some(beside),
                self.max_rows,
                self.metrics,
            ) {
                Ok(rows) => self.costs.add(rows - 1, t0.elapsed().as_secs_f64()),
                Err(e) => failed.extend(group.iter().map(|&i| (i, e.to_string()))),
            }
        }
    }

    /// Sends the new tokens; retires finished, failed and abandoned sequences (a finished
    /// one's session goes to the prefix cache); updates the gauges.
    pub(super) fn retire(&mut self, mut failed: Vec<(usize, String)>) {
        let metrics = self.metrics;
        failed.sort_unstable();
        failed.dedup_by_key(|(i, _)| *i);
        for (i, msg) in failed.iter().rev() {
            let s = self.active.remove(*i);
            tracing::error!("sequence failed: {msg}");
            let _ = s.job.events.send(Event::Failed(500, msg.clone()));
            metrics.ended(true);
        }
        let mut i = 0;
        while i < self.active.len() {
            let alive = self.active[i].emit(metrics);
            if self.active[i].stop.is_none() && alive {
                i += 1;
                continue;
            }
            metrics.ended(!alive);
            let s = self.active.remove(i);
            if alive {
                self.prefix.insert(&s.tokens, s.verifier.into_session());
            }
        }
        let kv: usize = self
            .active
            .iter()
            .map(|s| s.verifier.kv_bytes().total)
            .sum();
        metrics.state(self.active.len(), self.queue.len(), kv);
        metrics.prefix_cache(self.prefix.stats(), self.prefix.len(), self.prefix.bytes());
        metrics.replays(self.parts.model.replay_stats());
    }
}
