//! Checkpoint I/O for Kakeya: GGUF files (quantised blocks kept for `kakeya-kernels`, or
//! dequantised), Hugging Face safetensors folders, the Gemma 3/4 configs, DFlash drafter and
//! f_θ folders, and tokenizer loading. Formats and checkpoint names are handled here, at the
//! edge; `kakeya-models` sees one canonical checkpoint.

pub mod checkpoint;
pub mod config;
pub mod dflash;
pub mod error;
pub mod fsio;
pub mod ftheta;
pub mod gguf;
pub mod mapped;
pub mod tokenizer;

pub use checkpoint::{Checkpoint, HostTensor};
pub use config::{AttentionKind, Gemma4Extras, GemmaConfig, MoeConfig};
pub use dflash::{DFlashConfig, DraftCheckpoint, StoreDtype};
pub use error::{Result, WeightsError};
pub use ftheta::{FThetaCheckpoint, FThetaConfig};
pub use gguf::GgufFile;
pub use tokenizer::Tokenizer;
