//! The x86-64 paths of [`super`]: AVX2+FMA, and the fused tiles with AVX-512 (see
//! [`super::zmm`]) where the CPU has it. Same bits as the portable path.

use std::arch::x86_64::{__m256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps};
use std::sync::OnceLock;

use super::{LANES, Layout, TILE};

/// Whether this CPU has AVX2, FMA and F16C (every x86-64 CPU with AVX2 so far has F16C), checked
/// once: the paths of this module use all three.
pub(super) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// Element types of [`dense_row`]'s weight rows.
const DENSE_F32: u8 = 0;
const DENSE_BF16: u8 = 1;
const DENSE_F16: u8 = 2;

/// [`super::reduce`] in registers: the same additions in the same order (lanes `l` and
/// `l + 4` first, then `(0+2)` and `(1+3)` of those, then their sum), so the same bits.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) fn reduce_avx(v: __m256) -> f32 {
    use std::arch::x86_64::{
        _mm_add_ps, _mm_add_ss, _mm_cvtss_f32, _mm_movehl_ps, _mm_shuffle_ps,
        _mm256_castps256_ps128, _mm256_extractf128_ps,
    };
    let b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps::<1>(c, c)))
}

/// [`super::tiles_fused`] with AVX2+FMA.
pub(super) fn tiles_fused(
    l: Layout,
    tiles: &[u8],
    x: &[f32],
    t: usize,
    rows: usize,
    out: &mut [f32],
) {
    assert!(
        tiles.len() >= rows.div_ceil(TILE) * l.tile()
            && x.len() >= t * l.cols()
            && out.len() >= rows * t,
        "tiles::tiles_fused: slices too short"
    );
    // SAFETY: AVX2 and FMA are available (checked by the caller through `available`),
    // AVX-512F where `zmm::available` says so, and the lengths were checked above.
    unsafe {
        match (l.asym, super::zmm::available() && !super::avx2_forced()) {
            (true, true) => super::zmm::tiles_fused::<true>(l, tiles, x, t, rows, out),
            (false, true) => super::zmm::tiles_fused::<false>(l, tiles, x, t, rows, out),
            (true, false) => fused_tiles_avx2::<true>(l, tiles, x, t, rows, out),
            (false, false) => fused_tiles_avx2::<false>(l, tiles, x, t, rows, out),
        }
    }
}

/// Every tile's rows against the `t` input rows, in chunks of up to
/// [`super::FUSED_INPUTS`] per tile, written to `out` (`[rows, t]`).
#[target_feature(enable = "avx2,fma")]
unsafe fn fused_tiles_avx2<const ASYM: bool>(
    l: Layout,
    tiles: &[u8],
    x: &[f32],
    t: usize,
    rows: usize,
    out: &mut [f32],
) {
    const _: () = assert!(super::FUSED_INPUTS == 4, "the arms below");
    let cols = l.cols();
    for k in 0..rows.div_ceil(TILE) {
        let tile = &tiles[k * l.tile()..];
        let mut j0 = 0;
        while j0 < t {
            let xn = (t - j0).min(super::FUSED_INPUTS);
            let xs = &x[j0 * cols..(j0 + xn) * cols];
            // SAFETY: (all arms) tile `k` and the inputs are inside their slices (checked by
            // the caller).
            unsafe {
                match xn {
                    1 => chunk_avx2::<1, ASYM>(l, tile, k, xs, rows, out, t, j0),
                    2 => chunk_avx2::<2, ASYM>(l, tile, k, xs, rows, out, t, j0),
                    3 => chunk_avx2::<3, ASYM>(l, tile, k, xs, rows, out, t, j0),
                    _ => chunk_avx2::<4, ASYM>(l, tile, k, xs, rows, out, t, j0),
                }
            }
            j0 += xn;
        }
    }
}

/// Tile `k`'s rows against `X` input rows (`x`: `[X, cols]`), written to columns
/// `j0..j0 + X` of `out` (`[rows, t]`). With more than two input rows the tile is summed
/// in two passes of two weight rows each, so the accumulators (`rows × X`) and the inputs
/// stay within AVX2's 16 registers instead of spilling; the second pass reads the tile
/// from L1, and every output's FMAs run in the same canonical order either way.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn chunk_avx2<const X: usize, const ASYM: bool>(
    l: Layout,
    tile: &[u8],
    k: usize,
    x: &[f32],
    rows: usize,
    out: &mut [f32],
    t: usize,
    j0: usize,
) {
    const HALF: usize = TILE / 2;
    let at = super::TileOut { k, rows, t, j0 };
    let mut put = |r0: usize, res: &[[f32; X]]| at.put(r0, res, out);
    // The tile and `x` are inside their slices (checked by the caller), and each call's row
    // range lies inside the tile.
    if X <= 2 {
        // SAFETY: as above; rows 0..TILE.
        put(0, &unsafe { fused_avx2::<X, ASYM, TILE>(l, tile, 0, x) });
    } else {
        // SAFETY: as above; rows 0..HALF.
        put(0, &unsafe { fused_avx2::<X, ASYM, HALF>(l, tile, 0, x) });
        if k * TILE + HALF < rows {
            // SAFETY: as above; rows HALF..TILE, which the tile holds (`k·TILE + HALF < rows`).
            put(HALF, &unsafe {
                fused_avx2::<X, ASYM, HALF>(l, tile, HALF, x)
            });
        }
    }
}

/// The tile's rows `r0..r0 + R` against `X` input rows (`x`: `[X, cols]`); `ASYM` =
/// `l.asym` (a constant, so the loop has no branch and the offsets stay in registers).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn fused_avx2<const X: usize, const ASYM: bool, const R: usize>(
    l: Layout,
    tile: &[u8],
    r0: usize,
    x: &[f32],
) -> [[f32; X]; R] {
    use std::arch::x86_64::{
        _mm_loadl_epi64, _mm256_add_ps, _mm256_cvtepi8_epi32, _mm256_cvtepi32_ps, _mm256_mul_ps,
        _mm256_set1_ps,
    };
    let mut acc = [[_mm256_setzero_ps(); X]; R];
    let (tp, xp, cols) = (tile.as_ptr(), x.as_ptr(), l.cols());
    let (header, block) = (l.header(), l.block());
    let mut sv = [_mm256_setzero_ps(); R];
    let mut ov = [_mm256_setzero_ps(); R];
    for g in 0..l.gpr {
        // SAFETY: block `g` lies inside the tile (`gpr · block` bytes).
        let b = unsafe { tp.add(g * block) };
        super::prefetch_ahead(b, block);
        for i in 0..R {
            let r = r0 + i;
            // SAFETY: the header holds `TILE` scales (and `TILE` offsets) as f32 bytes,
            // and `r < TILE`.
            sv[i] = _mm256_set1_ps(unsafe { b.add(4 * r).cast::<f32>().read_unaligned() });
            if ASYM {
                // SAFETY: the offsets follow the scales in the header, and `r < TILE`.
                ov[i] =
                    _mm256_set1_ps(unsafe { b.add(4 * (TILE + r)).cast::<f32>().read_unaligned() });
            }
        }
        // SAFETY: the values follow the header inside the block.
        let vals = unsafe { b.add(header) };
        let mut k = 0;
        while k < l.group {
            let mut xv = [_mm256_setzero_ps(); X];
            for (j, v) in xv.iter_mut().enumerate() {
                // SAFETY: input row `j < X` holds `cols` values; `g·group + k + 8 <= cols`.
                *v = unsafe { _mm256_loadu_ps(xp.add(j * cols + g * l.group + k)) };
            }
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: eight int8 values of row `r0 + i` at `k..k+8 <= group`.
                let q8 = unsafe { _mm_loadl_epi64(vals.add((r0 + i) * l.group + k).cast()) };
                let qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                let mut wv = _mm256_mul_ps(qf, sv[i]);
                if ASYM {
                    wv = _mm256_add_ps(wv, ov[i]);
                }
                for (aj, v) in a.iter_mut().zip(&xv) {
                    *aj = _mm256_fmadd_ps(wv, *v, *aj);
                }
            }
            k += LANES;
        }
    }
    let mut res = [[0.0f32; X]; R];
    for (r, a) in res.iter_mut().zip(&acc) {
        for (v, aj) in r.iter_mut().zip(a) {
            *v = reduce_avx(*aj);
        }
    }
    res
}

/// [`super::dense_tile`] with AVX2+FMA: each weight row is loaded once per chunk of up to
/// [`super::FUSED_INPUTS`] input rows; lane `l` of each accumulator takes the columns
/// `k ≡ l (mod 8)` in ascending order (one 8-wide FMA per 8 columns), the tail past the last
/// whole 8 goes lane by lane, then the canonical reduction — [`super::dot`]'s bits.
pub(super) fn dense(
    w: super::DenseRows<'_>,
    rows: usize,
    x: &[f32],
    t: usize,
    cols: usize,
    out: &mut [f32],
) {
    let (w, wlen, kind) = match w {
        super::DenseRows::F32(v) => (v.as_ptr().cast::<u8>(), v.len(), DENSE_F32),
        super::DenseRows::Bf16(v) => (v.as_ptr().cast::<u8>(), v.len(), DENSE_BF16),
        super::DenseRows::F16(v) => (v.as_ptr().cast::<u8>(), v.len(), DENSE_F16),
    };
    assert!(
        wlen >= rows * cols && x.len() >= t * cols && out.len() >= rows * t,
        "tiles::dense: slices too short"
    );
    for r in 0..rows {
        let mut j0 = 0;
        while j0 < t {
            let xn = (t - j0).min(super::FUSED_INPUTS);
            let xs = &x[j0 * cols..(j0 + xn) * cols];
            let o = &mut out[r * t + j0..r * t + j0 + xn];
            // SAFETY: AVX2 and FMA are available (the caller checked `available`), and
            // row `r` and the inputs lie inside the slices checked above.
            unsafe {
                match kind {
                    DENSE_BF16 => dense_chunk::<DENSE_BF16>(w, r, cols, xs, o),
                    DENSE_F16 => dense_chunk::<DENSE_F16>(w, r, cols, xs, o),
                    _ => dense_chunk::<DENSE_F32>(w, r, cols, xs, o),
                }
            }
            j0 += xn;
        }
    }
}

/// [`dense_row`] for the `out.len()` (1 to 4) input rows of `x`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dense_chunk<const KIND: u8>(
    w: *const u8,
    r: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
) {
    // SAFETY: (all arms) as the caller's.
    unsafe {
        match out.len() {
            1 => dense_row::<1, KIND>(w, r, cols, x, out),
            2 => dense_row::<2, KIND>(w, r, cols, x, out),
            3 => dense_row::<3, KIND>(w, r, cols, x, out),
            _ => dense_row::<4, KIND>(w, r, cols, x, out),
        }
    }
}

/// Weight row `r` (f32, bf16 or f16 as `KIND` says, at `w`) against `X` input rows (`x`:
/// `[X, cols]`) into `out[..X]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dense_row<const X: usize, const KIND: u8>(
    w: *const u8,
    r: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
) {
    use std::arch::x86_64::{
        __m128i, _mm_loadu_si128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_cvtph_ps,
        _mm256_slli_epi32, _mm256_storeu_ps,
    };
    let weight = |k: usize| -> f32 {
        // SAFETY: `k < cols`, inside row `r` (checked by the caller).
        unsafe {
            match KIND {
                DENSE_BF16 => f32::from_bits(u32::from(*w.cast::<u16>().add(r * cols + k)) << 16),
                DENSE_F16 => (*w.cast::<half::f16>().add(r * cols + k)).to_f32(),
                _ => *w.cast::<f32>().add(r * cols + k),
            }
        }
    };
    let mut acc = [_mm256_setzero_ps(); X];
    let body = cols / LANES * LANES;
    let xp = x.as_ptr();
    let mut k = 0;
    while k < body {
        // SAFETY: columns `k..k + 8` lie inside row `r` and inside each input row.
        unsafe {
            let wv = match KIND {
                DENSE_BF16 => {
                    let h = _mm_loadu_si128(w.cast::<u16>().add(r * cols + k).cast::<__m128i>());
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                }
                DENSE_F16 => {
                    _mm256_cvtph_ps(_mm_loadu_si128(w.cast::<u16>().add(r * cols + k).cast()))
                }
                _ => _mm256_loadu_ps(w.cast::<f32>().add(r * cols + k)),
            };
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(j * cols + k)), *a);
            }
        }
        k += LANES;
    }
    for (j, a) in acc.iter().enumerate() {
        out[j] = if body == cols {
            reduce_avx(*a)
        } else {
            let mut lanes = [0.0f32; LANES];
            // SAFETY: `lanes` holds eight f32.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *a) };
            for kk in body..cols {
                lanes[kk % LANES] = weight(kk).mul_add(x[j * cols + kk], lanes[kk % LANES]);
            }
            super::reduce(lanes)
        };
    }
}
