//! Kakeya's runtime: KV caches with exact rollback, samplers, the chat template, stop rules
//! and the runaway-loop guard, the autoregressive generator and the speculative engine.

pub mod chat;
pub mod error;
pub mod generate;
pub mod guard;
pub mod kv;
pub mod sampler;
pub mod spec;
pub mod stream;

pub use error::{Result, RuntimeError};
pub use generate::{
    Generation, GenerationConfig, GenerationStats, Session, StopReason, TokenSink, generate,
};
pub use guard::RunawayGuard;
pub use kv::{FullCache, KvCache, RingCache};
pub use sampler::{Sampler, Sampling};
pub use spec::{
    DFlashProposer, Proposer, ReplayProposer, SpecConfig, SpecStats, Verifier, accept_greedy,
    speculative_generate,
};
pub use stream::TextStream;
