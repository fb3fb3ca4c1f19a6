//! RMSNorm, `x / sqrt(mean(x²) + eps) · m`, computed in f32, with a stored multiplier `m`:
//! Gemma's `1 + w` (the `1` added at load, see `kakeya_weights::checkpoint`) or the plain `w`
//! of Qwen3-style layers (the DFlash drafter).

use burn::tensor::Tensor;

use crate::rope::Rope;

/// RMSNorm over the last dimension with a stored **multiplier**.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    /// Multiplier (`1 + w` for Gemma, `w` for Qwen3), shape `[dim]`.
    pub scale: Tensor<1>,
    /// Epsilon added to the mean square.
    pub eps: f64,
}

impl RmsNorm {
    /// Normalises the last dimension.
    ///
    /// # Shapes
    /// - `x`: `[..., dim]` → `[..., dim]`
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        if let Some(y) = crate::gpu::rms_norm(&x, &self.scale, self.eps) {
            return y;
        }
        Self::normalize(x, self.eps) * self.scale.clone().unsqueeze::<D>()
    }

    /// `x / sqrt(mean(x²) + eps)` over the last dimension, without the multiplier (callers
    /// with a multiplier per batch entry, such as f_θ's loss over stacked layers, apply it).
    ///
    /// # Shapes
    /// - `x`: `[..., dim]` → `[..., dim]`
    pub fn normalize<const D: usize>(x: Tensor<D>, eps: f64) -> Tensor<D> {
        let inv = x
            .clone()
            .square()
            .mean_dim(D - 1)
            .add_scalar(eps)
            .sqrt()
            .recip();
        x * inv
    }

    /// `residual + self.forward(x)`, one kernel on a GPU.
    ///
    /// # Shapes
    /// - `x`, `residual`: `[..., dim]` → `[..., dim]`
    pub fn forward_add<const D: usize>(&self, x: Tensor<D>, residual: Tensor<D>) -> Tensor<D> {
        crate::gpu::rms_norm_add(&x, &self.scale, self.eps, &residual)
            .unwrap_or_else(|| residual + self.forward(x))
    }

    /// [`Self::forward`] over head vectors, then RoPE ([`Rope::apply`]); one kernel on a GPU.
    ///
    /// # Shapes
    /// - `x`: `[heads, T, d]`; `cos`, `sin`: `[T, d/2]` → `[heads, T, d]`
    pub fn forward_rope(&self, x: Tensor<3>, cos: &Tensor<2>, sin: &Tensor<2>) -> Tensor<3> {
        crate::gpu::rms_norm_rope(&x, &self.scale, self.eps, cos, sin)
            .unwrap_or_else(|| Rope::apply(self.forward(x), cos, sin))
    }
}
