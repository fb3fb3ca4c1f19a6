//! A fixed orthogonal rotation of K/V rows before quantisation: per head, a seeded random sign
//! per channel, then the normalised Walsh–Hadamard transform (QuaRot's and llama.cpp's choice
//! for quantised caches). It spreads an outlier channel's energy over all channels, so a
//! per-token group's step is no longer set by one channel. Rows are rotated back after
//! dequantisation: in exact arithmetic attention sees the same keys and values.

/// The rotation of rows made of heads `head_dim` wide (a power of two).
#[derive(Debug, Clone)]
pub struct Rotation {
    signs: Vec<f32>,
    scale: f32,
}

impl Rotation {
    /// The rotation for heads `head_dim` wide, signs drawn from `seed`; `None` unless
    /// `head_dim` is a power of two.
    pub fn new(head_dim: usize, seed: u64) -> Option<Self> {
        if !head_dim.is_power_of_two() {
            return None;
        }
        let mut s = seed ^ 0x9e37_79b9_7f4a_7c15;
        let signs = (0..head_dim)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                if (s >> 63) == 0 { 1.0 } else { -1.0 }
            })
            .collect();
        Some(Self {
            signs,
            scale: (head_dim as f32).sqrt().recip(),
        })
    }

    /// Head width.
    pub fn head_dim(&self) -> usize {
        self.signs.len()
    }

    /// Rotates every head of every row in place (`rows.len()` a multiple of the head width).
    pub fn apply(&self, rows: &mut [f32]) {
        for h in rows.chunks_exact_mut(self.signs.len()) {
            for (x, s) in h.iter_mut().zip(&self.signs) {
                *x *= s;
            }
            fwht(h);
            for x in h.iter_mut() {
                *x *= self.scale;
            }
        }
    }

    /// Undoes [`Self::apply`] in place.
    pub fn undo(&self, rows: &mut [f32]) {
        for h in rows.chunks_exact_mut(self.signs.len()) {
            fwht(h);
            for (x, s) in h.iter_mut().zip(&self.signs) {
                *x *= s * self.scale;
            }
        }
    }
}

impl Rotation {
    /// [`Self::undo`] as a `[head_dim, head_dim]` matrix `M` with `x = y · M` for a rotated
    /// head row `y` (row `i` of `M` is the undone `i`-th unit row).
    pub fn undo_matrix(&self, device: &burn::tensor::Device) -> burn::tensor::Tensor<2> {
        let d = self.head_dim();
        let mut m = vec![0.0f32; d * d];
        for (i, row) in m.chunks_exact_mut(d).enumerate() {
            row[i] = 1.0;
            self.undo(row);
        }
        burn::tensor::Tensor::from_data(burn::tensor::TensorData::new(m, [d, d]), device)
    }
}

/// The unnormalised Walsh–Hadamard transform of `x` (length a power of two), in place.
fn fwht(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (p, q) = (*u, *v);
                *u = p + q;
                *v = p - q;
            }
        }
        h *= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rotation_is_orthogonal_and_undone() {
        let r = Rotation::new(64, 7).unwrap();
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let mut y = x.clone();
        r.apply(&mut y);
        // Norms and dot products are kept (per head).
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(p, q)| p * q).sum::<f32>();
        for h in 0..2 {
            let (a, b) = (&x[h * 64..(h + 1) * 64], &y[h * 64..(h + 1) * 64]);
            assert!((dot(a, a) - dot(b, b)).abs() < 1e-3 * dot(a, a));
        }
        assert_ne!(x, y);
        r.undo(&mut y);
        let worst = x
            .iter()
            .zip(&y)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst < 1e-5, "{worst}");
        // An outlier channel is spread over every channel.
        let mut spike = vec![0.0f32; 64];
        spike[5] = 64.0;
        r.apply(&mut spike);
        assert!(spike.iter().all(|v| (v.abs() - 8.0).abs() < 1e-4));
        assert!(Rotation::new(48, 0).is_none());
    }

    #[test]
    fn the_undo_matrix_undoes_a_rotated_row() {
        let r = Rotation::new(16, 3).unwrap();
        let x: Vec<f32> = (0..16).map(|i| (i as f32 - 7.5) / 3.0).collect();
        let mut y = x.clone();
        r.apply(&mut y);
        let m: Vec<f32> = r
            .undo_matrix(&burn::tensor::Device::flex())
            .into_data()
            .try_into_vec()
            .unwrap();
        for (j, want) in x.iter().enumerate() {
            let got: f32 = (0..16).map(|i| y[i] * m[i * 16 + j]).sum();
            assert!((got - want).abs() < 1e-5, "column {j}: {got} vs {want}");
        }
    }
}
