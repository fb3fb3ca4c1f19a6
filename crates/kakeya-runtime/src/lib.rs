//! Kakeya's runtime: KV caches with exact rollback, samplers, the chat template, stop rules
//! and the runaway-loop guard, the autoregressive generator and the speculative engine.

pub mod chat;
pub mod error;
pub mod generate;
pub mod guard;
pub mod kv;
pub mod prefix;
pub mod sampler;
pub mod session;
pub mod speculative;
pub mod stream;

pub use error::{Result, RuntimeError};
pub use generate::{
    Generation, GenerationConfig, GenerationStats, StopReason, TokenSink, generate, generate_batch,
};
pub use guard::RunawayGuard;
pub use kv::{
    BOUNDED_PRESETS, CompactStore, DraftReach, FThetaRestorer, FullCache, GLOBAL_WINDOW, KvBytes,
    KvCache, KvDtype, KvMode, KvPolicy, MIXED_PRESETS, OracleRestorer, RESIDUAL_PRESETS, Restorer,
    RingCache, SequenceKv, StoreFormat,
};
pub use prefix::{PrefixCache, PrefixStats};
pub use sampler::{Sampler, Sampling, Scores};
pub use session::{KvSetup, Session, Verified, Want};
pub use speculative::{
    CombinedProposer, CostLine, Costs, DFlashProposer, DraftKind, DraftSource, NgramProposer,
    NgramTable, Proposer, ReplayProposer, Schedule, SpecConfig, SpecDecoder, SpecStats, TreeDrafts,
    Verifier, accepted_count, speculative_generate, speculative_generate_tree,
};
pub use stream::TextStream;
