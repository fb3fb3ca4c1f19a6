//! What drafts the tokens of speculative decoding (`--draft`, [`DraftKind`]), and the block
//! schedule (`--block-size` fixes it; otherwise it adapts).

pub use kakeya_runtime::DraftKind;
use kakeya_runtime::SpecConfig;
pub use kakeya_runtime::spec::NGRAM_BLOCK;

/// Longest block of lookup and table drafts under the adaptive schedule (they cost no
/// forward; a model drafter keeps its own block).
pub const LOOKUP_BLOCK: usize = 16;

/// `--block-size B` fixes every block at `B`; without it blocks adapt up to `default` for a
/// model drafter and up to [`LOOKUP_BLOCK`] for lookups, or less where `fits` (the KV
/// policy's check of a block length) refuses a longer block.
pub fn schedule(
    block_size: Option<usize>,
    default: usize,
    fits: impl Fn(usize) -> bool,
) -> SpecConfig {
    match block_size {
        Some(b) => SpecConfig::fixed(b),
        None => {
            let longest = (default..=LOOKUP_BLOCK.max(default))
                .rev()
                .find(|&b| fits(b))
                .unwrap_or(default);
            SpecConfig::adaptive(default).lookups_up_to(longest)
        }
    }
}
