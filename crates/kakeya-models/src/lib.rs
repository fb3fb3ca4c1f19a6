//! Kakeya's models — the math over Burn tensors, no file I/O: the Gemma verifier (Gemma 3
//! and 4) and the DFlash drafter. Each model declares its cache layout ([`cache::CacheSpec`]);
//! callers own the caches. Where a model runs is chosen once, at load, from its device
//! ([`gemma::Backend`]): on a GPU it also keeps RoPE tables and recorded forwards there.

pub mod activation;
pub mod cache;
pub mod choice;
pub mod dflash;
pub mod error;
pub mod ftheta;
pub mod gemma;
pub mod gpu;
pub mod host_attention;
pub mod linear;
pub mod norm;
pub mod rope;
pub mod sdpa;
pub mod testing;
pub mod tree_rows;

pub use cache::{
    CacheSpec, DeferredKv, DraftContext, HostTier, InPlace, KvLayers, KvPart, KvSegment,
    LayerCache, Reach, SegmentKv,
};
pub use choice::{Choice, Draw};
pub use dflash::{DFlashDrafter, DraftOutput, DraftRequest};
pub use error::{ModelError, Result};
pub use ftheta::FTheta;
pub use gemma::{ForwardOutput, ForwardRequest, GemmaModel, Logits};
pub use tree_rows::{TREE_MAX_ROWS, TreeRows};
