//! The engine: one thread that owns the model and every running sequence, and schedules
//! them continuous-batching style. Each turn of its loop admits waiting requests (up to
//! `max_seqs` sequences) and advances every sequence: the next prompt chunks of new
//! sequences (up to one chunk's rows in all) and one token of each decoding sequence in one
//! stacked forward (of up to [`kakeya_models::linear::QUANT_MAX_ROWS`] sequences, where greedy speculative sequences
//! verify the lookup drafts that pay for their rows beside the others: `verify_group`), or —
//! when one sequence runs alone and nothing waits — one speculative block of it. Every path
//! gives each sequence exactly the tokens plain decoding gives it alone: batched rows are bit
//! for bit single rows
//! ([`Session::run_batch`]), speculation is lossless, and sampling draws are keyed by
//! position. A sequence whose client went away is dropped at the next turn, freeing its
//! caches. A finished sequence's session goes to the prefix cache, where a later prompt that
//! starts the same way takes its K/V instead of computing them
//! ([`kakeya_runtime::PrefixCache`]). The turns themselves are `scheduler.rs`.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::mpsc::Receiver;
use std::time::Instant;

use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::{
    DraftKind, GenerationConfig, KvBytes, KvMode, KvPolicy, KvSetup, NgramTable, Restorer,
    SpecConfig, StopReason,
};
use serde::Serialize;
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;

mod group;
mod scheduler;
mod seq;
use scheduler::Scheduler;

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
    let mut setup = KvSetup::new(parts.policy);
    if let Some(d) = &parts.drafter {
        setup = setup.drafter(d);
    }
    if let Some(r) = &parts.restorer {
        setup = setup.restorer(r.as_ref());
    }
    let mut turns = Scheduler::new(&parts, setup, metrics, waiting);
    loop {
        let Some(commands_now) = turns.intake(&commands) else {
            return;
        };
        if turns.apply(commands_now) {
            return;
        }
        turns.drop_abandoned();
        turns.admit();
        if turns.active.is_empty() {
            metrics.state(0, turns.queue.len(), 0);
            continue;
        }
        let failed = turns.advance();
        turns.retire(failed);
    }
}

/// The number of requests waiting for a slot, shared with the HTTP side (which refuses new
/// requests when the queue is full).
pub type Waiting = Arc<AtomicUsize>;
