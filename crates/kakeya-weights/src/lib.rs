//! Checkpoint I/O for Kakeya: GGUF (with dequantisation), Hugging Face safetensors folders,
//! the Gemma 3 config, DFlash drafter and f_θ folders, and tokenizer loading. Formats and checkpoint names are handled here,
//! at the edge; `kakeya-models` sees one canonical checkpoint.

pub mod argmax;
pub mod checkpoint;
pub mod codes;
pub mod config;
pub mod dense;
pub mod dequant;
pub mod dflash;
pub mod error;
pub mod fsio;
pub mod ftheta;
pub mod gguf;
mod int8;
mod kernel;
pub mod mapped;
pub mod quant;
pub mod rowops;
pub mod tokenizer;

pub use argmax::Argmax;
pub use checkpoint::{Checkpoint, HostTensor};
pub use config::{AttentionKind, Gemma3Config, Gemma4Extras, MoeConfig};
pub use dense::DenseMatrix;
pub use dflash::{DFlashConfig, DraftCheckpoint, StoreDtype};
pub use error::{Result, WeightsError};
pub use ftheta::{FThetaCheckpoint, FThetaConfig};
pub use gguf::GgufFile;
pub use quant::QuantMatrix;
pub use tokenizer::Tokenizer;
