//! The engine: one thread that owns the model and every running sequence, and schedules
//! them continuous-batching style. Each turn of its loop admits waiting requests (up to
//! `max_seqs` sequences) and advances every sequence: the next prompt chunks of new
//! sequences (up to one chunk's rows in all) and one token of each decoding sequence in one
//! stacked forward (of up to [`QUANT_MAX_ROWS`] sequences, where greedy speculative sequences
//! verify the lookup drafts that pay for their rows beside the others: `verify_group`), or —
//! when one sequence runs alone and nothing waits — one speculative block of it. Every path
//! gives each sequence exactly the tokens plain decoding gives it alone: batched rows are bit
//! for bit single rows
//! ([`Session::step_batch`]), speculation is lossless, and sampling draws are keyed by
//! position. A sequence whose client went away is dropped at the next turn, freeing its
//! caches. A finished sequence's session goes to the prefix cache, where a later prompt that
//! starts the same way takes its K/V instead of computing them (`PrefixCache`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::Instant;

use kakeya_models::linear::QUANT_MAX_ROWS;
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::{
    CostLine, Costs, DraftKind, GenerationConfig, KvBytes, KvMode, KvPolicy, KvSetup, NgramTable,
    PrefixCache, Restorer, SpecConfig, StopReason,
};
use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;

mod group;
mod seq;
use group::{Beside, PRIOR_ROW_COST, draft_threshold, prompt_batch, verify_group};
use seq::Seq;

/// What the engine runs on.
#[derive(Debug)]
pub struct EngineParts {
    /// The verifier.
    pub model: GemmaModel,
    /// The DFlash drafter (speculation, and the compact store of the restored KV modes).
    pub drafter: Option<DFlashDrafter>,
    /// How a sequence that runs alone drafts: the proposer and the block schedule; `None`:
    /// plain decoding only.
    pub speculation: Option<(DraftKind, SpecConfig)>,
    /// The static n-gram table the proposer's lookups fall back on.
    pub table: Option<Arc<NgramTable>>,
    /// How sequences keep their K/V.
    pub policy: KvPolicy,
    /// f_θ, for the restored KV modes.
    pub restorer: Option<Box<dyn Restorer>>,
    /// Prompt tokens per prefill forward (the same chunks as `kakeya infer`'s give the same
    /// numbers).
    pub prefill_chunk: usize,
    /// Most sequences prefilling or decoding at once.
    pub max_seqs: usize,
    /// Bytes of finished sequences' sessions kept for prompts that start the same way (0: no
    /// prefix cache; it is off anyway where it would change numbers, see
    /// [`PrefixCache::applies`]).
    pub prefix_cache_bytes: usize,
    /// Sampled requests verify their lookups' drafts beside other sequences too (each row
    /// drawn with its position's uniform), as greedy ones always do. Worth it where a drawn
    /// row costs what a greedy one does — on a GPU, which draws where the logits are — not on
    /// the CPU, where a sampled row computes every logit and the host draws
    /// ([`Self::sampled_blocks_by_default`]).
    pub sampled_blocks: bool,
    /// Beside other sequences, blocks padded to one fixed length so that a step's forward has
    /// at most this many rows and the same shape at every step while its set of sequences
    /// lasts — what a GPU replays from one recording (an issued step costs it ≈ 5 replays) —
    /// instead of as many drafts as the schedule expects to pay, a shape that changes every
    /// step ([`Self::beside_rows_by_default`]).
    pub beside_rows: Option<usize>,
}

impl EngineParts {
    /// Whether [`Self::sampled_blocks`] pays on `model`'s device: on a GPU.
    pub fn sampled_blocks_by_default(model: &GemmaModel) -> bool {
        kakeya_models::gpu::is_gpu(model.device())
    }

    /// [`Self::beside_rows`] where `model` replays recorded forwards (on a GPU: the rows the
    /// recorded kernels take); `None` elsewhere.
    pub fn beside_rows_by_default(model: &GemmaModel) -> Option<usize> {
        model
            .replays_decode()
            .then_some(kakeya_models::gpu::GPU_ROWS_MAX)
    }
}

/// One request for the engine.
#[derive(Debug)]
pub struct Job {
    /// Prompt ids (`<bos>` included).
    pub prompt: Vec<u32>,
    /// Stop rules and sampling (`prefill_chunk` is the engine's).
    pub cfg: GenerationConfig,
    /// Where the tokens go; dropping the receiver cancels the sequence.
    pub events: UnboundedSender<Event>,
    /// When the request arrived (time to first token).
    pub arrived: Instant,
}

/// What the engine tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// Tokens no stop rule can take back any more.
    Tokens(Vec<u32>),
    /// The sequence ended.
    Done(Box<Outcome>),
    /// The sequence failed or was aborted: (HTTP status, message).
    Failed(u16, String),
}

/// Figures of speculative blocks.
#[derive(Debug, Clone, Serialize)]
pub struct SpecSummary {
    /// The proposer.
    pub draft: DraftKind,
    /// Verifier forwards over blocks (plain steps of the adaptive schedule included).
    pub blocks: usize,
    /// Draft tokens proposed.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Tokens committed per block.
    pub mean_acceptance_length: f64,
}

/// How a sequence ended, and its figures (sent under the responses' `kakeya` key).
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// Why it ended.
    pub stop_reason: StopReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache (not computed).
    pub cached_prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// `speculative` (blocks only), `batched` (plain steps, possibly stacked with other
    /// sequences'), or `speculative+batched`.
    pub mode: &'static str,
    /// Plain decode steps it took part in.
    pub batched_steps: usize,
    /// Speculative blocks, when it ran any.
    pub speculative: Option<SpecSummary>,
    /// The KV mode.
    pub kv_mode: KvMode,
    /// K/V bytes held at the end, by part.
    pub kv: KvBytes,
    /// Seconds from arrival to the first token.
    pub time_to_first_token_s: f64,
    /// Generated tokens per second after the first.
    pub decode_tok_s: f64,
}

/// What the HTTP side sends the engine.
#[derive(Debug)]
pub enum Command {
    /// A new request.
    Job(Job),
    /// Fail every request (shutdown after the drain time).
    Abort,
    /// Stop the loop.
    Shutdown,
}

/// Runs the engine loop on the calling thread until [`Command::Shutdown`] (or every sender
/// is gone). Call it from a rayon worker (the CLI runs its command on one): the kernels then
/// split their work from inside the pool.
pub fn run(
    parts: EngineParts,
    commands: Receiver<Command>,
    metrics: &Metrics,
    waiting: &AtomicUsize,
) {
    let EngineParts {
        model,
        drafter,
        speculation,
        table,
        policy,
        restorer,
        prefill_chunk,
        max_seqs,
        prefix_cache_bytes,
        sampled_blocks,
        beside_rows,
    } = parts;
    let prefix_budget = if PrefixCache::applies(&model, &policy) {
        prefix_cache_bytes
    } else {
        0
    };
    let mut setup = KvSetup::new(policy);
    if let Some(d) = &drafter {
        setup = setup.drafter(d);
    }
    if let Some(r) = &restorer {
        setup = setup.restorer(r.as_ref());
    }
    let mut queue: VecDeque<Job> = VecDeque::new();
    let mut active: Vec<Seq<'_>> = Vec::new();
    let mut prefix = PrefixCache::new(prefix_budget);
    let chunk = prefill_chunk.max(1);
    // Seconds of the stacked decode forwards against their rows: what a draft row beside
    // other sequences costs.
    let mut costs = CostLine::new(PRIOR_ROW_COST);
    // Or the model of them the speculation settings give (tests, simulations).
    let modelled = match speculation {
        Some((
            _,
            SpecConfig {
                costs: Costs::Linear {
                    step_us, row_us, ..
                },
                ..
            },
        )) => Some((f64::from(step_us) * 1e-6, f64::from(row_us) * 1e-6)),
        _ => None,
    };
    let max_rows = if model.rows_invariant_at_any_count() {
        usize::MAX
    } else {
        QUANT_MAX_ROWS
    };
    loop {
        // Intake: block while idle.
        let mut commands_now = Vec::new();
        if active.is_empty() && queue.is_empty() {
            let next = match commands.recv_timeout(crate::memory::TRIM_AFTER_IDLE) {
                Err(RecvTimeoutError::Timeout) => {
                    crate::memory::release_free_memory();
                    commands.recv().ok()
                }
                got => got.ok(),
            };
            match next {
                Some(c) => commands_now.push(c),
                None => return,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(c) => commands_now.push(c),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    commands_now.push(Command::Shutdown);
                    break;
                }
            }
        }
        for c in commands_now {
            match c {
                Command::Job(job) => queue.push_back(job),
                Command::Abort | Command::Shutdown => {
                    let shutdown = matches!(c, Command::Shutdown);
                    for job in queue.drain(..) {
                        waiting.fetch_sub(1, Ordering::SeqCst);
                        let _ = job
                            .events
                            .send(Event::Failed(503, "the server is shutting down".into()));
                        metrics.ended(true);
                    }
                    for s in active.drain(..) {
                        let _ = s
                            .job
                            .events
                            .send(Event::Failed(503, "the server is shutting down".into()));
                        metrics.ended(true);
                    }
                    metrics.state(0, 0, 0);
                    if shutdown {
                        return;
                    }
                }
            }
        }
        // Clients gone: free their sequences.
        active.retain(|s| {
            let gone = s.job.events.is_closed();
            if gone {
                metrics.ended(true);
            }
            !gone
        });
        queue.retain(|j| {
            let gone = j.events.is_closed();
            if gone {
                waiting.fetch_sub(1, Ordering::SeqCst);
                metrics.ended(true);
            }
            !gone
        });
        // Admission.
        while active.len() < max_seqs.max(1) {
            let Some(job) = queue.pop_front() else { break };
            waiting.fetch_sub(1, Ordering::SeqCst);
            metrics.admitted(job.prompt.len());
            match Seq::new(
                job,
                &model,
                setup,
                drafter.as_ref(),
                table.as_ref(),
                speculation,
                &mut prefix,
            ) {
                Ok(s) => active.push(s),
                Err(failed) => {
                    let (job, e) = *failed;
                    let _ = job.events.send(Event::Failed(400, e.to_string()));
                    metrics.ended(true);
                }
            }
        }
        if active.is_empty() {
            metrics.state(0, queue.len(), 0);
            continue;
        }
        // Prompt chunks, oldest sequence first, up to `chunk` prompt rows in all (at least
        // one chunk), in the same forward as the decoding sequences' steps when that gives
        // every row its own bits (GGUF blocks on the CPU, or rows within the row-order
        // kernel's 16), else the oldest one's chunk in a forward of its own.
        let mut failed: Vec<(usize, String)> = Vec::new();
        let prefilling: Vec<usize> = (0..active.len())
            .filter(|&i| active[i].prefilled < active[i].job.prompt.len())
            .collect();
        let decoding: Vec<usize> = (0..active.len())
            .filter(|&i| active[i].decoding())
            .collect();
        let batch = prompt_batch(&active, &prefilling, &decoding, chunk, &model);
        if !batch.is_empty() {
            // The decoding sequences step beside the prompt chunks, without drafts.
            let group = verify_group(
                &mut active,
                &decoding,
                &batch,
                chunk,
                None,
                max_rows,
                metrics,
            );
            if let Err(e) = group {
                failed.extend(decoding.iter().chain(&batch).map(|&j| (j, e.to_string())));
            }
        } else if let Some(&i) = prefilling.first() {
            metrics.prompt_chunks(1);
            if let Err(e) = active[i].prefill_chunk(chunk) {
                failed.push((i, e.to_string()));
            }
        }
        // Decode: one speculative block when a sequence runs alone, else stacked plain steps.
        let still_prefilling = active.iter().any(|s| s.prefilled < s.job.prompt.len());
        if !batch.is_empty() {
            // The decoding sequences took their step beside the prompt chunks.
        } else if decoding.len() == 1
            && !still_prefilling
            && queue.is_empty()
            && active[decoding[0]].dec.is_some()
            && active[decoding[0]].proposer.is_some()
        {
            let i = decoding[0];
            if let Err(e) = active[i].block(metrics) {
                failed.push((i, e.to_string()));
            }
        } else {
            let threshold = draft_threshold(modelled.or(costs.coefficients()), decoding.len());
            // One forward for every decoding sequence where any row count keeps each row's
            // bits (GGUF blocks on the CPU), else groups within the block kernel's rows.
            let per_forward = if max_rows == usize::MAX {
                decoding.len().max(1)
            } else {
                QUANT_MAX_ROWS
            };
            for group in decoding.chunks(per_forward) {
                let t0 = Instant::now();
                match verify_group(
                    &mut active,
                    group,
                    &[],
                    chunk,
                    Some(Beside {
                        threshold,
                        sampled: sampled_blocks,
                        rows: beside_rows,
                    }),
                    max_rows,
                    metrics,
                ) {
                    Ok(rows) => costs.add(rows - 1, t0.elapsed().as_secs_f64()),
                    Err(e) => failed.extend(group.iter().map(|&i| (i, e.to_string()))),
                }
            }
        }
        // Send tokens; retire finished, failed and abandoned sequences.
        failed.sort_unstable();
        failed.dedup_by_key(|(i, _)| *i);
        for (i, msg) in failed.iter().rev() {
            let s = active.remove(*i);
            tracing::error!("sequence failed: {msg}");
            let _ = s.job.events.send(Event::Failed(500, msg.clone()));
            metrics.ended(true);
        }
        let mut i = 0;
        while i < active.len() {
            let alive = active[i].emit(metrics);
            if active[i].stop.is_none() && alive {
                i += 1;
                continue;
            }
            metrics.ended(!alive);
            let s = active.remove(i);
            if alive {
                prefix.insert(&s.tokens, s.verifier.into_session());
            }
        }
        let kv: usize = active.iter().map(|s| s.verifier.kv_bytes().total).sum();
        metrics.state(active.len(), queue.len(), kv);
        metrics.prefix_cache(prefix.stats(), prefix.len(), prefix.bytes());
        metrics.replays(model.replay_stats());
    }
}

/// The number of requests waiting for a slot, shared with the HTTP side (which refuses new
/// requests when the queue is full).
pub type Waiting = Arc<AtomicUsize>;
