//! How a run chooses its tokens: greedy, or seeded sampling with temperature, top-k, top-p
//! (the rule itself is `kakeya_models::choice`, shared with the GPU's draw).

use kakeya_models::choice::{Choice, Draw};
use serde::{Deserialize, Serialize};

/// How the next token is chosen. Closed: every mode is listed here.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Sampling {
    /// Arg-max (first index on ties).
    Greedy,
    /// Sample from `softmax(logits / temperature)` restricted to the `top_k` most likely
    /// tokens and then to the smallest set whose mass reaches `top_p`.
    Sample {
        /// Temperature (> 0).
        temperature: f32,
        /// Keep only this many most likely tokens (0 = all).
        top_k: usize,
        /// Nucleus mass in (0, 1] (1 = all).
        top_p: f32,
        /// RNG seed: the same seed gives the same tokens.
        seed: u64,
    },
}

/// A [`Sampling`] and its randomness: the token at position `pos` is drawn by inverse CDF
/// with a uniform that depends only on the seed and `pos`. So a sequence's tokens do not
/// depend on how the positions were computed — one at a time, or in speculative blocks of
/// any length — and speculative sampling commits exactly plain sampling's tokens.
#[derive(Debug, Clone)]
pub struct Sampler {
    mode: Sampling,
}

/// Index of the largest value (first on ties); `None` for an empty slice.
pub use kakeya_kernels::argmax::first_max as argmax;

/// What the next token is chosen from: a forward's logits, or — for greedy decoding — the
/// greedy choice alone (exactly the logits' argmax, found without most of them where the
/// model's head allows: [`Choice::Greedy`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Scores {
    /// The position's logits, `vocab` values.
    Logits(Vec<f32>),
    /// The greedy choice.
    Greedy(u32),
    /// The token the sampler's rule already drew for the position the forward predicts, on
    /// the GPU that held the logits ([`Choice::Draw`]).
    Drawn(u32),
}

impl Sampler {
    /// A sampler for `mode`.
    pub fn new(mode: Sampling) -> Self {
        Self { mode }
    }

    /// The mode.
    pub fn mode(&self) -> &Sampling {
        &self.mode
    }

    /// The choice a forward makes for [`Self::pick_scores`]: greedy, or this sampler's draw
    /// (on a GPU drawn there, elsewhere from the logits by [`Self::pick`]).
    pub fn choice(&self) -> Choice {
        self.draw().map_or(Choice::Greedy, Choice::Draw)
    }

    /// The sampling rule as a forward's request ([`kakeya_models::Draw`]: the same rule and
    /// uniforms, drawn on a GPU); `None` when greedy.
    pub fn draw(&self) -> Option<Draw> {
        match self.mode {
            Sampling::Greedy => None,
            Sampling::Sample {
                temperature,
                top_k,
                top_p,
                seed,
            } => Some(Draw {
                temperature,
                top_k,
                top_p,
                seed,
            }),
        }
    }

    /// Picks the token at position `pos` from what [`Self::wants`] asked for. A greedy choice
    /// given to a sampling sampler is a caller's bug; it is taken as is.
    pub fn pick_scores(&self, scores: &Scores, pos: usize) -> u32 {
        match scores {
            Scores::Logits(l) => self.pick(l, pos),
            Scores::Greedy(id) => {
                debug_assert!(
                    matches!(self.mode, Sampling::Greedy),
                    "greedy scores for sampling"
                );
                *id
            }
            Scores::Drawn(id) => *id,
        }
    }

    /// Picks the token at position `pos` from the logits that predict it: the first largest,
    /// or [`Draw::pick`].
    pub fn pick(&self, logits: &[f32], pos: usize) -> u32 {
        match self.draw() {
            None => argmax(logits).unwrap_or(0) as u32,
            Some(d) => d.pick(logits, pos),
        }
    }

    /// The uniform in `[0, 1)` of position `pos` (53 random bits of the seed and `pos`).
    pub fn uniform(&self, pos: usize) -> f64 {
        let seed = match self.mode {
            Sampling::Sample { seed, .. } => seed,
            Sampling::Greedy => 0,
        };
        kakeya_models::choice::uniform(seed, pos)
    }

    /// The distribution [`Self::pick`] draws from ([`Draw::distribution`]). Greedy: the
    /// arg-max with probability 1.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        match self.draw() {
            Some(d) => d.distribution(logits),
            None => argmax(logits).map_or_else(Vec::new, |i| vec![(i as u32, 1.0)]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_max() {
        assert_eq!(
            Sampler::new(Sampling::Greedy).pick(&[0.0, 3.0, 3.0, 1.0], 0),
            1
        );
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_repeats() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32).collect();
        let mode = |k, seed| Sampling::Sample {
            temperature: 1.0,
            top_k: k,
            top_p: 1.0,
            seed,
        };
        let s = Sampler::new(mode(1, 7));
        assert_eq!(s.pick(&logits, 4), argmax(&logits).unwrap() as u32);
        let a: Vec<u32> = {
            let s = Sampler::new(mode(0, 3));
            (0..20).map(|pos| s.pick(&logits, pos)).collect()
        };
        let b: Vec<u32> = {
            let s = Sampler::new(mode(0, 3));
            (0..20).map(|pos| s.pick(&logits, pos)).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().any(|&t| t != a[0]),
            "sampling at T=1 over 50 tokens should vary"
        );
    }

    /// Draws `n` tokens and returns how often each index came out.
    fn histogram(mode: Sampling, logits: &[f32], n: usize) -> Vec<usize> {
        let s = Sampler::new(mode);
        let mut h = vec![0; logits.len()];
        for pos in 0..n {
            h[s.pick(logits, pos) as usize] += 1;
        }
        h
    }

    /// Asserts the observed counts follow `want` (probabilities): every index with
    /// probability 0 never comes out, and each other count is within 5 standard deviations of
    /// its expectation (a false alarm has odds below 1e-6 per index).
    fn assert_distribution(h: &[usize], want: &[f64], what: &str) {
        let n: usize = h.iter().sum();
        for (i, (&c, &p)) in h.iter().zip(want).enumerate() {
            if p == 0.0 {
                assert_eq!(
                    c, 0,
                    "{what}: index {i} is outside the kept set but came out {c}x"
                );
                continue;
            }
            let mean = n as f64 * p;
            let sd = (n as f64 * p * (1.0 - p)).sqrt();
            assert!(
                (c as f64 - mean).abs() <= 5.0 * sd,
                "{what}: index {i} came out {c}x in {n}, expected {mean:.0} ± {sd:.0} (p = {p:.4})"
            );
        }
    }

    fn sample(temperature: f32, top_k: usize, top_p: f32) -> Sampling {
        Sampling::Sample {
            temperature,
            top_k,
            top_p,
            seed: 42,
        }
    }

    /// Logits whose softmax at T = 1 is exactly [0.4, 0.3, 0.2, 0.1] (written shuffled).
    fn four() -> Vec<f32> {
        [0.2f32, 0.4, 0.1, 0.3].iter().map(|p| p.ln()).collect()
    }

    #[test]
    fn temperature_one_samples_the_softmax() {
        let h = histogram(sample(1.0, 0, 1.0), &four(), 40_000);
        assert_distribution(&h, &[0.2, 0.4, 0.1, 0.3], "T=1");
    }

    #[test]
    fn temperature_sharpens_and_flattens() {
        // softmax(log p / T) ∝ p^(1/T): T = 0.5 squares the probabilities, T = 2 takes roots.
        let p = [0.2f64, 0.4, 0.1, 0.3];
        let norm = |e: f64| {
            let w: Vec<f64> = p.iter().map(|x| x.powf(e)).collect();
            let s: f64 = w.iter().sum();
            w.into_iter().map(|x| x / s).collect::<Vec<_>>()
        };
        let h = histogram(sample(0.5, 0, 1.0), &four(), 40_000);
        assert_distribution(&h, &norm(2.0), "T=0.5");
        let h = histogram(sample(2.0, 0, 1.0), &four(), 40_000);
        assert_distribution(&h, &norm(0.5), "T=2");
    }

    #[test]
    fn top_k_keeps_the_k_most_likely_renormalised() {
        // Top 2 of [0.2, 0.4, 0.1, 0.3] are indices 1 and 3: 0.4 / 0.7 and 0.3 / 0.7.
        let h = histogram(sample(1.0, 2, 1.0), &four(), 40_000);
        assert_distribution(&h, &[0.0, 4.0 / 7.0, 0.0, 3.0 / 7.0], "top-k 2");
        let h = histogram(sample(1.0, 3, 1.0), &four(), 40_000);
        assert_distribution(&h, &[2.0 / 9.0, 4.0 / 9.0, 0.0, 3.0 / 9.0], "top-k 3");
    }

    #[test]
    fn top_p_cuts_at_the_smallest_set_reaching_the_mass() {
        // Sorted mass 0.4, 0.7, 0.9, 1.0. top_p 0.65 keeps {0.4, 0.3} (0.4 < 0.65 ≤ 0.7);
        // top_p 0.8 keeps three; top_p 0.35 keeps only the most likely.
        let h = histogram(sample(1.0, 0, 0.65), &four(), 40_000);
        assert_distribution(&h, &[0.0, 4.0 / 7.0, 0.0, 3.0 / 7.0], "top-p 0.65");
        let h = histogram(sample(1.0, 0, 0.8), &four(), 40_000);
        assert_distribution(&h, &[2.0 / 9.0, 4.0 / 9.0, 0.0, 3.0 / 9.0], "top-p 0.8");
        let h = histogram(sample(1.0, 0, 0.35), &four(), 2_000);
        assert_distribution(&h, &[0.0, 1.0, 0.0, 0.0], "top-p 0.35");
    }

    #[test]
    fn top_p_over_a_large_row_equals_sorting_everything() {
        // Nearly flat rows, so that the nucleus outgrows the first heads (64, 256, 1024).
        for (n, spread, top_p) in [(5000, 0.5f32, 0.9f32), (3000, 4.0, 0.5), (100, 0.0, 0.99)] {
            let logits: Vec<f32> = (0..n)
                .map(|i| ((i * 7919) % 1009) as f32 / 1009.0 * spread)
                .collect();
            let got = Sampler::new(sample(0.7, 0, top_p)).distribution(&logits);
            // Reference: sort the whole row, cut, renormalise.
            let mut idx: Vec<usize> = (0..n).collect();
            idx.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b)));
            let max = logits[idx[0]];
            let w: Vec<f64> = idx
                .iter()
                .map(|&i| (((logits[i] - max) / 0.7) as f64).exp())
                .collect();
            let total: f64 = w.iter().sum();
            let mut acc = 0.0;
            let keep = w
                .iter()
                .position(|p| {
                    acc += p / total;
                    acc >= f64::from(top_p)
                })
                .map_or(n, |k| k + 1);
            let kept: f64 = w[..keep].iter().sum();
            assert_eq!(got.len(), keep, "n = {n}");
            assert!(
                keep > 64,
                "n = {n}: the nucleus should outgrow the first head"
            );
            for (k, &(id, p)) in got.iter().enumerate() {
                assert_eq!(id as usize, idx[k], "n = {n}, rank {k}");
                assert!((p - w[k] / kept).abs() < 1e-12, "n = {n}, rank {k}");
            }
        }
    }

    #[test]
    fn top_p_applies_after_temperature_and_top_k() {
        // T = 0.5: p² normalised = [4, 16, 1, 9] / 30; sorted mass 16/30, 25/30, 29/30.
        // top_k 3 then renormalises over {16, 9, 4} / 29; top_p 0.8 then keeps {16, 9}
        // (16/29 = 0.55 < 0.8 ≤ 25/29 = 0.86).
        let h = histogram(sample(0.5, 3, 0.8), &four(), 40_000);
        assert_distribution(
            &h,
            &[0.0, 16.0 / 25.0, 0.0, 9.0 / 25.0],
            "T 0.5, k 3, p 0.8",
        );
    }
}
