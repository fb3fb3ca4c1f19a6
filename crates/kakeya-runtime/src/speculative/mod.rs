//! Lossless speculative decoding (greedy or sampled: token-identical to plain decoding),
//! split by role: a [`Proposer`] drafts tokens, the
//! [`Verifier`] checks a whole block in one forward and rolls back the rejected tail, and the
//! [`driver`] runs the loop. The acceptance rule is the pure function [`accept_greedy`] over the
//! verifier's tokens (arg-max, or [`sampled_posterior`]'s position-keyed draws).
//! [Leviathan et al., arXiv:2211.17192; DFlash, arXiv:2602.06036]

pub mod adaptive;
pub mod cost;
pub mod driver;
pub mod ngram;
pub mod proposer;
pub mod sampled;
pub mod table;
pub mod tree;
pub mod tree_drafts;
pub mod verifier;

pub use adaptive::{BlockSchedule, DraftSource, Schedule, ScheduleStats};
pub use cost::CostLine;
pub use driver::{
    Costs, SpecConfig, SpecDecoder, SpecStats, TREE_MAX_VERIFY_ROWS, speculative_generate,
    speculative_generate_tree,
};
pub use ngram::{CombinedProposer, NGRAM_BLOCK, NgramMatch, NgramProposer};
pub use proposer::{DFlashProposer, DraftKind, Proposer, ReplayProposer};
pub use sampled::sampled_posterior;
pub use table::NgramTable;
pub use tree::{DraftTree, EdgeCalibration, EdgeSource, TreeNode};
pub use tree_drafts::{TreeDrafts, TreeEvidence};
pub use verifier::Verifier;

/// Greedy acceptance: the number of drafts accepted, i.e. the longest prefix with
/// `drafts[i] == posterior[i]`, where `posterior[i]` is the verifier's argmax after block row
/// `i` (row 0 is the last committed token, row `i + 1` holds `drafts[i]`).
///
/// The block then commits `posterior[0..=a]`: the `a` accepted drafts (equal to the verifier's
/// own choices) and the verifier's token after them, so every block commits at least one.
///
/// # Panics
/// If `posterior` is shorter than `drafts.len() + 1` (a verifier bug, not user input).
pub fn accept_greedy(drafts: &[u32], posterior: &[u32]) -> usize {
    assert!(
        posterior.len() > drafts.len(),
        "posterior has {} rows for {} drafts",
        posterior.len(),
        drafts.len()
    );
    kakeya_models::dflash::accepted_drafts(drafts, posterior)
}

#[cfg(test)]
mod tests {
    use super::accept_greedy;

    #[test]
    fn accepts_the_longest_matching_prefix() {
        assert_eq!(accept_greedy(&[5, 6, 7], &[5, 6, 7, 8]), 3);
        assert_eq!(accept_greedy(&[5, 6, 7], &[5, 6, 9, 8]), 2);
        assert_eq!(accept_greedy(&[5, 6, 7], &[1, 6, 7, 8]), 0);
        // A later match after a mismatch does not count.
        assert_eq!(accept_greedy(&[5, 6, 7], &[5, 0, 7, 8]), 1);
        assert_eq!(accept_greedy(&[], &[3]), 0);
    }

    #[test]
    #[should_panic(expected = "posterior has 3 rows for 3 drafts")]
    fn too_short_a_posterior_is_a_bug() {
        accept_greedy(&[1, 2, 3], &[1, 2, 3]);
    }
}
