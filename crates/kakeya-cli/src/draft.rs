//! What drafts the tokens of speculative decoding (`--draft`, [`DraftKind`]), and the block
//! schedule (`--block-size` fixes it; otherwise it adapts).

pub use kakeya_runtime::DraftKind;
use kakeya_runtime::SpecConfig;
pub use kakeya_runtime::speculative::NGRAM_BLOCK;

/// `--block-size B` fixes every block at `B`; without it blocks adapt up to `default`.
pub fn schedule(block_size: Option<usize>, default: usize) -> SpecConfig {
    match block_size {
        Some(b) => SpecConfig::fixed(b),
        None => SpecConfig::adaptive(default),
    }
}
