//! Sampling as a forward's request ([`crate::Logits::DrawLast`], [`crate::Logits::DrawAll`]):
//! the rule's parameters and its uniforms, one per position. On a GPU the forward draws its
//! tokens there (`gpu::sample_rows`) and returns only their ids; elsewhere it returns the
//! logits and the caller's sampler draws on the host by the same rule
//! (`kakeya_runtime::Sampler`).

use burn::tensor::Tensor;

use crate::gpu;

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
