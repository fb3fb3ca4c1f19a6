//! Small products over rows held in memory, for attention over cached keys and values on the
//! CPU: a few query rows against a few hundred cached rows are too small for a GEMM (which
//! packs both operands on every call). Both sums run in a fixed order, so each output is the
//! same bits whatever else is computed beside it.

use crate::kernel::{self, DenseRows};

/// `out[r · t + j] = rows_r · x_j` for the `n` rows of `rows` (`[n, dim]`) and the `t` rows of
/// `x` (`[t, dim]`), each in the quantised kernel's canonical order (eight FMA lanes, then
/// `((0+4)+(2+6)) + ((1+5)+(3+7))`), with AVX2/FMA where the CPU has them.
pub fn row_dots(rows: &[f32], n: usize, x: &[f32], t: usize, dim: usize, out: &mut [f32]) {
    assert!(
        rows.len() >= n * dim && x.len() >= t * dim && out.len() >= n * t,
        "row_dots: slices too short"
    );
    kernel::dense_tile(DenseRows::F32(rows), n, x, t, dim, out);
}

/// `out_j += Σ_r p[r · t + j] · rows_r` for `j < t` (`out`: `[t, dim]`), over the `n` rows of
/// `rows` (`[n, dim]`) in ascending `r`, each term one FMA per element.
pub fn weighted_sum(p: &[f32], rows: &[f32], n: usize, t: usize, dim: usize, out: &mut [f32]) {
    assert!(
        p.len() >= n * t && rows.len() >= n * dim && out.len() >= t * dim,
        "weighted_sum: slices too short"
    );
    #[cfg(target_arch = "x86_64")]
    if kernel::simd_available() {
        simd::weighted_sum(p, rows, n, t, dim, out);
        return;
    }
    for r in 0..n {
        let row = &rows[r * dim..(r + 1) * dim];
        for j in 0..t {
            let w = p[r * t + j];
            for (o, &v) in out[j * dim..(j + 1) * dim].iter_mut().zip(row) {
                *o = w.mul_add(v, *o);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd {
    use std::arch::x86_64::{
        __m256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_ps, _mm256_storeu_ps,
    };

    /// Outputs summed together: their accumulators stay in registers while the rows stream.
    const OUTS: usize = 4;

    /// [`super::weighted_sum`]; the caller checked AVX2/FMA and the lengths. Eight columns
    /// of up to [`OUTS`] outputs at a time are accumulated in registers over every row (each
    /// row's eight values loaded once for all of them), in ascending row order as the
    /// portable loop.
    pub(super) fn weighted_sum(
        p: &[f32],
        rows: &[f32],
        n: usize,
        t: usize,
        dim: usize,
        out: &mut [f32],
    ) {
        let body = dim / 8 * 8;
        for j0 in (0..t).step_by(OUTS) {
            let m = (t - j0).min(OUTS);
            // SAFETY: AVX2 and FMA are available (checked by the caller); every load and store
            // stays within the `[n, dim]` rows and the `[t, dim]` outputs.
            unsafe { columns(p, rows, n, t, dim, body, j0, m, out) };
            for j in j0..j0 + m {
                for r in 0..n {
                    let w = p[r * t + j];
                    for c in body..dim {
                        out[j * dim + c] = w.mul_add(rows[r * dim + c], out[j * dim + c]);
                    }
                }
            }
        }
    }

    /// Columns `0..body` of outputs `j0..j0 + m`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn columns(
        p: &[f32],
        rows: &[f32],
        n: usize,
        t: usize,
        dim: usize,
        body: usize,
        j0: usize,
        m: usize,
        out: &mut [f32],
    ) {
        let (pr, po) = (rows.as_ptr(), out.as_mut_ptr());
        let mut c = 0;
        while c < body {
            let mut acc: [__m256; OUTS] = [_mm256_set1_ps(0.0); OUTS];
            for (k, a) in acc.iter_mut().enumerate().take(m) {
                // SAFETY: output j0 + k < t, columns c..c + 8 <= dim.
                *a = unsafe { _mm256_loadu_ps(po.add((j0 + k) * dim + c)) };
            }
            for r in 0..n {
                // SAFETY: row r < n, columns c..c + 8 <= dim.
                let v = unsafe { _mm256_loadu_ps(pr.add(r * dim + c)) };
                for (k, a) in acc.iter_mut().enumerate().take(m) {
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(p[r * t + j0 + k]), v, *a);
                }
            }
            for (k, a) in acc.iter().enumerate().take(m) {
                // SAFETY: as the loads above.
                unsafe { _mm256_storeu_ps(po.add((j0 + k) * dim + c), *a) };
            }
            c += 8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut z = seed.wrapping_mul(2_654_435_761).wrapping_add(7);
        (0..n)
            .map(|_| {
                z = z.wrapping_mul(1_103_515_245).wrapping_add(12345);
                ((z >> 8) & 0xffff) as f32 / 32768.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn both_products_are_the_canonical_sums_bit_for_bit() {
        for (n, t, dim) in [(13, 4, 44), (5, 6, 16), (200, 4, 256)] {
            check(n, t, dim);
        }
    }

    fn check(n: usize, t: usize, dim: usize) {
        let (rows, x, p) = (values(n * dim, 1), values(t * dim, 2), values(n * t, 3));
        let mut dots = vec![0.0f32; n * t];
        row_dots(&rows, n, &x, t, dim, &mut dots);
        for r in 0..n {
            for j in 0..t {
                let want = kernel::dot(&rows[r * dim..(r + 1) * dim], &x[j * dim..(j + 1) * dim]);
                assert_eq!(dots[r * t + j].to_bits(), want.to_bits(), "dot [{r},{j}]");
            }
        }
        let mut sum = values(t * dim, 4);
        let mut want = sum.clone();
        weighted_sum(&p, &rows, n, t, dim, &mut sum);
        for r in 0..n {
            for j in 0..t {
                for c in 0..dim {
                    want[j * dim + c] = p[r * t + j].mul_add(rows[r * dim + c], want[j * dim + c]);
                }
            }
        }
        assert!(
            sum.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
    }
}
