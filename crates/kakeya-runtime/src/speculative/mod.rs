//! Lossless speculative decoding (greedy or sampled: token-identical to plain decoding),
//! split by role: a [`Proposer`] drafts tokens, the
//! [`Verifier`] checks a whole block in one forward and rolls back the rejected tail, and the
//! [`driver`] runs the loop. The acceptance rule is the pure function [`accepted_count`] over the
//! verifier's tokens (arg-max, or [`sampled_choices`]'s position-keyed draws).
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
pub use sampled::sampled_choices;
pub use table::NgramTable;
pub use tree::{DraftTree, EdgeCalibration, EdgeSource, TreeNode};
pub use tree_drafts::{TreeDrafts, TreeEvidence};
pub use verifier::Verifier;

/// Acceptance: the number of drafts accepted, i.e. the longest prefix with
/// `drafts[i] == choices[i]`, where `choices[i]` is the verifier's token after block row `i`
/// (row 0 is the last committed token, row `i + 1` holds `drafts[i]`): its argmax, or when
/// sampling the token drawn with the position's uniform ([`sampled_choices`]), which makes
/// this rule speculative sampling's.
///
/// The block then commits `choices[0..=a]`: the `a` accepted drafts (equal to the verifier's
/// own choices) and the verifier's token after them, so every block commits at least one.
///
/// # Panics
/// If `choices` is shorter than `drafts.len() + 1` (a verifier bug, not user input).
pub fn accepted_count(drafts: &[u32], choices: &[u32]) -> usize {
    assert!(
        choices.len() > drafts.len(),
        "choices has {} rows for {} drafts",
        choices.len(),
        drafts.len()
    );
    kakeya_models::dflash::accepted_drafts(drafts, choices)
}

#[cfg(test)]
mod tests {
    use super::accepted_count;

    #[test]
    fn accepts_the_longest_matching_prefix() {
        assert_eq!(accepted_count(&[5, 6, 7], &[5, 6, 7, 8]), 3);
        assert_eq!(accepted_count(&[5, 6, 7], &[5, 6, 9, 8]), 2);
        assert_eq!(accepted_count(&[5, 6, 7], &[1, 6, 7, 8]), 0);
        // A later match after a mismatch does not count.
        assert_eq!(accepted_count(&[5, 6, 7], &[5, 0, 7, 8]), 1);
        assert_eq!(accepted_count(&[], &[3]), 0);
    }

    #[test]
    #[should_panic(expected = "choices has 3 rows for 3 drafts")]
    fn too_short_a_posterior_is_a_bug() {
        accepted_count(&[1, 2, 3], &[1, 2, 3]);
    }
}
