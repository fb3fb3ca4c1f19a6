//! Gemma 3 text decoder [transformers `models/gemma3/modeling_gemma3.py`].

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
pub use device::CacheBuffers;
pub(crate) use device::DeviceRopes;
pub use model::{ForwardOutput, ForwardRequest, Gemma3Model, Logits};
pub use replay::ReplayStats;
