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
use kakeya_models::{DFlashDrafter, Gemma3Model};
use kakeya_runtime::{
    CostLine, Costs, DraftKind, GenerationConfig, KvBytes, KvMode, KvPolicy, KvSetup, NgramTable,
    PrefixCache, Restorer, RuntimeError, Sampler, Sampling, Session, SpecConfig, StopReason,
    Verified, Want, accept_greedy,
};
use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;

mod seq;
use seq::Seq;

/// What the engine runs on.
#[derive(Debug)]
pub struct EngineParts {
    /// The verifier.
    pub model: Gemma3Model,
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
}

impl EngineParts {
    /// Whether [`Self::sampled_blocks`] pays on `model`'s device: on a GPU.
    pub fn sampled_blocks_by_default(model: &Gemma3Model) -> bool {
        kakeya_models::gpu::is_gpu(model.device())
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

/// The sequences (indices into `active`, from `prefilling`, oldest first) whose next prompt
/// chunks run in this turn's forward beside the decoding sequences' steps: as many as fit in
/// `chunk` prompt rows (at least one) and [`QUANT_MAX_ROWS`] sequences in all. Empty when
/// nothing prefills, or when that forward would not give every row its own bits (weights off
/// the block kernel with more than its rows): the oldest chunk then runs alone.
fn prompt_batch(
    active: &[Seq<'_>],
    prefilling: &[usize],
    decoding: &[usize],
    chunk: usize,
    model: &Gemma3Model,
) -> Vec<usize> {
    if decoding.len() >= QUANT_MAX_ROWS {
        return Vec::new();
    }
    let any_count = model.rows_invariant_at_any_count();
    let mut batch = Vec::new();
    let mut rows = 0;
    for &i in prefilling {
        let n = (active[i].job.prompt.len() - active[i].prefilled).min(chunk);
        // Past the budget (the first chunk always fits it), or past the rows that keep bits.
        let over_budget = !batch.is_empty()
            && (rows + n > chunk || decoding.len() + batch.len() >= QUANT_MAX_ROWS);
        let changes_bits = !any_count && rows + n + decoding.len() > QUANT_MAX_ROWS;
        if over_budget || changes_bits {
            break;
        }
        batch.push(i);
        rows += n;
    }
    if decoding.is_empty() && batch.len() == 1 {
        // One chunk alone: the sequence's own prefill.
        batch.clear();
    }
    batch
}

/// A stacked forward's cost of each row beyond the first, relative to one row, until measured
/// (the CPU block kernel: 8 rows ≈ 2 single-row steps).
const PRIOR_ROW_COST: f64 = 0.15;

/// The chance of being committed from which a draft row beside `n` sequences' steps pays: its
/// cost against the batch's tokens per second without it, `β · n / T(n)` for a forward of
/// `R` rows costing `T = α + β·(R − 1)` seconds (`coefficients`: `(α, β)`, the prior's when
/// nothing was measured yet).
fn draft_threshold(coefficients: Option<(f64, f64)>, n: usize) -> f64 {
    let (alpha, beta) = coefficients.unwrap_or((1.0, PRIOR_ROW_COST));
    let plain = alpha + beta * (n.max(1) - 1) as f64;
    (beta * n as f64 / plain.max(1e-12)).min(1.0)
}

/// Which decoding sequences verify drafts beside other sequences, and how many.
#[derive(Debug, Clone, Copy)]
struct Beside {
    /// Least chance of being committed a draft row must have.
    threshold: f64,
    /// Sampled sequences too ([`EngineParts::sampled_blocks`]), not only greedy ones.
    sampled: bool,
}

/// One decode step of the sequences `group` (indices into `active`) in one stacked forward,
/// where each speculative sequence that `beside` admits (`None`: none) verifies a block — its
/// newest token, then the drafts its lookups offer whose chance of being committed is at
/// least the threshold — and every other sequence takes a plain step; with, in the same forward, the next
/// prompt chunk (of at most `chunk` tokens) of each sequence in `prefill` (not in `group`); at
/// most `max_rows` rows in all (the drafts give way). Returns the rows run.
fn verify_group(
    active: &mut [Seq<'_>],
    group: &[usize],
    prefill: &[usize],
    chunk: usize,
    beside: Option<Beside>,
    max_rows: usize,
    metrics: &Metrics,
) -> Result<usize, RuntimeError> {
    let prompt_chunks: Vec<Vec<u32>> = prefill
        .iter()
        .map(|&i| {
            let s = &active[i];
            let end = (s.prefilled + chunk).min(s.job.prompt.len());
            s.job.prompt[s.prefilled..end].to_vec()
        })
        .collect();
    let prompt_rows: usize = prompt_chunks.iter().map(Vec::len).sum();
    let mut spare = max_rows.saturating_sub(group.len() + prompt_rows);
    if group.len() + prefill.len() > 1 {
        for &i in group {
            active[i].beside_others();
        }
    }
    let mut blocks: Vec<Vec<u32>> = Vec::with_capacity(group.len() + prefill.len());
    let mut verifies: Vec<bool> = Vec::with_capacity(group.len() + prefill.len());
    for &i in group {
        let s = &mut active[i];
        let last = *s.tokens.last().expect("a decoding sequence has tokens");
        let ctx = s.verifier.model().config.max_position_embeddings;
        let mut block = vec![last];
        // A sampled block's rows are drawn with their positions' uniforms (speculative
        // sampling's rule).
        let verifies_block = match (s.dec.as_mut(), s.proposer.as_mut(), beside) {
            (Some(dec), Some(proposer), Some(Beside { threshold, sampled }))
                if sampled || s.sampler.mode() == &Sampling::Greedy =>
            {
                let room = 1 + spare
                    .min(s.sink.remaining().saturating_sub(1))
                    .min(ctx.saturating_sub(s.verifier.len() + 1));
                let drafts = dec.drafts_beside(proposer.as_mut(), &s.tokens, room, threshold)?;
                spare -= drafts.len();
                block.extend(drafts);
                true
            }
            _ => false,
        };
        blocks.push(block);
        verifies.push(verifies_block);
    }
    blocks.extend(prompt_chunks);
    verifies.extend(prefill.iter().map(|_| false));
    let order: Vec<usize> = group.iter().chain(prefill).copied().collect();
    let rows = blocks.iter().map(Vec::len).sum();
    let samplers: Vec<Sampler> = order.iter().map(|&i| active[i].sampler.clone()).collect();
    let wants: Vec<Want<'_>> = samplers
        .iter()
        .zip(&verifies)
        .map(|(s, &v)| if v { Want::Block(s) } else { Want::Next(s) })
        .collect();
    // Sessions in `order`'s order (each index once).
    let mut slots: Vec<Option<&mut Session<'_>>> = active
        .iter_mut()
        .map(|s| Some(s.verifier.session_mut()))
        .collect();
    let mut sessions: Vec<&mut Session<'_>> = order
        .iter()
        .map(|&i| slots[i].take().expect("each sequence once"))
        .collect();
    let block_refs: Vec<&[u32]> = blocks.iter().map(Vec::as_slice).collect();
    let verified = Session::verify_batch(&mut sessions, &block_refs, &wants)?;
    drop(sessions);
    drop(slots);
    if !group.is_empty() {
        metrics.batch(group.len());
    }
    if !prefill.is_empty() {
        metrics.prompt_chunks(prefill.len());
    }
    for (k, (&i, v)) in order.iter().zip(verified).enumerate() {
        let (s, block) = (&mut active[i], &blocks[k]);
        if k >= group.len() {
            let Verified::Scores(l) = v else {
                unreachable!("a prompt chunk gets its sampler's scores")
            };
            s.prefilled_to(s.prefilled + block.len(), &l);
            continue;
        }
        s.batched_steps += 1;
        let before = s.tokens.len();
        match v {
            Verified::Block(posterior) => {
                let a = accept_greedy(&block[1..], &posterior);
                metrics.drafts_beside(block.len() - 1, a);
                s.commit_beside(&block[1..], &posterior)?;
            }
            Verified::Scores(l) => {
                let tok = s.sampler.pick_scores(&l, s.verifier.len());
                s.accept(tok);
            }
        }
        metrics.committed(s.tokens.len() - before);
    }
    Ok(rows)
}

/// The number of requests waiting for a slot, shared with the HTTP side (which refuses new
/// requests when the queue is full).
pub type Waiting = Arc<AtomicUsize>;
