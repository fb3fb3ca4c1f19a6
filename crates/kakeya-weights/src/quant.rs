//! Matrix products straight from GGML blocks, for CPU decoding.
//!
//! A decode step reads every weight once; held as f32 the default model moves ~1.07 GB per
//! token, held as its GGUF blocks ~0.25 GB. [`QuantMatrix::matmul`] dequantises one row at a
//! time into a small f32 buffer (the *same* f32 values [`crate::dequant`] produces: an f16 scale
//! times a small integer is exact in f32) and dots it with each input row, so results differ
//! from a dense f32 matmul only in summation order. Rows are split across the rayon pool.
//!
//! On x86-64 the kernel is compiled a second time with AVX2+FMA enabled and picked at run time
//! when the CPU has them; elsewhere the portable build runs.

use rayon::prelude::*;

use crate::dequant::{GgmlType, dequantize_into};

/// Rows of output per parallel task.
const ROWS_PER_TASK: usize = 64;

/// A `[rows, cols]` weight held as GGML blocks (each row a whole number of blocks).
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: Vec<u8>,
}

/// Dot product with 16 independent partial sums (vectorisable without reassociation).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, ra) = a.as_chunks::<16>();
    let (cb, rb) = b.as_chunks::<16>();
    for (x, y) in ca.iter().zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    let mut s = [0.0f32; 4];
    for i in 0..4 {
        s[i] = (acc[i] + acc[i + 8]) + (acc[i + 4] + acc[i + 12]);
    }
    (s[0] + s[2]) + (s[1] + s[3]) + tail
}

/// One task: rows `r0..r0 + out.len()/t`, output laid out `[row][t]`.
#[inline(always)]
fn rows_kernel(m: &QuantMatrix, r0: usize, out: &mut [f32], x: &[f32], t: usize) {
    let mut buf = vec![0.0f32; m.cols];
    for (i, o) in out.chunks_mut(t).enumerate() {
        let r = r0 + i;
        dequantize_into(
            m.ty,
            &m.data[r * m.row_bytes..(r + 1) * m.row_bytes],
            &mut buf,
        );
        for (tt, slot) in o.iter_mut().enumerate() {
            *slot = dot(&buf, &x[tt * m.cols..(tt + 1) * m.cols]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn rows_kernel_avx2(m: &QuantMatrix, r0: usize, out: &mut [f32], x: &[f32], t: usize) {
    rows_kernel(m, r0, out, x, t)
}

#[allow(unsafe_code)]
fn rows_dispatch(m: &QuantMatrix, r0: usize, out: &mut [f32], x: &[f32], t: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above), which is all
        // `rows_kernel_avx2` requires beyond the baseline.
        unsafe { rows_kernel_avx2(m, r0, out, x, t) };
        return;
    }
    rows_kernel(m, r0, out, x, t)
}

impl QuantMatrix {
    /// Wraps GGML block data of a `[rows, cols]` matrix, or `None` when a row is not a whole
    /// number of blocks or the byte count is wrong.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: Vec<u8>) -> Option<Self> {
        let row_bytes = ty.bytes_for(cols)?;
        (data.len() == rows * row_bytes).then_some(Self {
            ty,
            rows,
            cols,
            row_bytes,
            data,
        })
    }

    /// Output rows (`out` features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns (`in` features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Block format.
    pub fn ggml_type(&self) -> GgmlType {
        self.ty
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.data.len()
    }

    /// `y = x · Wᵀ`.
    ///
    /// # Shapes
    /// - `x`: `[t, cols]` row-major → `[t, rows]` row-major
    pub fn matmul(&self, x: &[f32], t: usize) -> Vec<f32> {
        assert_eq!(
            x.len(),
            t * self.cols,
            "QuantMatrix::matmul: input has the wrong length"
        );
        let mut by_row = vec![0.0f32; self.rows * t];
        by_row
            .par_chunks_mut(ROWS_PER_TASK * t)
            .enumerate()
            .for_each(|(task, out)| rows_dispatch(self, task * ROWS_PER_TASK, out, x, t));
        if t == 1 {
            return by_row;
        }
        let mut y = vec![0.0f32; t * self.rows];
        for r in 0..self.rows {
            for tt in 0..t {
                y[tt * self.rows + r] = by_row[r * t + tt];
            }
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dequant::dequantize;

    /// Q8_0 blocks with varied scales and values.
    fn q8_rows(rows: usize, cols: usize) -> Vec<u8> {
        let mut data = Vec::new();
        for r in 0..rows {
            for b in 0..cols / 32 {
                data.extend(half::f16::from_f32(0.01 * (1 + (r + b) % 7) as f32).to_le_bytes());
                data.extend((0..32).map(|i| ((i * 13 + r * 7 + b) % 255) as u8));
            }
        }
        data
    }

    #[test]
    fn matches_dense_matmul() {
        let (rows, cols, t) = (150, 96, 3);
        let data = q8_rows(rows, cols);
        let dense = dequantize(GgmlType::Q8_0, &data, rows * cols);
        let q = QuantMatrix::new(GgmlType::Q8_0, rows, cols, data).unwrap();
        let x: Vec<f32> = (0..t * cols)
            .map(|i| ((i * 31) % 17) as f32 * 0.1 - 0.8)
            .collect();
        let y = q.matmul(&x, t);
        for tt in 0..t {
            for r in 0..rows {
                let want: f32 = (0..cols)
                    .map(|c| dense[r * cols + c] * x[tt * cols + c])
                    .sum();
                let got = y[tt * rows + r];
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "[{tt},{r}]: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn refuses_partial_blocks() {
        assert!(QuantMatrix::new(GgmlType::Q4K, 2, 640, vec![0; 2 * 360]).is_none());
    }
}
