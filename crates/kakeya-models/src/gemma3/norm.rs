//! Gemma's RMSNorm: `x / sqrt(mean(x²) + eps) * (1 + w)`, computed in f32.

use burn::tensor::Tensor;

/// RMSNorm over the last dimension with a stored **multiplier** (`1 + w` already added; see
/// `kakeya_weights::checkpoint`).
#[derive(Debug, Clone)]
pub struct GemmaRmsNorm {
    /// Multiplier `1 + w`, shape `[dim]`.
    pub scale: Tensor<1>,
    /// Epsilon added to the mean square.
    pub eps: f64,
}

impl GemmaRmsNorm {
    /// Normalises the last dimension.
    ///
    /// # Shapes
    /// - `x`: `[..., dim]` → `[..., dim]`
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let inv = x
            .clone()
            .square()
            .mean_dim(D - 1)
            .add_scalar(self.eps)
            .sqrt()
            .recip();
        x * inv * self.scale.clone().unsqueeze::<D>()
    }
}
