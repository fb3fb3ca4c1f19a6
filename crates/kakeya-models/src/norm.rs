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

    /// [`Self::forward`] over host rows in place (`x`: `[t, dim]`, row-major), on the CPU's
    /// host paths: the mean of squares as a canonical-order dot product, then
    /// `x · 1/sqrt(ms + eps) · m`. Each row's values depend on that row only.
    pub fn forward_host(&self, x: &mut [f32]) {
        let scale = self
            .scale
            .clone()
            .into_data()
            .try_into_vec::<f32>()
            .expect("norm multipliers are f32");
        Self::normalize_host(x, &scale, self.eps as f32);
    }

    /// [`Self::forward_host`] with the multiplier given as host values (`x`: rows of
    /// `multiplier.len()`, in place).
    pub fn normalize_host(x: &mut [f32], multiplier: &[f32], eps: f32) {
        let dim = multiplier.len();
        assert!(
            x.len().is_multiple_of(dim),
            "RmsNorm::normalize_host: rows of the wrong width"
        );
        for row in x.chunks_exact_mut(dim) {
            let mut ss = [0.0f32];
            kakeya_kernels::rowops::row_dots(
                kakeya_kernels::rowops::Rows::F32(row),
                1,
                row,
                1,
                dim,
                &mut ss,
            );
            let inv = 1.0 / (ss[0] / dim as f32 + eps).sqrt();
            for (v, &m) in row.iter_mut().zip(multiplier) {
                *v = *v * inv * m;
            }
        }
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

    /// [`Self::forward_add`], then `next`'s norm of the result: `(h, next.forward(h))` — one
    /// kernel on a GPU, the same bits as the two calls.
    ///
    /// # Shapes
    /// - `x`, `residual`: `[R, dim]` → two `[R, dim]`
    pub fn forward_add_norm(
        &self,
        x: Tensor<2>,
        residual: Tensor<2>,
        next: &RmsNorm,
    ) -> (Tensor<2>, Tensor<2>) {
        let pair = (&self.scale, self.eps);
        crate::gpu::rms_norm_add_norm(&x, pair, &residual, (&next.scale, next.eps)).unwrap_or_else(
            || {
                let h = self.forward_add(x, residual);
                (h.clone(), next.forward(h))
            },
        )
    }

    /// [`Self::forward_rope`] of queries (this norm) and keys (`k_norm`) — one kernel on a
    /// GPU, the same bits as the two calls.
    ///
    /// # Shapes
    /// - `q`: `[heads, T, d]`, `k`: `[kv_heads, T, d]`; `cos`, `sin`: `[T, d/2]` → the two
    ///   shapes
    pub fn forward_rope_qk(
        &self,
        q: Tensor<3>,
        (k_norm, k): (&RmsNorm, Tensor<3>),
        cos: &Tensor<2>,
        sin: &Tensor<2>,
    ) -> (Tensor<3>, Tensor<3>) {
        let (qs, ks) = ((&q, &self.scale, self.eps), (&k, &k_norm.scale, k_norm.eps));
        crate::gpu::qk_norm_rope(qs, ks, cos, sin).unwrap_or_else(|| {
            (
                self.forward_rope(q, cos, sin),
                k_norm.forward_rope(k, cos, sin),
            )
        })
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

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor, TensorData};

    use super::RmsNorm;

    #[test]
    fn the_host_rows_path_equals_the_tensor_path_to_rounding() {
        let (t, dim) = (5, 640);
        let device = Device::flex();
        let scale: Vec<f32> = (0..dim).map(|i| 1.0 + (i % 7) as f32 * 0.1).collect();
        let norm = RmsNorm {
            scale: Tensor::from_data(TensorData::new(scale, [dim]), &device),
            eps: 1e-6,
        };
        // Rows of very different sizes, one with a massive channel (Gemma's residual stream).
        let x: Vec<f32> = (0..t * dim)
            .map(|i| {
                let (r, c) = (i / dim, i % dim);
                let v = ((i * 37) % 23) as f32 * 0.09 - 1.0;
                v * 10f32.powi(r as i32 - 2) + if r == 3 && c == 163 { 3e4 } else { 0.0 }
            })
            .collect();
        let want = norm
            .forward(Tensor::<2>::from_data(
                TensorData::new(x.clone(), [t, dim]),
                &device,
            ))
            .into_data()
            .try_into_vec::<f32>()
            .unwrap();
        let mut got = x;
        norm.forward_host(&mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 2e-6 * w.abs().max(1e-3),
                "[{}, {}]: {g} vs {w}",
                i / dim,
                i % dim
            );
        }
    }
}
