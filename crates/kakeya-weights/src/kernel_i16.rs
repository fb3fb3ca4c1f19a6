//! The integer dot-product kernel behind [`crate::QuantMatrix::matmul`] under
//! [`crate::Kernel::Int16`] (opt-in): the input row is quantised to int16 per weight group,
//! and each group's products `q·x̂` are summed exactly in int32 before one float multiply-add
//! by the group's two scales.
//!
//! Per input row and group `g` of `G` values (the weight format's group, 16 or 32):
//! `a_g = max|x_j| / 32767` and `x̂_j = round(x_j / a_g)`, so `|x_j − a_g·x̂_j| ≤ a_g / 2`
//! (a relative error of at most 2⁻¹⁶ of the group's largest value). Lane `l` of eight sums
//! the products of values `{2l, 2l+1}` (and `{16+2l, 16+2l+1}` when `G = 32`) in int32 —
//! exact, and below 2²⁴ in magnitude, so its conversion to f32 is exact too — and accumulates
//! `fma(d_l, s_g·a_g, acc_l)` over the groups in order; the lanes are reduced as in
//! [`crate::kernel`], then the offset term `Σ_g o_g·(a_g·Σx̂)` of the asymmetric formats is
//! added. Every step is fixed per (weight row, input row): the result does not depend on how
//! many rows run together (speculative verification relies on it), and the AVX2 path and the
//! portable one give the same bits. Compared with rebuilding f32 weights (`kernel`), one input
//! row takes about half the instructions (1.2–1.8× faster per projection on AVX2); several
//! rows take more (the per-group scale multiply is not shared). The values differ by the int16
//! rounding of the activations: on the golden prompts the logits move by up to ~1e-3 from the
//! exact kernel's (which is within 3e-4 of transformers'), so it is not the default.

use crate::kernel::reduce;

/// Largest |x̂|.
const QMAX: f32 = 32767.0;

/// Input rows quantised for the integer kernel.
#[derive(Debug, Clone)]
pub(crate) struct QuantInput {
    /// `[t, cols]` int16 values.
    pub q: Vec<i16>,
    /// `[t, cols / group]` scales `a_g`.
    pub a: Vec<f32>,
    /// `[t, cols / group]` `a_g · Σ_j x̂_j` (the offset formats' term), as f32.
    pub sum: Vec<f32>,
    pub cols: usize,
    pub group: usize,
}

impl QuantInput {
    /// Quantises `t` rows of `cols` values in groups of `group`.
    pub fn new(x: &[f32], t: usize, cols: usize, group: usize) -> Self {
        let gpr = cols / group;
        let mut q = vec![0i16; t * cols];
        let mut a = vec![0.0f32; t * gpr];
        let mut sum = vec![0.0f32; t * gpr];
        for (g, (xg, qg)) in x
            .chunks_exact(group)
            .zip(q.chunks_exact_mut(group))
            .enumerate()
        {
            let m = xg.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            if m == 0.0 || !m.is_finite() {
                // Zeros stay zero; a non-finite input poisons its group's results.
                a[g] = if m == 0.0 { 0.0 } else { f32::NAN };
                continue;
            }
            let inv = QMAX / m;
            let mut s = 0i32;
            for (qi, &v) in qg.iter_mut().zip(xg) {
                *qi = (v * inv).round().clamp(-QMAX, QMAX) as i16;
                s += i32::from(*qi);
            }
            a[g] = m / QMAX;
            sum[g] = a[g] * s as f32;
        }
        Self {
            q,
            a,
            sum,
            cols,
            group,
        }
    }
}

/// Weight rows as the kernel reads them.
pub(crate) struct WRows<'a> {
    /// `[rows, cols]` values.
    pub q: &'a [i8],
    /// `[rows, cols / group]` scales.
    pub s: &'a [f32],
    /// `[rows, cols / group]` offsets of asymmetric formats.
    pub o: Option<&'a [f32]>,
}

/// The portable path: one (weight row `r`, input row `i`) output, the canonical bits.
pub(crate) fn dot(w: &WRows<'_>, r: usize, x: &QuantInput, i: usize) -> f32 {
    let (cols, g) = (x.cols, x.group);
    let gpr = cols / g;
    let wq = &w.q[r * cols..(r + 1) * cols];
    let xq = &x.q[i * cols..(i + 1) * cols];
    let mut acc = [0.0f32; 8];
    for k in 0..gpr {
        let scale = w.s[r * gpr + k] * x.a[i * gpr + k];
        let (wg, xg) = (&wq[k * g..(k + 1) * g], &xq[k * g..(k + 1) * g]);
        for (l, a) in acc.iter_mut().enumerate() {
            let mut d = 0i32;
            for half in 0..g / 16 {
                for j in [16 * half + 2 * l, 16 * half + 2 * l + 1] {
                    d += i32::from(wg[j]) * i32::from(xg[j]);
                }
            }
            *a = (d as f32).mul_add(scale, *a);
        }
    }
    reduce(acc) + offset_term(w, r, x, i)
}

/// `Σ_g o_g · (a_g Σ x̂)` in group order (0 for symmetric formats).
#[inline(always)]
fn offset_term(w: &WRows<'_>, r: usize, x: &QuantInput, i: usize) -> f32 {
    let Some(o) = w.o else { return 0.0 };
    let gpr = x.cols / x.group;
    let mut t = 0.0f32;
    for k in 0..gpr {
        t += o[r * gpr + k] * x.sum[i * gpr + k];
    }
    t
}

/// `out[r · t + i]` for `rows` weight rows from `r0` against every input row.
pub(crate) fn rows(w: &WRows<'_>, r0: usize, rows: usize, x: &QuantInput, out: &mut [f32]) {
    let t = x.q.len() / x.cols;
    #[cfg(target_arch = "x86_64")]
    if simd::available() {
        simd::rows(w, r0, rows, x, t, out);
        return;
    }
    for r in 0..rows {
        for i in 0..t {
            out[r * t + i] = dot(w, r0 + r, x, i);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd {
    use std::arch::x86_64::{
        __m256, __m256i, _MM_HINT_T0, _mm_loadu_si128, _mm_prefetch, _mm256_add_epi32,
        _mm256_cvtepi8_epi16, _mm256_cvtepi32_ps, _mm256_fmadd_ps, _mm256_loadu_si256,
        _mm256_madd_epi16, _mm256_set1_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };
    use std::sync::OnceLock;

    use super::{QuantInput, WRows, offset_term};
    use crate::kernel::reduce;

    pub(super) fn available() -> bool {
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }

    /// [`super::rows`] with AVX2+FMA: tiles of up to 4 weight rows × 2 input rows.
    pub(super) fn rows(
        w: &WRows<'_>,
        r0: usize,
        rows: usize,
        x: &QuantInput,
        t: usize,
        out: &mut [f32],
    ) {
        let (cols, gpr) = (x.cols, x.cols / x.group);
        assert!(
            (r0 + rows) * cols <= w.q.len()
                && (r0 + rows) * gpr <= w.s.len()
                && w.o.is_none_or(|o| (r0 + rows) * gpr <= o.len())
                && x.q.len() == t * cols
                && x.a.len() == t * gpr
                && out.len() >= rows * t
                && matches!(x.group, 16 | 32),
            "kernel_i16::rows: bad shapes"
        );
        let mut r = 0;
        while r < rows {
            let rn = (rows - r).min(4);
            let mut i = 0;
            while i < t {
                let xn = (t - i).min(2);
                // SAFETY: AVX2 and FMA are available (`available`), and the shapes were
                // checked above: rows `r0+r..r0+r+rn` and inputs `i..i+xn` are in bounds.
                let res = unsafe {
                    match (rn, xn) {
                        (4, 2) => tile::<4, 2>(w, r0 + r, x, i),
                        (4, _) => tile::<4, 1>(w, r0 + r, x, i),
                        (3, 2) => tile::<3, 2>(w, r0 + r, x, i),
                        (3, _) => tile::<3, 1>(w, r0 + r, x, i),
                        (2, 2) => tile::<2, 2>(w, r0 + r, x, i),
                        (2, _) => tile::<2, 1>(w, r0 + r, x, i),
                        (_, 2) => tile::<1, 2>(w, r0 + r, x, i),
                        _ => tile::<1, 1>(w, r0 + r, x, i),
                    }
                };
                for (k, row) in res.iter().enumerate().take(rn) {
                    for (j, &v) in row.iter().enumerate().take(xn) {
                        out[(r + k) * t + i + j] = v + offset_term(w, r0 + r + k, x, i + j);
                    }
                }
                i += xn;
            }
            r += rn;
        }
    }

    /// `R × X` lane-reduced sums (offset term excluded) for weight rows `r..r+R` and inputs
    /// `i..i+X`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<const R: usize, const X: usize>(
        w: &WRows<'_>,
        r: usize,
        x: &QuantInput,
        i: usize,
    ) -> [[f32; 2]; 4] {
        // SAFETY: the caller checked every index read below (rows `r..r+R`, inputs
        // `i..i+X`, groups of 16 or 32 values inside `cols`).
        unsafe { tile_body::<R, X>(w, r, x, i) }
    }

    /// The tile's loop; every pointer read is in bounds by the caller's checks.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    #[allow(unsafe_op_in_unsafe_fn)]
    unsafe fn tile_body<const R: usize, const X: usize>(
        w: &WRows<'_>,
        r: usize,
        x: &QuantInput,
        i: usize,
    ) -> [[f32; 2]; 4] {
        let (cols, g) = (x.cols, x.group);
        let gpr = cols / g;
        let mut acc: [[__m256; X]; R] = [[_mm256_setzero_ps(); X]; R];
        for k in 0..gpr {
            let base = k * g;
            // Input values of this group: 16 int16 per vector (one or two vectors).
            let mut xv: [[__m256i; 2]; X] = [[std::mem::zeroed(); 2]; X];
            for (j, v) in xv.iter_mut().enumerate() {
                let p = x.q.as_ptr().add((i + j) * cols + base);
                v[0] = _mm256_loadu_si256(p.cast());
                if g == 32 {
                    v[1] = _mm256_loadu_si256(p.add(16).cast());
                }
            }
            if base % 64 == 0 {
                // Stream the next rows in while these are summed (a prefetch never faults).
                for rr in 0..R {
                    let p = w.q.as_ptr().wrapping_add((r + R + rr) * cols + base);
                    _mm_prefetch::<_MM_HINT_T0>(p.cast());
                }
            }
            for (rr, accr) in acc.iter_mut().enumerate() {
                let wp = w.q.as_ptr().add((r + rr) * cols + base);
                let w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wp.cast()));
                let w1 = if g == 32 {
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(wp.add(16).cast()))
                } else {
                    std::mem::zeroed()
                };
                let s = *w.s.get_unchecked((r + rr) * gpr + k);
                for (j, a) in accr.iter_mut().enumerate() {
                    let mut d = _mm256_madd_epi16(w0, xv[j][0]);
                    if g == 32 {
                        d = _mm256_add_epi32(d, _mm256_madd_epi16(w1, xv[j][1]));
                    }
                    let scale = _mm256_set1_ps(s * *x.a.get_unchecked((i + j) * gpr + k));
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, *a);
                }
            }
        }
        let mut res = [[0.0f32; 2]; 4];
        for (rr, accr) in acc.iter().enumerate() {
            for (j, a) in accr.iter().enumerate() {
                let mut lanes = [0.0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), *a);
                res[rr][j] = reduce(lanes);
            }
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(rows: usize, cols: usize, group: usize, asym: bool) -> (Vec<i8>, Vec<f32>, Vec<f32>) {
        let mut s: u32 = 7;
        let mut next = || {
            s = s.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (s >> 16) as i32
        };
        let q = (0..rows * cols)
            .map(|_| (next() % 256 - 128) as i8)
            .collect();
        let sc = (0..rows * cols / group)
            .map(|_| (next() % 100) as f32 * 1e-4)
            .collect();
        let o = if asym {
            (0..rows * cols / group)
                .map(|_| (next() % 100 - 50) as f32 * 1e-3)
                .collect()
        } else {
            Vec::new()
        };
        (q, sc, o)
    }

    #[test]
    fn simd_and_portable_paths_agree_bit_for_bit_and_with_f64() {
        for (group, asym) in [(32, false), (32, true), (16, false)] {
            let (rows, cols, t) = (7, 256, 5);
            let (q, s, o) = data(rows, cols, group, asym);
            let w = WRows {
                q: &q,
                s: &s,
                o: asym.then_some(o.as_slice()),
            };
            let xf: Vec<f32> = (0..t * cols)
                .map(|i| ((i * 37) % 23) as f32 * 0.07 - 0.7 + if i % 97 == 0 { 40.0 } else { 0.0 })
                .collect();
            let x = QuantInput::new(&xf, t, cols, group);
            let mut out = vec![0.0; rows * t];
            rows_all(&w, rows, &x, &mut out);
            for r in 0..rows {
                for i in 0..t {
                    let want = dot(&w, r, &x, i);
                    assert_eq!(out[r * t + i].to_bits(), want.to_bits(), "[{r},{i}]");
                    // Against the exact product with the f32 weights.
                    let gpr = cols / group;
                    let exact: f64 = (0..cols)
                        .map(|j| {
                            let g = r * gpr + j / group;
                            let wv = q[r * cols + j] as f32 * s[g] + if asym { o[g] } else { 0.0 };
                            wv as f64 * xf[i * cols + j] as f64
                        })
                        .sum();
                    let scale: f64 = (0..cols)
                        .map(|j| {
                            let g = r * gpr + j / group;
                            ((q[r * cols + j] as f32 * s[g]).abs() as f64
                                + if asym { o[g].abs() as f64 } else { 0.0 })
                                * xf[i * cols + j].abs() as f64
                        })
                        .sum();
                    assert!(
                        (want as f64 - exact).abs() <= 1e-4 * scale,
                        "[{r},{i}] {want} vs {exact} (scale {scale})"
                    );
                }
            }
        }
    }

    fn rows_all(w: &WRows<'_>, n: usize, x: &QuantInput, out: &mut [f32]) {
        rows(w, 0, n, x, out);
    }

    #[test]
    fn a_rows_result_does_not_depend_on_the_other_rows() {
        let (rows_n, cols, group) = (6, 128, 32);
        let (q, s, _) = data(rows_n, cols, group, false);
        let w = WRows {
            q: &q,
            s: &s,
            o: None,
        };
        let xf: Vec<f32> = (0..4 * cols)
            .map(|i| ((i * 13) % 29) as f32 * 0.05 - 0.6)
            .collect();
        let all = QuantInput::new(&xf, 4, cols, group);
        let mut out = vec![0.0; rows_n * 4];
        rows(&w, 0, rows_n, &all, &mut out);
        for i in 0..4 {
            let one = QuantInput::new(&xf[i * cols..(i + 1) * cols], 1, cols, group);
            let mut o1 = vec![0.0; rows_n];
            rows(&w, 0, rows_n, &one, &mut o1);
            for r in 0..rows_n {
                assert_eq!(out[r * 4 + i].to_bits(), o1[r].to_bits(), "[{r},{i}]");
            }
        }
    }
}
