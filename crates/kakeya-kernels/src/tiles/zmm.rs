//! The fused tiles with AVX-512: two weight rows per 16-lane register.
//!
//! A zmm register holds the eight canonical accumulators of one input row against *two*
//! weight rows (lanes 0–7 the first row's, 8–15 the second's): the two rows' int8 values are
//! widened and scaled together, each input's eight values are broadcast to both halves, and
//! one 16-wide FMA does the work of two 8-wide ones. Every lane still takes
//! `fma(w_k, x_k, acc)` over its columns in ascending order, and the halves are reduced
//! separately in the canonical order, so each output has the bits of [`super::dot`] — only
//! half as many FMA, convert and scale instructions are issued. CPUs that split each 16-wide
//! instruction into two 256-bit halves save only the issue slots.

use std::arch::x86_64::{
    __m512, _mm_castpd_si128, _mm_castsi128_pd, _mm_loadh_pd, _mm_loadl_epi64, _mm256_castpd_ps,
    _mm256_castps_pd, _mm256_loadu_ps, _mm256_set1_ps, _mm512_add_ps, _mm512_broadcast_f64x4,
    _mm512_castpd_ps, _mm512_castps_pd, _mm512_castps512_ps256, _mm512_cvtepi8_epi32,
    _mm512_cvtepi32_ps, _mm512_extractf64x4_pd, _mm512_fmadd_ps, _mm512_insertf64x4, _mm512_mul_ps,
    _mm512_set1_ps, _mm512_setzero_ps,
};
use std::sync::OnceLock;

use super::{LANES, Layout, TILE};

/// Most input rows summed against a tile in one pass (more are taken in chunks of this many,
/// the tile re-read from L1): sixteen accumulators, two weights, two scales (two offsets),
/// one input — 21–23 of the 32 zmm registers. The half- and quarter-width instructions
/// around them (the int8 loads, the reductions) need AVX-512VL to reach registers 16–31:
/// without it LLVM keeps every accumulator in zmm0–15 and eight inputs spill. With it, eight
/// inputs beat four per pass and twelve do not (`qbench` measures it).
const INPUTS: usize = 8;

/// Weight-row pairs of a tile.
const PAIRS: usize = TILE / 2;

/// Whether this CPU has AVX-512F and AVX-512VL (besides the AVX2+FMA the callers check).
pub(super) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl"))
}

/// [`super::tiles_fused`]: `out[r · t + j] = dot(w_r, x_j)` for the `rows` weight rows in
/// `tiles` and the `t` input rows of `x` (`[t, cols]`), each tile against up to
/// [`INPUTS`] input rows at a time (the tile stays in L1 for the next ones).
///
/// # Safety
/// AVX2, FMA, AVX-512F and AVX-512VL must be available, `tiles` must hold
/// `rows.div_ceil(TILE)` tiles of layout `l`, `x` at least `t · l.cols()` values and `out` at
/// least `rows · t`.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
pub(super) unsafe fn tiles_fused<const ASYM: bool>(
    l: Layout,
    tiles: &[u8],
    x: &[f32],
    t: usize,
    rows: usize,
    out: &mut [f32],
) {
    let cols = l.cols();
    for k in 0..rows.div_ceil(TILE) {
        let tile = &tiles[k * l.tile()..];
        let mut j0 = 0;
        while j0 < t {
            let xn = (t - j0).min(INPUTS);
            let xs = &x[j0 * cols..(j0 + xn) * cols];
            let at = super::TileOut { k, rows, t, j0 };
            // SAFETY: (all arms) tile `k` and the `xn` inputs lie inside their slices
            // (the caller's contract).
            unsafe {
                match xn {
                    1 => at.put(0, &tile_rows::<1, ASYM>(l, tile, xs), out),
                    2 => at.put(0, &tile_rows::<2, ASYM>(l, tile, xs), out),
                    3 => at.put(0, &tile_rows::<3, ASYM>(l, tile, xs), out),
                    4 => at.put(0, &tile_rows::<4, ASYM>(l, tile, xs), out),
                    5 => at.put(0, &tile_rows::<5, ASYM>(l, tile, xs), out),
                    6 => at.put(0, &tile_rows::<6, ASYM>(l, tile, xs), out),
                    7 => at.put(0, &tile_rows::<7, ASYM>(l, tile, xs), out),
                    _ => at.put(0, &tile_rows::<INPUTS, ASYM>(l, tile, xs), out),
                }
            }
            j0 += xn;
        }
    }
}

/// `[a; 8]` in the low half, `[b; 8]` in the high half.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
#[inline]
fn halves(a: f32, b: f32) -> __m512 {
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castps_pd(_mm512_set1_ps(a)),
        _mm256_castps_pd(_mm256_set1_ps(b)),
    ))
}

/// The tile's `TILE` rows (both pairs in one pass) against `X` input rows (`x`:
/// `[X, cols]`): `res[r][j]`.
///
/// # Safety
/// AVX2, FMA, AVX-512F and AVX-512VL must be available; `tile` must hold a whole tile of
/// layout `l` and `x` at least `X · l.cols()` values.
#[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
#[inline]
unsafe fn tile_rows<const X: usize, const ASYM: bool>(
    l: Layout,
    tile: &[u8],
    x: &[f32],
) -> [[f32; X]; TILE] {
    debug_assert!(tile.len() >= l.tile() && x.len() >= X * l.cols());
    let mut acc = [[_mm512_setzero_ps(); X]; PAIRS];
    let (tp, xp, cols) = (tile.as_ptr(), x.as_ptr(), l.cols());
    let (header, block, group) = (l.header(), l.block(), l.group);
    for g in 0..l.gpr {
        // SAFETY: block `g` lies inside the tile (`gpr · block` bytes).
        let b = unsafe { tp.add(g * block) };
        super::prefetch_ahead(b, block);
        // SAFETY: the header holds `TILE` f32 scales (then `TILE` offsets when asymmetric).
        let at = |i: usize| unsafe { b.add(4 * i).cast::<f32>().read_unaligned() };
        let mut sv = [_mm512_setzero_ps(); PAIRS];
        let mut ov = [_mm512_setzero_ps(); PAIRS];
        for p in 0..PAIRS {
            sv[p] = halves(at(2 * p), at(2 * p + 1));
            if ASYM {
                ov[p] = halves(at(TILE + 2 * p), at(TILE + 2 * p + 1));
            }
        }
        // SAFETY: the values follow the header inside the block.
        let vals = unsafe { b.add(header) };
        let mut c = 0;
        while c < group {
            // Both pairs' weights, then each input once against them.
            let mut wv = [_mm512_setzero_ps(); PAIRS];
            for (p, w) in wv.iter_mut().enumerate() {
                // SAFETY: eight int8 values of rows `2p` and `2p + 1` at `c..c + 8 <= group`.
                let q = unsafe {
                    let lo = _mm_loadl_epi64(vals.add(2 * p * group + c).cast());
                    let hi = vals.add((2 * p + 1) * group + c).cast::<f64>();
                    _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(lo), hi))
                };
                *w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), sv[p]);
                if ASYM {
                    *w = _mm512_add_ps(*w, ov[p]);
                }
            }
            for j in 0..X {
                // SAFETY: input row `j < X` holds `cols` values; `g·group + c + 8 <= cols`.
                let x8 = unsafe { _mm256_loadu_ps(xp.add(j * cols + g * group + c)) };
                let xj = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(x8)));
                for (a, w) in acc.iter_mut().zip(&wv) {
                    a[j] = _mm512_fmadd_ps(*w, xj, a[j]);
                }
            }
            c += LANES;
        }
    }
    let mut res = [[0.0f32; X]; TILE];
    for (p, a) in acc.iter().enumerate() {
        for (j, &v) in a.iter().enumerate() {
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            res[2 * p][j] = super::simd::reduce_avx(_mm512_castps512_ps256(v));
            res[2 * p + 1][j] = super::simd::reduce_avx(hi);
        }
    }
    res
}
