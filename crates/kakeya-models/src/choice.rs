//! The choice of a token after a row of logits — greedy (the first largest) or a seeded draw
//! ([`Draw`]) — in one place: a forward asks for it ([`crate::ForwardRequest::choice`]) and,
//! where it can, returns the chosen ids instead of the logits (greedy: always, found without
//! most logits where the head allows; a draw: on a GPU, drawn there). Elsewhere the caller
//! draws from the returned logits by [`Draw::pick`], the same rule and uniforms as the device.

use burn::tensor::{Device, Tensor};

use crate::gpu;

/// How a forward chooses the token after each row it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// The first largest logit: only the ids come back.
    Greedy,
    /// A seeded draw: on a GPU drawn there, only the ids coming back; elsewhere the forward
    /// returns the logits and the caller draws by [`Draw::pick`].
    Draw(Draw),
}

impl Choice {
    /// The draw, if this choice is one.
    pub fn draw(self) -> Option<Draw> {
        match self {
            Choice::Greedy => None,
            Choice::Draw(d) => Some(d),
        }
    }

    /// The ids chosen from `logits` (row `i` predicting position `first + i`): greedy
    /// anywhere; a draw on a GPU (`None` elsewhere: the caller draws from the logits).
    ///
    /// # Shapes
    /// - `logits`: `[T, vocab]` → `T` ids
    pub fn from_logits(self, logits: &Tensor<2>, first: usize) -> Option<Vec<u32>> {
        match self {
            Choice::Greedy => Some(argmax_rows(logits.clone())),
            Choice::Draw(d) => d.on_device(logits, first),
        }
    }
}

/// The first largest entry of every row. On the CPU the logits are read in place; on another
/// device the argmax runs there and only the `T` ids come back, so a greedy step copies no
/// logits to the host (the GPU kernels take the first on ties too; Burn's argmax elsewhere
/// picks by its own rule).
///
/// # Shapes
/// - `logits`: `[T, vocab]` → `T` ids
pub fn argmax_rows(logits: Tensor<2>) -> Vec<u32> {
    if let Some(ids) = gpu::argmax_rows(&logits) {
        return ids;
    }
    if logits.device() != Device::flex() {
        return logits
            .argmax(1)
            .into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .expect("argmax ids are integers")
            .into_iter()
            .map(|i| i as u32)
            .collect();
    }
    let v = logits.dims()[1];
    let host = logits
        .into_data()
        .try_into_vec::<f32>()
        .expect("logits are f32");
    host.chunks_exact(v)
        .map(|row| kakeya_kernels::argmax::first_max(row).unwrap_or(0) as u32)
        .collect()
}

/// Sampling from a row of logits: `softmax(logits / temperature)` cut to the `top_k` most
/// likely tokens (0: all), then to the shortest most-likely-first prefix holding `top_p` of
/// their mass (1: all), drawn by inverse CDF at the uniform of the position the row predicts
/// ([`uniform`]) — in token-id order without a cut, most likely first with one.
#[derive(Debug, Clone, Copy)]
pub struct Draw {
    /// Temperature (> 0).
    pub temperature: f32,
    /// Keep only this many most likely tokens (0 = all).
    pub top_k: usize,
    /// Nucleus mass in (0, 1] (1 = all).
    pub top_p: f32,
    /// The seed of the uniforms.
    pub seed: u64,
}

/// Equal when every field has the same bits (a recording's key compares draws).
impl PartialEq for Draw {
    fn eq(&self, o: &Self) -> bool {
        self.temperature.to_bits() == o.temperature.to_bits()
            && self.top_k == o.top_k
            && self.top_p.to_bits() == o.top_p.to_bits()
            && self.seed == o.seed
    }
}

impl Eq for Draw {}

/// SplitMix64's finaliser: a bijective mix of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The uniform in `[0, 1)` of position `pos` under `seed`: 53 random bits of both, so a
/// sequence's draws do not depend on how its positions were computed (one at a time, or in
/// speculative blocks of any length).
pub fn uniform(seed: u64, pos: usize) -> f64 {
    let bits = mix(seed ^ mix(pos as u64 ^ 0x9e37_79b9_7f4a_7c15));
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

impl Draw {
    /// [`uniform`] of position `pos` rounded to f32 and kept below 1 (what the device takes:
    /// a uniform rounded up to 1 would fall past the row).
    pub fn uniform_f32(&self, pos: usize) -> f32 {
        (uniform(self.seed, pos) as f32).min(1.0 - f32::EPSILON / 2.0)
    }

    /// The uniforms of positions `first..first + n`, as [`Self::uniform_f32`].
    pub fn uniforms(&self, first: usize, n: usize) -> Vec<f32> {
        (first..first + n).map(|p| self.uniform_f32(p)).collect()
    }

    /// The token at position `pos` drawn on the host from the logits that predict it: the
    /// rule [`Self::on_device`] follows on a GPU, at the same uniform.
    pub fn pick(&self, logits: &[f32], pos: usize) -> u32 {
        inverse_cdf(&self.distribution(logits), uniform(self.seed, pos))
    }

    /// The distribution [`Self::pick`] draws from: the kept token ids with their
    /// probabilities (summing to 1) — most likely first when top-k or top-p cut it, in id
    /// order otherwise. Empty for an empty row.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let (temperature, top_k, top_p) = (self.temperature, self.top_k, self.top_p);
        if logits.is_empty() {
            return Vec::new();
        }
        // Most likely first (lower id on ties); only the kept part is sorted.
        let order = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        if top_k == 0 && top_p < 1.0 {
            return nucleus(logits, temperature, top_p, order);
        }
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        if top_k > 0 && top_k < idx.len() {
            idx.select_nth_unstable_by(top_k - 1, order);
            idx.truncate(top_k);
        }
        if top_k > 0 || top_p < 1.0 {
            idx.sort_unstable_by(order);
        }
        let max = idx
            .iter()
            .map(|&i| logits[i])
            .fold(f32::NEG_INFINITY, f32::max);
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
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= total);
        }
        idx.into_iter().map(|i| i as u32).zip(probs).collect()
    }

    /// On a GPU, the token drawn from each row of `logits` (row `i` predicts position
    /// `first + i`), only the ids read back; `None` elsewhere.
    ///
    /// # Shapes
    /// - `logits`: `[T, vocab]` → `T` ids
    pub fn on_device(&self, logits: &Tensor<2>, first: usize) -> Option<Vec<u32>> {
        let u = self.uniforms(first, logits.dims()[0]);
        gpu::sample_rows(logits, self.temperature, self.top_k, self.top_p, &u)
    }

    /// [`Self::on_device`] with the uniforms already on the device and the ids left there
    /// (as f32): the form a recorded forward holds.
    ///
    /// # Shapes
    /// - `logits`: `[T, vocab]`, `u`: `[T]` → `[T]`
    pub fn ids_on_device(&self, logits: &Tensor<2>, u: Tensor<1>) -> Option<Tensor<1>> {
        gpu::sample_on_device(logits, self.temperature, self.top_k, self.top_p, u)
    }
}

/// Top-p alone: the smallest most-likely-first prefix holding `top_p` of the probability,
/// renormalised — found by sorting a growing head of the row (64, 256, … entries, chosen with
/// a selection) instead of the whole vocabulary, which took as long as a decode step. The
/// same tokens in the same order as sorting everything.
fn nucleus(
    logits: &[f32],
    temperature: f32,
    top_p: f32,
    order: impl Fn(&usize, &usize) -> std::cmp::Ordering + Copy,
) -> Vec<(u32, f64)> {
    let n = logits.len();
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weight = |l: f32| (((l - max) / temperature) as f64).exp();
    let total: f64 = logits.iter().map(|&l| weight(l)).sum();
    let mut head = 64.min(n);
    loop {
        let mut idx: Vec<usize> = (0..n).collect();
        if head < n {
            idx.select_nth_unstable_by(head - 1, order);
            idx.truncate(head);
        }
        idx.sort_unstable_by(order);
        let mut acc = 0.0;
        let keep = idx.iter().position(|&i| {
            acc += weight(logits[i]) / total;
            acc >= f64::from(top_p)
        });
        if keep.is_some() || head == n {
            idx.truncate(keep.map_or(idx.len(), |k| k + 1));
            let probs: Vec<f64> = idx.iter().map(|&i| weight(logits[i]) / total).collect();
            let kept: f64 = probs.iter().sum();
            return idx
                .into_iter()
                .map(|i| i as u32)
                .zip(probs.into_iter().map(|p| p / kept))
                .collect();
        }
        head = (head * 4).min(n);
    }
}

/// The token of `dist` ((id, probability) pairs, in their order) where the cumulative
/// probability first reaches `u` times the total: inverse-CDF sampling.
///
/// # Panics
/// If `dist` is empty.
pub fn inverse_cdf(dist: &[(u32, f64)], u: f64) -> u32 {
    let total: f64 = dist.iter().map(|(_, p)| p).sum();
    let mut r = u * total;
    for &(i, p) in dist {
        r -= p;
        if r < 0.0 && p > 0.0 {
            return i;
        }
    }
    dist.iter()
        .rev()
        .find(|(_, p)| *p > 0.0)
        .or(dist.last())
        .expect("a non-empty distribution")
        .0
}
