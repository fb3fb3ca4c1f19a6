//! The Gemma family's text decoder: Gemma 3 [transformers `models/gemma3/modeling_gemma3.py`]
//! and what Gemma 4 adds (`moe`: mixture-of-experts MLPs; `per_layer`: per-layer embeddings).

pub mod attention;
mod device;
mod in_place;
mod load;
pub mod model;
pub mod moe;
mod pass;
pub mod per_layer;
mod replay;

pub use attention::AttentionCapture;
pub(crate) use device::DeviceRopes;
pub use device::{Backend, CacheBuffers, GpuSide};
pub use model::{ForwardOutput, ForwardRequest, GemmaModel, Logits};
pub use replay::ReplayStats;
