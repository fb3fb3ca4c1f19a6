//! Kakeya's runtime: KV caches with exact rollback, samplers, the chat template and the
//! autoregressive generator.

pub mod chat;
pub mod error;
pub mod generate;
pub mod kv;
pub mod sampler;

pub use error::{Result, RuntimeError};
pub use generate::{Generation, GenerationConfig, GenerationStats, Session, StopReason, generate};
pub use kv::{FullCache, KvCache, RingCache};
pub use sampler::{Sampler, Sampling};
