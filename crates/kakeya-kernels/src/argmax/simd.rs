//! The certified argmax's approximate pass with AVX2 (machines without AVX-512 VNNI; with it,
//! the int8 panels of [`crate::int8`] take the pass).
#![allow(unsafe_code)]

use std::sync::OnceLock;

use super::GROUP;
use crate::tiles::{Layout, TILE};

pub(super) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// [`super::approx_rows`] with AVX2: per tile, the inputs in chunks of up to two (four
/// weight rows at once) or four (two weight rows at once, two passes).
pub(super) fn approx(
    l: Layout,
    tiles: &[u8],
    q: &[i8],
    s: &[f32],
    t: usize,
    rows: usize,
    out: &mut [f32],
) {
    let (cols, gpr) = (l.cols(), l.gpr);
    assert!(
        q.len() >= t * cols && s.len() >= t * gpr && available(),
        "argmax::approx: bad inputs"
    );
    each_tile(l, tiles, t, rows, 4, out, |tile, j0, xn, res| {
        let (qs, ss) = (
            &q[j0 * cols..(j0 + xn) * cols],
            &s[j0 * gpr..(j0 + xn) * gpr],
        );
        let mut put = |r0: usize, part: &[[f32; 4]]| {
            for (i, r) in part.iter().enumerate() {
                res[r0 + i][..4].copy_from_slice(r);
            }
        };
        // SAFETY: (all calls) AVX2 and FMA are available and every slice was checked
        // above; row ranges lie inside the tile.
        unsafe {
            match xn {
                1 => put(0, &pad(tile_avx2::<1, 4>(l, tile, 0, qs, ss))),
                2 => put(0, &pad(tile_avx2::<2, 4>(l, tile, 0, qs, ss))),
                3 => {
                    put(0, &pad(tile_avx2::<3, 2>(l, tile, 0, qs, ss)));
                    put(2, &pad(tile_avx2::<3, 2>(l, tile, 2, qs, ss)));
                }
                _ => {
                    put(0, &pad(tile_avx2::<4, 2>(l, tile, 0, qs, ss)));
                    put(2, &pad(tile_avx2::<4, 2>(l, tile, 2, qs, ss)));
                }
            }
        }
    });
}

fn pad<const X: usize, const R: usize>(r: [[f32; X]; R]) -> [[f32; 4]; R] {
    r.map(|row| {
        let mut o = [0.0; 4];
        o[..X].copy_from_slice(&row);
        o
    })
}

/// The tile's rows `r0..r0 + R` against `X` rounded inputs (`q`: `[X, cols]`, `s`:
/// `[X, gpr]`): `Σ_g s_w · s_x · Σ_k q_w q_x`, the inner sums in exact integers.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)]
unsafe fn tile_avx2<const X: usize, const R: usize>(
    l: Layout,
    tile: &[u8],
    r0: usize,
    q: &[i8],
    s: &[f32],
) -> [[f32; X]; R] {
    use std::arch::x86_64::{
        _mm256_cvtepi32_ps, _mm256_fmadd_ps, _mm256_loadu_si256, _mm256_madd_epi16,
        _mm256_maddubs_epi16, _mm256_mul_ps, _mm256_set1_epi16, _mm256_set1_ps, _mm256_setzero_ps,
        _mm256_sign_epi8, _mm256_storeu_ps,
    };
    let (cols, gpr, block, header) = (l.cols(), l.gpr, l.block(), l.header());
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); X]; R];
    let tp = tile.as_ptr();
    for g in 0..gpr {
        // SAFETY: block `g` lies inside the tile; prefetches never fault.
        let b = unsafe { tp.add(g * block) };
        crate::tiles::prefetch_ahead(b, block);
        for i in 0..R {
            let r = r0 + i;
            // SAFETY: the header holds TILE f32 scales; the values (32 per row) follow it.
            let (sw, w) = unsafe {
                (
                    b.add(4 * r).cast::<f32>().read_unaligned(),
                    _mm256_loadu_si256(b.add(header + r * GROUP).cast()),
                )
            };
            let aw = _mm256_sign_epi8(w, w);
            let swv = _mm256_set1_ps(sw);
            for (j, a) in acc[i].iter_mut().enumerate() {
                // SAFETY: input `j < X` holds `cols` values and `gpr` scales.
                let (xv, sx) = unsafe {
                    (
                        _mm256_loadu_si256(q.as_ptr().add(j * cols + g * GROUP).cast()),
                        *s.get_unchecked(j * gpr + g),
                    )
                };
                // |w| · (x with w's sign): u8 × i8 pairs, at most 2·128·127 < 2¹⁵.
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, w)), ones);
                let sc = _mm256_mul_ps(swv, _mm256_set1_ps(sx));
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, *a);
            }
        }
    }
    let mut res = [[0.0f32; X]; R];
    for (r, a) in res.iter_mut().zip(&acc) {
        for (v, aj) in r.iter_mut().zip(a) {
            let mut lanes = [0.0f32; 8];
            // SAFETY: eight f32 into an eight-f32 array.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *aj) };
            *v = lanes.iter().sum();
        }
    }
    res
}

/// Inputs one tile pass takes at most.
const MAX_X: usize = 8;

/// One tile pass's products: `res[r][j]` for tile row `r` and input `j` of the chunk.
type TileProducts = [[f32; MAX_X]; TILE];

/// The AVX2 pass's loop: every tile of `tiles` (`rows` rows used) against the `t`
/// inputs in chunks of at most `chunk` (≤ [`MAX_X`]); `pass(tile, j0, xn, res)` fills the
/// products of inputs `j0..j0 + xn`, written to `out[r · t + j]`.
fn each_tile(
    l: Layout,
    tiles: &[u8],
    t: usize,
    rows: usize,
    chunk: usize,
    out: &mut [f32],
    mut pass: impl FnMut(&[u8], usize, usize, &mut TileProducts),
) {
    assert!(
        l.group == GROUP
            && !l.asym
            && tiles.len() >= rows.div_ceil(TILE) * l.tile()
            && out.len() >= rows * t
            && (1..=MAX_X).contains(&chunk),
        "argmax: bad layout or slices"
    );
    for k in 0..rows.div_ceil(TILE) {
        let tile = &tiles[k * l.tile()..(k + 1) * l.tile()];
        let mut j0 = 0;
        while j0 < t {
            let xn = (t - j0).min(chunk);
            let mut res = [[0.0f32; MAX_X]; TILE];
            pass(tile, j0, xn, &mut res);
            for (i, r) in res.iter().enumerate() {
                let row = k * TILE + i;
                if row < rows {
                    out[row * t + j0..row * t + j0 + xn].copy_from_slice(&r[..xn]);
                }
            }
            j0 += xn;
        }
    }
}

/// Pass 1 of [`super::chunk_bounds`] for one full panel and one input row with AVX2/FMA (the
/// caller checked [`available`]): `lanes = max(lanes, blk − nr·c)` lane by lane; returns the
/// panel's largest upper bound `max(blk + nr·c)`.
pub(super) fn panel_bounds(
    blk: &[f32],
    nr: &[f32; crate::int8::PANEL],
    c: f32,
    lanes: &mut [f32; crate::int8::PANEL],
) -> f32 {
    assert!(blk.len() >= crate::int8::PANEL && available());
    // SAFETY: AVX2 and FMA are available; every access is within the 16 values checked.
    unsafe { panel_bounds_avx2(blk, nr, c, lanes) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn panel_bounds_avx2(
    blk: &[f32],
    nr: &[f32; crate::int8::PANEL],
    c: f32,
    lanes: &mut [f32; crate::int8::PANEL],
) -> f32 {
    use std::arch::x86_64::*;
    let cv = _mm256_set1_ps(c);
    let mut hi = _mm256_set1_ps(f32::NEG_INFINITY);
    for h in 0..2 {
        // SAFETY: 8·h + 8 <= 16 values in each.
        unsafe {
            let b = _mm256_loadu_ps(blk.as_ptr().add(8 * h));
            let n = _mm256_loadu_ps(nr.as_ptr().add(8 * h));
            let l = _mm256_loadu_ps(lanes.as_ptr().add(8 * h));
            let lo = _mm256_fnmadd_ps(n, cv, b);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * h), _mm256_max_ps(l, lo));
            hi = _mm256_max_ps(hi, _mm256_fmadd_ps(n, cv, b));
        }
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(hi), _mm256_extractf128_ps::<1>(hi));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
}
