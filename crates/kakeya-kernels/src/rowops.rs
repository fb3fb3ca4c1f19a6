//! Small products over rows held in memory, for attention over cached keys and values on the
//! CPU: a few query rows against a few hundred cached rows are too small for a GEMM (which
//! packs both operands on every call). Both sums run in a fixed order, so each output is the
//! same bits whatever else is computed beside it.

use crate::tiles::{self, DenseRows};

/// Cached rows, `[n, dim]` row-major: f32, or f16 read in place (each value widened to f32
/// exactly as it is loaded), so both products below take the same bits from an f16 row as from
/// its widened copy.
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f16 values.
    F16(&'a [half::f16]),
}

impl Rows<'_> {
    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            Rows::F32(v) => v.len(),
            Rows::F16(v) => v.len(),
        }
    }

    /// Whether no value is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Value `i` as f32.
    fn at(&self, i: usize) -> f32 {
        match self {
            Rows::F32(v) => v[i],
            Rows::F16(v) => v[i].to_f32(),
        }
    }
}

/// `out[r · t + j] = rows_r · x_j` for the `n` rows of `rows` (`[n, dim]`) and the `t` rows of
/// `x` (`[t, dim]`), each in the quantised kernel's canonical order (eight FMA lanes, then
/// `((0+4)+(2+6)) + ((1+5)+(3+7))`), with AVX2/FMA where the CPU has them.
pub fn row_dots(rows: Rows<'_>, n: usize, x: &[f32], t: usize, dim: usize, out: &mut [f32]) {
    assert!(
        rows.len() >= n * dim && x.len() >= t * dim && out.len() >= n * t,
        "row_dots: slices too short"
    );
    let rows = match rows {
        Rows::F32(v) => DenseRows::F32(v),
        Rows::F16(v) => DenseRows::F16(v),
    };
    tiles::dense_tile(rows, n, x, t, dim, out);
}

/// `out_j += Σ_r p[r · t + j] · rows_r` for `j < t` (`out`: `[t, dim]`), over the `n` rows of
/// `rows` (`[n, dim]`) in ascending `r`, each term one FMA per element.
pub fn weighted_sum(p: &[f32], rows: Rows<'_>, n: usize, t: usize, dim: usize, out: &mut [f32]) {
    assert!(
        p.len() >= n * t && rows.len() >= n * dim && out.len() >= t * dim,
        "weighted_sum: slices too short"
    );
    #[cfg(target_arch = "x86_64")]
    if tiles::simd_available() {
        simd::weighted_sum(p, rows, n, t, dim, out);
        return;
    }
    for r in 0..n {
        for j in 0..t {
            let w = p[r * t + j];
            for (c, o) in out[j * dim..(j + 1) * dim].iter_mut().enumerate() {
                *o = w.mul_add(rows.at(r * dim + c), *o);
            }
        }
    }
}

/// `out[i] = src[i]` widened from f16 to f32 (exact), eight at a time with F16C where the CPU
/// has it: cached 16-bit keys and values are widened once per use, so this runs over the
/// whole cache at every decode step.
#[allow(unsafe_code)]
pub fn widen_f16(src: &[half::f16], out: &mut [f32]) {
    assert!(out.len() >= src.len(), "widen_f16: output too short");
    #[cfg(target_arch = "x86_64")]
    if simd::f16c_available() {
        // SAFETY: F16C and AVX are available; `out` holds `src.len()` values.
        unsafe { simd::widen_f16(src, out) };
        return;
    }
    for (o, v) in out.iter_mut().zip(src) {
        *o = v.to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd {
    use std::arch::x86_64::{
        __m256, _mm256_cvtph_ps, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_ps, _mm256_storeu_ps,
    };

    use super::Rows;

    /// Outputs summed together: their accumulators stay in registers while the rows stream.
    const OUTS: usize = 4;
    /// Rows streamed through one column block before the next block: a run of rows read in
    /// memory order (8 KiB of f16 at 256 columns), so that the hardware prefetchers follow the
    /// reads (all of a long tile's rows per column block read memory at the rows' stride).
    const ROWS_PER_PASS: usize = 16;

    /// [`super::weighted_sum`]; the caller checked AVX2/FMA/F16C and the lengths. Rows go in
    /// runs of [`ROWS_PER_PASS`], and within a run columns in blocks of 16 (then 8): a block's
    /// accumulators for up to [`OUTS`] outputs stay in registers while the run's rows stream
    /// through. Every output element still takes its FMAs in ascending row order, as the
    /// portable loop: the same bits.
    pub(super) fn weighted_sum(
        p: &[f32],
        rows: Rows<'_>,
        n: usize,
        t: usize,
        dim: usize,
        out: &mut [f32],
    ) {
        let body = dim / 8 * 8;
        let pairs = dim / 16 * 16;
        for j0 in (0..t).step_by(OUTS) {
            let m = (t - j0).min(OUTS);
            let o = &mut out[j0 * dim..(j0 + m) * dim];
            for r0 in (0..n).step_by(ROWS_PER_PASS) {
                let cols = Cols {
                    p,
                    t,
                    j0,
                    m,
                    rows: r0..(r0 + ROWS_PER_PASS).min(n),
                    dim,
                };
                let mut c = 0;
                while c < pairs {
                    // SAFETY: AVX2, FMA and F16C are available (checked by the caller);
                    // columns `c..c + 16` lie within every row and output.
                    unsafe { cols.block::<2>(rows, c, o) };
                    c += 16;
                }
                if c < body {
                    // SAFETY: as above, columns `c..c + 8`.
                    unsafe { cols.block::<1>(rows, c, o) };
                }
            }
            for r in 0..n {
                for k in 0..m {
                    let wk = p[r * t + j0 + k];
                    for c in body..dim {
                        o[k * dim + c] = wk.mul_add(rows.at(r * dim + c), o[k * dim + c]);
                    }
                }
            }
        }
    }

    /// One pass of [`weighted_sum`]: outputs `j0..j0 + m` of `t`, over rows `rows` of `dim`.
    struct Cols<'a> {
        p: &'a [f32],
        t: usize,
        j0: usize,
        m: usize,
        rows: std::ops::Range<usize>,
        dim: usize,
    }

    impl Cols<'_> {
        /// Columns `c..c + 8·B` of the `m` outputs in `o` (`[m, dim]`), summed over the pass's
        /// rows.
        ///
        /// # Safety
        /// AVX2, FMA and F16C are available; `c + 8·B <= dim`; `rows` holds the pass's rows.
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn block<const B: usize>(&self, rows: Rows<'_>, c: usize, o: &mut [f32]) {
            // SAFETY: (all arms) the caller's.
            unsafe {
                match (rows, self.m) {
                    (Rows::F16(v), 4) => self.run::<B, 4, true>(v.as_ptr().cast(), c, o),
                    (Rows::F16(v), 3) => self.run::<B, 3, true>(v.as_ptr().cast(), c, o),
                    (Rows::F16(v), 2) => self.run::<B, 2, true>(v.as_ptr().cast(), c, o),
                    (Rows::F16(v), _) => self.run::<B, 1, true>(v.as_ptr().cast(), c, o),
                    (Rows::F32(v), 4) => self.run::<B, 4, false>(v.as_ptr().cast(), c, o),
                    (Rows::F32(v), 3) => self.run::<B, 3, false>(v.as_ptr().cast(), c, o),
                    (Rows::F32(v), 2) => self.run::<B, 2, false>(v.as_ptr().cast(), c, o),
                    (Rows::F32(v), _) => self.run::<B, 1, false>(v.as_ptr().cast(), c, o),
                }
            }
        }

        /// [`Self::block`] for `M` (= `self.m`) outputs over rows at `rows` (f16 when `F16`,
        /// else f32): the accumulators a fixed set of registers.
        ///
        /// # Safety
        /// As [`Self::block`]'s, and `M == self.m`.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn run<const B: usize, const M: usize, const F16: bool>(
            &self,
            rows: *const u8,
            c: usize,
            o: &mut [f32],
        ) {
            use std::arch::x86_64::{_mm_loadu_si128, _mm256_setzero_ps};
            let dim = self.dim;
            let po = o.as_mut_ptr();
            let mut acc = [[_mm256_setzero_ps(); B]; M];
            for (k, a) in acc.iter_mut().enumerate() {
                for (b, v) in a.iter_mut().enumerate() {
                    // SAFETY: output k < m, columns within `dim`.
                    *v = unsafe { _mm256_loadu_ps(po.add(k * dim + c + 8 * b)) };
                }
            }
            let p = &self.p[self.rows.start * self.t..];
            for (i, r) in self.rows.clone().enumerate() {
                let mut v: [__m256; B] = [_mm256_setzero_ps(); B];
                for (b, x) in v.iter_mut().enumerate() {
                    let at = r * dim + c + 8 * b;
                    // SAFETY: row r lies in `rows`, columns `at..at + 8` within it.
                    *x = unsafe {
                        if F16 {
                            _mm256_cvtph_ps(_mm_loadu_si128(rows.cast::<u16>().add(at).cast()))
                        } else {
                            _mm256_loadu_ps(rows.cast::<f32>().add(at))
                        }
                    };
                }
                let w = &p[i * self.t + self.j0..i * self.t + self.j0 + M];
                for (a, &wk) in acc.iter_mut().zip(w) {
                    let wv = _mm256_set1_ps(wk);
                    for (x, y) in a.iter_mut().zip(&v) {
                        *x = _mm256_fmadd_ps(wv, *y, *x);
                    }
                }
            }
            for (k, a) in acc.iter().enumerate() {
                for (b, v) in a.iter().enumerate() {
                    // SAFETY: as the loads.
                    unsafe { _mm256_storeu_ps(po.add(k * dim + c + 8 * b), *v) };
                }
            }
        }
    }

    /// Whether this CPU has F16C (and AVX), checked once.
    pub(super) fn f16c_available() -> bool {
        static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *OK.get_or_init(|| is_x86_feature_detected!("f16c") && is_x86_feature_detected!("avx"))
    }

    /// [`super::widen_f16`] with `vcvtph2ps`.
    ///
    /// # Safety
    /// The CPU has F16C and AVX; `out` holds at least `src.len()` values.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn widen_f16(src: &[half::f16], out: &mut [f32]) {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm256_cvtph_ps};
        let body = src.len() / 8 * 8;
        let (ps, po) = (src.as_ptr(), out.as_mut_ptr());
        let mut i = 0;
        while i < body {
            // SAFETY: i + 8 <= src.len() <= out.len().
            unsafe {
                let h = _mm_loadu_si128(ps.add(i).cast::<__m128i>());
                _mm256_storeu_ps(po.add(i), _mm256_cvtph_ps(h));
            }
            i += 8;
        }
        for (o, v) in out[body..src.len()].iter_mut().zip(&src[body..]) {
            *o = v.to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widened_f16_equals_the_scalar_conversion() {
        // Every f16 bit pattern (NaNs keep their payload's quietness; compare bits).
        let src: Vec<half::f16> = (0..=u16::MAX).map(half::f16::from_bits).collect();
        for len in [src.len(), 13, 8, 7, 0] {
            let mut out = vec![0.0f32; len];
            widen_f16(&src[src.len() - len..], &mut out);
            for (o, v) in out.iter().zip(&src[src.len() - len..]) {
                let want = v.to_f32();
                assert!(
                    o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()),
                    "{:#06x}: {o} vs {want}",
                    v.to_bits()
                );
            }
        }
    }

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
        row_dots(Rows::F32(&rows), n, &x, t, dim, &mut dots);
        for r in 0..n {
            for j in 0..t {
                let want = tiles::dot(&rows[r * dim..(r + 1) * dim], &x[j * dim..(j + 1) * dim]);
                assert_eq!(dots[r * t + j].to_bits(), want.to_bits(), "dot [{r},{j}]");
            }
        }
        let mut sum = values(t * dim, 4);
        let mut want = sum.clone();
        weighted_sum(&p, Rows::F32(&rows), n, t, dim, &mut sum);
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

    #[test]
    fn f16_rows_read_in_place_give_the_bits_of_their_widened_copy() {
        for (n, t, dim) in [(13, 4, 44), (5, 6, 16), (64, 4, 256), (3, 1, 7)] {
            let half: Vec<half::f16> = values(n * dim, 5)
                .into_iter()
                .map(|v| half::f16::from_f32(v * 3.0))
                .collect();
            let wide: Vec<f32> = half.iter().map(|v| v.to_f32()).collect();
            let (x, p) = (values(t * dim, 6), values(n * t, 7));
            let (mut a, mut b) = (vec![0.0f32; n * t], vec![0.0f32; n * t]);
            row_dots(Rows::F16(&half), n, &x, t, dim, &mut a);
            row_dots(Rows::F32(&wide), n, &x, t, dim, &mut b);
            assert!(
                a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()),
                "dots {n}x{dim}"
            );
            let (mut a, mut b) = (values(t * dim, 8), values(t * dim, 8));
            weighted_sum(&p, Rows::F16(&half), n, t, dim, &mut a);
            weighted_sum(&p, Rows::F32(&wide), n, t, dim, &mut b);
            assert!(
                a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()),
                "sums {n}x{dim}"
            );
        }
    }
}
