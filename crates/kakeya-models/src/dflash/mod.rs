//! The DFlash block-diffusion drafter [z-lab/dflash `dflash/model.py`, arXiv:2602.06036]:
//! Qwen3-style layers whose keys/values cover a context projected from the verifier's hidden
//! states plus the block being drafted; one forward drafts a whole block.

pub mod core;
mod head;
pub mod model;
mod replay;

pub use core::{BlockGroup, DraftWeights, accepted_drafts};
pub use head::DraftHead;
pub use model::{DFlashDrafter, DraftOutput, DraftRequest};
