//! Dense (f32 or bf16) weight matrices for the CPU's row-order kernel: products whose every
//! output is the same bits however many input rows run together, as [`crate::QuantMatrix`]
//! gives GGUF blocks. A GEMM's sums depend on the row count (a 1-row decode step and an 8-row
//! verify block differ in the last bits), which would let speculative decoding of an HF
//! checkpoint diverge from plain decoding at a near-tie.

use crate::tiles::{self, DenseRows};

/// Weight rows per parallel task.
const ROWS_PER_TASK: usize = 32;

#[derive(Debug, Clone)]
enum Values {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

/// A `[rows, cols]` weight kept for the row-order kernel: as bf16 when every value is one
/// (Gemma's published checkpoints are bf16: half the bytes, the same values), else as f32.
#[derive(Debug, Clone)]
pub struct DenseMatrix {
    rows: usize,
    cols: usize,
    values: Values,
}

impl DenseMatrix {
    /// The matrix of `values` (`[rows, cols]` row-major).
    ///
    /// # Panics
    /// When `values.len() != rows * cols`.
    pub fn new(rows: usize, cols: usize, values: &[f32]) -> Self {
        assert_eq!(values.len(), rows * cols, "DenseMatrix::new: wrong length");
        let exact_bf16 = values.iter().all(|v| v.to_bits() & 0xffff == 0);
        let values = if exact_bf16 {
            Values::Bf16(values.iter().map(|v| (v.to_bits() >> 16) as u16).collect())
        } else {
            Values::F32(values.to_vec())
        };
        Self { rows, cols, values }
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Whether the values are held as bf16.
    pub fn is_bf16(&self) -> bool {
        matches!(self.values, Values::Bf16(_))
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        match &self.values {
            Values::F32(v) => 4 * v.len(),
            Values::Bf16(v) => 2 * v.len(),
        }
    }

    /// `y = x · Wᵀ`, each output in the kernel's canonical order.
    ///
    /// # Shapes
    /// - `x`: `[t, cols]` row-major → `[t, rows]` row-major
    pub fn matmul(&self, x: &[f32], t: usize) -> Vec<f32> {
        assert_eq!(
            x.len(),
            t * self.cols,
            "DenseMatrix::matmul: input has the wrong length"
        );
        let cols = self.cols;
        let mut y = vec![0.0f32; t * self.rows];
        tiles::by_input_tasks(self.rows, t, ROWS_PER_TASK, &mut y, |r0, out| {
            let n = out.len() / t;
            let w = match &self.values {
                Values::F32(v) => DenseRows::F32(&v[r0 * cols..(r0 + n) * cols]),
                Values::Bf16(v) => DenseRows::Bf16(&v[r0 * cols..(r0 + n) * cols]),
            };
            tiles::dense_tile(w, n, x, t, cols, out);
        });
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 20_001) as f32 / 10_000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn rows_do_not_depend_on_how_many_run_together_and_match_the_canonical_dot() {
        // Column counts with and without a tail past the last whole 8; f32 and bf16 values.
        for cols in [64, 70, 5] {
            let rows = 75;
            let f32s = values(rows * cols, 3);
            let bf16s: Vec<f32> = f32s
                .iter()
                .map(|v| f32::from_bits(v.to_bits() & 0xffff_0000))
                .collect();
            for (w, bf16) in [(f32s, false), (bf16s, true)] {
                let m = DenseMatrix::new(rows, cols, &w);
                assert_eq!(m.is_bf16(), bf16);
                assert_eq!(m.nbytes(), rows * cols * if bf16 { 2 } else { 4 });
                let x = values(16 * cols, 9);
                let all = m.matmul(&x, 16);
                for t in [1, 2, 3, 5, 8, 16] {
                    let y = m.matmul(&x[..t * cols], t);
                    assert_eq!(y[..], all[..t * rows], "cols {cols}, bf16 {bf16}, t {t}");
                }
                for j in 0..16 {
                    for r in 0..rows {
                        let want =
                            tiles::dot(&w[r * cols..(r + 1) * cols], &x[j * cols..(j + 1) * cols]);
                        assert_eq!(
                            all[j * rows + r].to_bits(),
                            want.to_bits(),
                            "row {r}, input {j}"
                        );
                    }
                }
            }
        }
    }
}
