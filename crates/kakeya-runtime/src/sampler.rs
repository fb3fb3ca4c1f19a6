//! Token selection from logits: greedy, or seeded sampling with temperature, top-k, top-p.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
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

/// A [`Sampling`] with its RNG state.
#[derive(Debug)]
pub struct Sampler {
    mode: Sampling,
    rng: StdRng,
}

/// Index of the largest value (first on ties); `None` for an empty slice.
pub fn argmax(logits: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

impl Sampler {
    /// A sampler for `mode`.
    pub fn new(mode: Sampling) -> Self {
        let seed = match mode {
            Sampling::Sample { seed, .. } => seed,
            Sampling::Greedy => 0,
        };
        Self {
            mode,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// The mode.
    pub fn mode(&self) -> &Sampling {
        &self.mode
    }

    /// Picks a token from one row of logits.
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        match self.mode {
            Sampling::Greedy => argmax(logits).unwrap_or(0) as u32,
            Sampling::Sample {
                temperature,
                top_k,
                top_p,
                ..
            } => {
                let mut idx: Vec<usize> = (0..logits.len()).collect();
                idx.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
                if top_k > 0 {
                    idx.truncate(top_k);
                }
                let max = logits[idx[0]];
                let mut probs: Vec<f64> = idx
                    .iter()
                    .map(|&i| (((logits[i] - max) / temperature) as f64).exp())
                    .collect();
                let total: f64 = probs.iter().sum();
                probs.iter_mut().for_each(|p| *p /= total);
                if top_p < 1.0 {
                    let mut acc = 0.0;
                    let keep = probs.iter().position(|p| {
                        acc += p;
                        acc >= top_p as f64
                    });
                    let keep = keep.map_or(probs.len(), |k| k + 1);
                    idx.truncate(keep);
                    probs.truncate(keep);
                }
                let total: f64 = probs.iter().sum();
                let mut r = self.rng.random::<f64>() * total;
                for (i, p) in idx.iter().zip(&probs) {
                    r -= p;
                    if r <= 0.0 {
                        return *i as u32;
                    }
                }
                *idx.last().expect("non-empty") as u32
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_max() {
        assert_eq!(
            Sampler::new(Sampling::Greedy).pick(&[0.0, 3.0, 3.0, 1.0]),
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
        let mut s = Sampler::new(mode(1, 7));
        assert_eq!(s.pick(&logits), argmax(&logits).unwrap() as u32);
        let a: Vec<u32> = {
            let mut s = Sampler::new(mode(0, 3));
            (0..20).map(|_| s.pick(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(mode(0, 3));
            (0..20).map(|_| s.pick(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().any(|&t| t != a[0]),
            "sampling at T=1 over 50 tokens should vary"
        );
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // One token holds ~all the mass: top_p 0.5 must always return it.
        let mut logits = vec![0.0f32; 10];
        logits[4] = 20.0;
        let mut s = Sampler::new(Sampling::Sample {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
            seed: 1,
        });
        assert!((0..50).all(|_| s.pick(&logits) == 4));
    }
}
