//! The DFlash block-diffusion drafter [z-lab/dflash `dflash/model.py`, arXiv:2602.06036]:
//! Qwen3-style layers whose keys/values cover a context projected from the verifier's hidden
//! states plus the block being drafted; one forward drafts a whole block.

pub mod core;
pub mod model;
mod replay;

pub use core::{BlockGroup, DraftHead, DraftWeights, accepted_drafts};
pub use model::{DFlashDrafter, DraftOutput, DraftRequest};
