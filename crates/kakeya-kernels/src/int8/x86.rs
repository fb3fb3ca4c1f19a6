//! The x86-64 paths of the int8 kernel: AVX-512 VNNI (`vpdpbusd`, one panel row per 32-bit
//! lane of a 512-bit register) and AVX2 (the same lanes over two 256-bit registers, each
//! four-byte product sum made exactly by `vpmaddubsw` and `vpmaddwd`). Both produce the
//! integer sums and then the float steps of [`Panels::panel_portable`], in its order, so every
//! path gives the same bits.

use std::sync::OnceLock;

use super::{MAX_X, PANEL, Panels, Rounded, block, header};
use crate::tiles::prefetch_ahead;

/// Whether this machine has AVX-512 VNNI (Zen 4, Sapphire Rapids and later): the fastest path.
pub(crate) fn vnni_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("fma")
    })
}

/// Whether this machine has AVX2 and FMA: the path where VNNI is missing.
pub(crate) fn avx2_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// Checks what every SIMD path reads and writes.
fn check(m: &Panels, p: usize, xr: &Rounded, j0: usize, xn: usize, out: &[f32]) {
    assert!(
        (p + 1) * m.gpr * block(m.group, m.asym) <= m.data.len()
            && (j0 + xn) * m.cols <= xr.q.len()
            && (j0 + xn) * m.gpr <= xr.d.len().min(xr.start.len()).min(xr.sum.len())
            && out.len() >= xn * PANEL
            && matches!(m.group, 16 | 32),
        "int8 SIMD panel: bad inputs"
    );
}

/// Panel `p` against inputs `j0..j0 + xn` (`out`: `[xn][PANEL]`) on the fastest path this
/// machine has; `false` (nothing written) where it has neither VNNI nor AVX2.
#[allow(unsafe_code)]
pub(crate) fn panel(
    m: &Panels,
    p: usize,
    xr: &Rounded,
    j0: usize,
    xn: usize,
    out: &mut [f32],
) -> bool {
    if vnni_available() {
        check(m, p, xr, j0, xn, out);
        // SAFETY: the features are available and the slices were checked above.
        unsafe {
            match (m.group, m.asym) {
                (32, false) => by_inputs::<32, false>(m, p, xr, j0, xn, out),
                (32, true) => by_inputs::<32, true>(m, p, xr, j0, xn, out),
                (16, false) => by_inputs::<16, false>(m, p, xr, j0, xn, out),
                _ => by_inputs::<16, true>(m, p, xr, j0, xn, out),
            }
        }
        true
    } else {
        avx2_panel(m, p, xr, j0, xn, out)
    }
}

/// [`panel`] on the AVX2 path whatever else the machine has (`false` without AVX2).
#[allow(unsafe_code)]
pub(crate) fn avx2_panel(
    m: &Panels,
    p: usize,
    xr: &Rounded,
    j0: usize,
    xn: usize,
    out: &mut [f32],
) -> bool {
    if !avx2_available() {
        return false;
    }
    check(m, p, xr, j0, xn, out);
    let mut j = 0;
    while j < xn {
        let n = (xn - j).min(AVX2_X);
        let o = &mut out[j * PANEL..(j + n) * PANEL];
        // SAFETY: AVX2 and FMA are available; inputs `j0 + j .. + n` lie within the checked
        // range and `o` holds `n · PANEL` values.
        unsafe {
            match (m.group, m.asym, n) {
                (32, false, 1) => avx2::<1, 32, false>(m, p, xr, j0 + j, o),
                (32, false, 2) => avx2::<2, 32, false>(m, p, xr, j0 + j, o),
                (32, false, 3) => avx2::<3, 32, false>(m, p, xr, j0 + j, o),
                (32, false, _) => avx2::<4, 32, false>(m, p, xr, j0 + j, o),
                (32, true, 1) => avx2::<1, 32, true>(m, p, xr, j0 + j, o),
                (32, true, 2) => avx2::<2, 32, true>(m, p, xr, j0 + j, o),
                (32, true, 3) => avx2::<3, 32, true>(m, p, xr, j0 + j, o),
                (32, true, _) => avx2::<4, 32, true>(m, p, xr, j0 + j, o),
                (_, false, 1) => avx2::<1, 16, false>(m, p, xr, j0 + j, o),
                (_, false, 2) => avx2::<2, 16, false>(m, p, xr, j0 + j, o),
                (_, false, 3) => avx2::<3, 16, false>(m, p, xr, j0 + j, o),
                (_, false, _) => avx2::<4, 16, false>(m, p, xr, j0 + j, o),
                (_, true, 1) => avx2::<1, 16, true>(m, p, xr, j0 + j, o),
                (_, true, 2) => avx2::<2, 16, true>(m, p, xr, j0 + j, o),
                (_, true, 3) => avx2::<3, 16, true>(m, p, xr, j0 + j, o),
                (_, true, _) => avx2::<4, 16, true>(m, p, xr, j0 + j, o),
            }
        }
        j += n;
    }
    true
}

/// Inputs per AVX2 pass: two integer accumulators each, with the weights' four registers and
/// the constants, fill the sixteen registers.
const AVX2_X: usize = 4;

/// Panel `p` against `X` inputs from `j0` with AVX2: lanes `0..8` and `8..16` of the panel lie
/// in two registers. The stored values carry the panel's bias (`w + bias`, unsigned); taking
/// it back gives the signed `w`, and `vpmaddubsw(|w|, x·sign(w))` adds two products `w·x` into
/// 16 bits exactly (at most 2·128·127 < 2¹⁵), `vpmaddwd` by ones the lane's other two. That
/// integer is the VNNI path's: its accumulator starts at `−bias·Σx̂` and adds `(w + bias)·x̂`.
/// The float accumulators live in `out` (touched once per group).
///
/// # Safety
/// The CPU has AVX2 and FMA; panel `p`, inputs `j0..j0 + X` and `X · PANEL` values of `out`
/// exist (checked by [`avx2_panel`]).
#[target_feature(enable = "avx2,fma")]
#[allow(unsafe_code, clippy::needless_range_loop)]
unsafe fn avx2<const X: usize, const G: usize, const ASYM: bool>(
    m: &Panels,
    p: usize,
    xr: &Rounded,
    j0: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::{
        __m256i, _mm256_abs_epi8, _mm256_add_epi32, _mm256_cvtepi32_ps, _mm256_fmadd_ps,
        _mm256_loadu_ps, _mm256_loadu_si256, _mm256_madd_epi16, _mm256_maddubs_epi16,
        _mm256_mul_ps, _mm256_set1_epi8, _mm256_set1_epi16, _mm256_set1_epi32, _mm256_set1_ps,
        _mm256_setzero_ps, _mm256_setzero_si256, _mm256_sign_epi8, _mm256_storeu_ps,
        _mm256_sub_epi8,
    };
    let (cols, gpr) = (m.cols, m.gpr);
    let (hdr, bb) = (header(ASYM), block(G, ASYM));
    // The bias is at most 128; as a byte it wraps, and so does the subtraction.
    let bias = _mm256_set1_epi8(m.bias as u8 as i8);
    let ones = _mm256_set1_epi16(1);
    let o = out.as_mut_ptr();
    for j in 0..X {
        for h in 0..2 {
            // SAFETY: `out` holds `X · PANEL` values.
            unsafe { _mm256_storeu_ps(o.add(j * PANEL + 8 * h), _mm256_setzero_ps()) };
        }
    }
    // SAFETY: the caller checked that panel `p` exists.
    let pp = unsafe { m.data.as_ptr().add(p * gpr * bb) };
    for g in 0..gpr {
        // SAFETY: block `g` of the panel holds the header and `G/4` runs of 64 bytes; input
        // `j0 + j` holds `cols` values and `gpr` group figures; `out` as above.
        unsafe {
            let b = pp.add(g * bb);
            prefetch_ahead(b, bb);
            let mut ai = [[_mm256_setzero_si256(); 2]; X];
            for k in 0..G / 4 {
                let at = b.add(hdr + 64 * k);
                let w: [__m256i; 2] = std::array::from_fn(|h| {
                    _mm256_sub_epi8(_mm256_loadu_si256(at.add(32 * h).cast()), bias)
                });
                let aw = w.map(|v| _mm256_abs_epi8(v));
                for j in 0..X {
                    let x4 =
                        xr.q.as_ptr()
                            .add((j0 + j) * cols + g * G + 4 * k)
                            .cast::<i32>()
                            .read_unaligned();
                    let xb = _mm256_set1_epi32(x4);
                    for h in 0..2 {
                        let pairs = _mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(xb, w[h]));
                        ai[j][h] = _mm256_add_epi32(ai[j][h], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
            for j in 0..X {
                let d = _mm256_set1_ps(*xr.d.get_unchecked((j0 + j) * gpr + g));
                let sum = _mm256_set1_ps(*xr.sum.get_unchecked((j0 + j) * gpr + g));
                for h in 0..2 {
                    let a = o.add(j * PANEL + 8 * h);
                    let sv = _mm256_loadu_ps(b.add(32 * h).cast::<f32>());
                    let mut f = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(ai[j][h]),
                        _mm256_mul_ps(sv, d),
                        _mm256_loadu_ps(a),
                    );
                    if ASYM {
                        let ov = _mm256_loadu_ps(b.add(4 * PANEL + 32 * h).cast::<f32>());
                        f = _mm256_fmadd_ps(ov, sum, f);
                    }
                    _mm256_storeu_ps(a, f);
                }
            }
        }
    }
}

/// [`vnni`] for `xn` inputs.
///
/// # Safety
/// The CPU has AVX-512 VNNI and the slices were checked by [`panel`].
#[allow(unsafe_code)]
unsafe fn by_inputs<const G: usize, const ASYM: bool>(
    m: &Panels,
    p: usize,
    xr: &Rounded,
    j0: usize,
    xn: usize,
    out: &mut [f32],
) {
    // SAFETY: (every arm) the caller's guarantees.
    unsafe {
        match xn {
            1 => vnni::<1, 4, G, ASYM>(m, p, xr, j0, out),
            2 => vnni::<2, 4, G, ASYM>(m, p, xr, j0, out),
            3 => vnni::<3, 2, G, ASYM>(m, p, xr, j0, out),
            4 => vnni::<4, 2, G, ASYM>(m, p, xr, j0, out),
            5 => vnni::<5, 1, G, ASYM>(m, p, xr, j0, out),
            6 => vnni::<6, 1, G, ASYM>(m, p, xr, j0, out),
            7 => vnni::<7, 1, G, ASYM>(m, p, xr, j0, out),
            8 => vnni::<8, 1, G, ASYM>(m, p, xr, j0, out),
            9 => vnni::<9, 1, G, ASYM>(m, p, xr, j0, out),
            10 => vnni::<10, 1, G, ASYM>(m, p, xr, j0, out),
            11 => vnni::<11, 1, G, ASYM>(m, p, xr, j0, out),
            12 => vnni::<12, 1, G, ASYM>(m, p, xr, j0, out),
            13 => vnni::<13, 1, G, ASYM>(m, p, xr, j0, out),
            14 => vnni::<14, 1, G, ASYM>(m, p, xr, j0, out),
            15 => vnni::<15, 1, G, ASYM>(m, p, xr, j0, out),
            _ => vnni::<MAX_X, 1, G, ASYM>(m, p, xr, j0, out),
        }
    }
}

/// Panel `p` against `X` inputs from `j0`: lane `r` of `acc[j]` accumulates row `16p + r`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
#[allow(unsafe_code, clippy::needless_range_loop)]
unsafe fn vnni<const X: usize, const A: usize, const G: usize, const ASYM: bool>(
    m: &Panels,
    p: usize,
    xr: &Rounded,
    j0: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::{
        __m512i, _mm512_add_epi32, _mm512_cvtepi32_ps, _mm512_dpbusd_epi32, _mm512_fmadd_ps,
        _mm512_loadu_ps, _mm512_loadu_si512, _mm512_mul_ps, _mm512_set1_epi32, _mm512_set1_ps,
        _mm512_setzero_ps, _mm512_setzero_si512, _mm512_storeu_ps,
    };
    let (cols, gpr) = (m.cols, m.gpr);
    let mut acc = [_mm512_setzero_ps(); X];
    let (hdr, bb) = (header(ASYM), block(G, ASYM));
    // SAFETY: the caller checked that panel `p` and inputs `j0..j0 + X` exist.
    let pp = unsafe { m.data.as_ptr().add(p * gpr * bb) };
    for g in 0..gpr {
        // SAFETY: block `g` of the panel holds the header and `G/4` runs of 64 bytes; input
        // `j0 + j` holds `cols` values and `gpr` group figures.
        unsafe {
            let b = pp.add(g * bb);
            prefetch_ahead(b, bb);
            // `A` independent chains per input (few inputs: a `vpdpbusd` would otherwise wait
            // on the last one's result), summed after: integer sums, so the same bits.
            let mut ai = [[_mm512_setzero_si512(); A]; X];
            for (j, a) in ai.iter_mut().enumerate() {
                a[0] = _mm512_set1_epi32(*xr.start.get_unchecked((j0 + j) * gpr + g));
            }
            for k in 0..G / 4 {
                let wk = _mm512_loadu_si512(b.add(hdr + 64 * k).cast::<__m512i>());
                for (j, a) in ai.iter_mut().enumerate() {
                    let x4 =
                        xr.q.as_ptr()
                            .add((j0 + j) * cols + g * G + 4 * k)
                            .cast::<i32>()
                            .read_unaligned();
                    a[k % A] = _mm512_dpbusd_epi32(a[k % A], wk, _mm512_set1_epi32(x4));
                }
            }
            let ai: [__m512i; X] = std::array::from_fn(|j| {
                let mut v = ai[j][0];
                for c in &ai[j][1..] {
                    v = _mm512_add_epi32(v, *c);
                }
                v
            });
            let sv = _mm512_loadu_ps(b.cast::<f32>());
            for (j, a) in acc.iter_mut().enumerate() {
                let d = _mm512_set1_ps(*xr.d.get_unchecked((j0 + j) * gpr + g));
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[j]), _mm512_mul_ps(sv, d), *a);
            }
            if ASYM {
                let ov = _mm512_loadu_ps(b.add(4 * PANEL).cast::<f32>());
                for (j, a) in acc.iter_mut().enumerate() {
                    let sum = _mm512_set1_ps(*xr.sum.get_unchecked((j0 + j) * gpr + g));
                    *a = _mm512_fmadd_ps(ov, sum, *a);
                }
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        // SAFETY: `out` holds `X · PANEL` values (checked by the caller).
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(j * PANEL), *a) };
    }
}
