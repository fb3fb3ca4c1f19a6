//! Speculative sampling: verification that keeps the output distribution exactly that of
//! plain sampling. [Leviathan et al., arXiv:2211.17192; Chen et al., arXiv:2302.01318]
//!
//! Kakeya's proposers are deterministic (the drafter's arg-max, a lookup), so a draft `x` is a
//! draw from a point mass `q = δ_x`. The standard rule — accept with probability
//! `min(1, p(x)/q(x))`, on rejection draw from `max(p − q, 0)` normalised — then reads: accept
//! with probability `p(x)`; on rejection draw from `p` without `x`. This module realises that
//! rule with the sampler's position-keyed uniform: the verifier's token at each block row is
//! drawn from `p` by inverse CDF with the uniform of its position, and a draft is accepted iff
//! it equals that token. Acceptance then has probability `p(x)`, a rejection leaves a draw
//! from `p` conditioned on `≠ x` — the standard rule in law — and every committed token is the
//! very token plain sampling draws at that position with the same seed.

use crate::sampler::Sampler;

/// The verifier's token after each block row: row `i` of `rows` (`B × vocab` logits) predicts
/// position `first + i`. Greedy sampling gives the arg-max. The block's accepted length is
/// then [`super::accepted_count`] of the drafts against these tokens.
pub fn sampled_choices(rows: &[f32], vocab: usize, first: usize, sampler: &Sampler) -> Vec<u32> {
    rows.chunks_exact(vocab)
        .enumerate()
        .map(|(i, row)| sampler.pick(row, first + i))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::Sampling;
    use crate::speculative::accepted_count;

    #[test]
    fn acceptance_has_probability_p_of_the_draft_and_commits_p() {
        // Target p = [0.5, 0.3, 0.2] at every position; the draft is token 1. Accepted with
        // probability 0.3; the committed token (draft or the verifier's) is distributed as p.
        let logits: Vec<f32> = [0.5f32, 0.3, 0.2].iter().map(|p| p.ln()).collect();
        let rows: Vec<f32> = logits.iter().chain(&logits).copied().collect();
        let s = Sampler::new(Sampling::Sample {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 5,
        });
        let n = 60_000;
        let (mut h, mut accepted) = ([0usize; 3], 0);
        for k in 0..n {
            let post = sampled_choices(&rows, 3, 2 * k, &s);
            let a = accepted_count(&[1], &post);
            accepted += a;
            h[if a == 1 { 1 } else { post[0] as usize }] += 1;
        }
        for (i, want) in [0.5, 0.3, 0.2].iter().enumerate() {
            let got = h[i] as f64 / n as f64;
            let sd = (want * (1.0 - want) / n as f64).sqrt();
            assert!((got - want).abs() < 5.0 * sd, "token {i}: {got} vs {want}");
        }
        let acc = accepted as f64 / n as f64;
        assert!((acc - 0.3).abs() < 0.01, "acceptance {acc}");
    }

    #[test]
    fn greedy_gives_the_arg_max_rows() {
        let rows = [0.0f32, 2.0, 1.0, 3.0, 0.0, 1.0];
        let s = Sampler::new(Sampling::Greedy);
        assert_eq!(sampled_choices(&rows, 3, 9, &s), vec![1, 0]);
    }
}
