//! Rotary position embedding in the half-split ("NEOX") form Gemma uses: a head vector's
//! first and second halves form the pairs `(x[i], x[i + d/2])` rotated by `pos · θ_i`.
//! [RoFormer, arXiv:2104.09864]

use burn::tensor::{Device, Tensor, TensorData};

/// Inverse frequencies of one RoPE variant (a base and a linear scaling factor).
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// `θ_i = 1 / (base^(2i/d) · factor)` for `i < d/2`, rounded to f32 as transformers does.
    pub fn new(head_dim: usize, base: f64, factor: f64) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / head_dim as f32;
                let denom = (base as f32).powf(exponent);
                (1.0 / denom) / factor as f32
            })
            .collect();
        Self { inv_freq }
    }

    /// Gemma 4's "proportional" RoPE: the first `⌊share · d/2⌋` frequencies of [`Self::new`]'s
    /// table (exponents over the whole `d`), the rest 0 — those pairs `(i, i + d/2)` are not
    /// rotated.
    pub fn proportional(head_dim: usize, base: f64, share: f64) -> Self {
        let mut rope = Self::new(head_dim, base, 1.0);
        let rotated = (share * head_dim as f64 / 2.0).floor() as usize;
        rope.inv_freq
            .iter_mut()
            .skip(rotated)
            .for_each(|f| *f = 0.0);
        rope
    }

    /// Cosine and sine tables for `positions` in host memory, each `[T, d/2]` row-major.
    pub fn host_tables(&self, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        (cos, sin)
    }

    /// Cosine and sine tables for `positions`, each `[T, d/2]`.
    pub fn tables(&self, positions: &[usize], device: &Device) -> (Tensor<2>, Tensor<2>) {
        let half = self.inv_freq.len();
        let (cos, sin) = self.host_tables(positions);
        let shape = [positions.len(), half];
        (
            Tensor::from_data(TensorData::new(cos, shape), device),
            Tensor::from_data(TensorData::new(sin, shape), device),
        )
    }

    /// Both tables of positions `0..positions` in one tensor on `device` (cos, then sin): what
    /// a GPU forward gathers its rows' RoPE from ([`crate::gpu::StepInputs::rope`]), the same
    /// bits as [`Self::tables`].
    ///
    /// # Shapes
    /// - → `[2, positions, head_dim/2]`
    pub fn device_table(&self, positions: usize, device: &Device) -> Tensor<3> {
        let all: Vec<usize> = (0..positions).collect();
        let (mut both, sin) = self.host_tables(&all);
        both.extend(sin);
        Tensor::from_data(
            TensorData::new(both, [2, positions, self.inv_freq.len()]),
            device,
        )
    }

    /// Rotates head vectors.
    ///
    /// # Shapes
    /// - `x`: `[heads, T, d]`; `cos`, `sin`: `[T, d/2]` → `[heads, T, d]`
    pub fn apply(x: Tensor<3>, cos: &Tensor<2>, sin: &Tensor<2>) -> Tensor<3> {
        if let Some(y) = crate::gpu::rope(&x, cos, sin) {
            return y;
        }
        Self::rotate(x, cos.clone().unsqueeze(), sin.clone().unsqueeze())
    }

    /// [`Self::apply`] with tables of any batch shape that broadcasts over `x`'s (per layer,
    /// in f_θ's loss over stacked layers).
    ///
    /// # Shapes
    /// - `x`: `[..., T, d]`; `cos`, `sin`: `[..., T, d/2]` (leading dims 1 or `x`'s) → `x`'s
    pub fn rotate<const D: usize>(x: Tensor<D>, cos: Tensor<D>, sin: Tensor<D>) -> Tensor<D> {
        let d = x.dims()[D - 1];
        let half = d / 2;
        let x1 = x.clone().narrow(D - 1, 0, half);
        let x2 = x.narrow(D - 1, half, half);
        let r1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
        let r2 = x2 * cos + x1 * sin;
        Tensor::cat(vec![r1, r2], D - 1)
    }

    /// [`Self::rotate`] of one head vector in host memory (`x`: `[d]`, in place) by one row of
    /// [`Self::host_tables`] (`cos`, `sin`: `[d/2]`): the same products and sums.
    pub fn rotate_host(x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = x.len() / 2;
        let (x1, x2) = x.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (x1[i], x2[i]);
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[i] + a * sin[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor, TensorData};

    use super::Rope;

    /// `apply` gives the bits of the four-product form `(x₁·c − x₂·s, x₂·c + x₁·s)`, computed
    /// here per element on the host from the same angles, and so does `rotate_host`.
    #[test]
    fn apply_and_rotate_host_equal_the_four_product_form_bit_for_bit() {
        let (heads, d) = (3, 16);
        let positions = [0usize, 1, 7, 513, 40_000];
        let t = positions.len();
        for rope in [
            Rope::new(d, 10_000.0, 1.0),
            Rope::proportional(d, 1e6, 0.25),
        ] {
            let xs: Vec<f32> = (0..heads * t * d)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let x =
                Tensor::<3>::from_data(TensorData::new(xs.clone(), [heads, t, d]), &Device::flex());
            let (cos, sin) = rope.tables(&positions, &Device::flex());
            let got = Rope::apply(x, &cos, &sin)
                .into_data()
                .try_into_vec::<f32>()
                .unwrap();
            let half = d / 2;
            let (hc, hs) = rope.host_tables(&positions);
            for h in 0..heads {
                for (ti, &p) in positions.iter().enumerate() {
                    let row = (h * t + ti) * d;
                    let mut on_host = xs[row..row + d].to_vec();
                    let table = ti * half..(ti + 1) * half;
                    Rope::rotate_host(&mut on_host, &hc[table.clone()], &hs[table]);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&on_host), bits(&got[row..row + d]));
                    for i in 0..half {
                        let angle = p as f32 * rope.inv_freq[i];
                        let (c, s) = (angle.cos(), angle.sin());
                        let (x1, x2) = (xs[row + i], xs[row + half + i]);
                        assert_eq!(got[row + i].to_bits(), (x1 * c - x2 * s).to_bits());
                        assert_eq!(got[row + half + i].to_bits(), (x2 * c + x1 * s).to_bits());
                    }
                }
            }
        }
    }
}
