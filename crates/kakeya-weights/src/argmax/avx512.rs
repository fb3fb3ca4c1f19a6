//! The approximate pass of the certified argmax with AVX-512 VNNI (Zen 4, Sapphire Rapids and
//! later): 64 int8 products per `vpdpbusd`, two weight rows at a time.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes, so the rounded input is taken as
//! `x̂ + 128` (unsigned) and the excess `128 · Σ w` — the same for every input — starts the
//! accumulator negated. Each 32-bit lane then holds exactly the sum of four products that the
//! AVX2 path's `vpmaddwd` lane holds, and the float steps (convert, scale, fused add, the lane
//! sum) are the AVX2 path's in the same order: the approximations are bit for bit the AVX2
//! path's (tested), so the error bound of [`super`] holds unchanged.

use std::sync::OnceLock;

use super::{GROUP, Layout, MAX_X, TileProducts};

/// Whether this machine has what the pass needs.
pub(super) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("fma")
    })
}

/// [`super::approx_rows`] with AVX-512 VNNI: per tile, the inputs in chunks of up to
/// [`MAX_X`], against the tile's four rows.
///
/// `qu`: `[t, cols]` rounded inputs plus 128 (unsigned); `s`: `[t, gpr]` their scales.
#[allow(unsafe_code)]
pub(super) fn approx(
    l: Layout,
    tiles: &[u8],
    qu: &[u8],
    s: &[f32],
    t: usize,
    rows: usize,
    out: &mut [f32],
) {
    let (cols, gpr) = (l.cols(), l.gpr);
    assert!(
        qu.len() >= t * cols && s.len() >= t * gpr && available(),
        "argmax::avx512::approx: bad inputs"
    );
    super::each_tile(l, tiles, t, rows, MAX_X, out, |tile, j0, xn, res| {
        let (qs, ss) = (
            &qu[j0 * cols..(j0 + xn) * cols],
            &s[j0 * gpr..(j0 + xn) * gpr],
        );
        // SAFETY (every arm): the features are available and every slice was checked above.
        unsafe {
            match xn {
                1 => tile_vnni::<1>(l, tile, qs, ss, res),
                2 => tile_vnni::<2>(l, tile, qs, ss, res),
                3 => tile_vnni::<3>(l, tile, qs, ss, res),
                4 => tile_vnni::<4>(l, tile, qs, ss, res),
                5 => tile_vnni::<5>(l, tile, qs, ss, res),
                6 => tile_vnni::<6>(l, tile, qs, ss, res),
                7 => tile_vnni::<7>(l, tile, qs, ss, res),
                _ => tile_vnni::<8>(l, tile, qs, ss, res),
            }
        }
    });
}

/// The tile's four rows against `X` inputs: `res[r][j] = Σ_g s_w · s_x · Σ_k q_w q_x`, the
/// inner sums in exact integers.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
#[allow(unsafe_code, clippy::needless_range_loop)]
unsafe fn tile_vnni<const X: usize>(
    l: Layout,
    tile: &[u8],
    qu: &[u8],
    s: &[f32],
    res: &mut TileProducts,
) {
    use std::arch::x86_64::{
        _mm_loadu_ps, _mm256_loadu_si256, _mm512_broadcast_i64x4, _mm512_castps128_ps512,
        _mm512_cvtepi32_ps, _mm512_dpbusd_epi32, _mm512_fmadd_ps, _mm512_loadu_si512,
        _mm512_mul_ps, _mm512_permutexvar_ps, _mm512_set1_epi8, _mm512_set1_ps, _mm512_setr_epi32,
        _mm512_setzero_ps, _mm512_setzero_si512, _mm512_storeu_ps, _mm512_sub_epi32,
    };
    let (cols, gpr, block, header) = (l.cols(), l.gpr, l.block(), l.header());
    let excess = _mm512_set1_epi8(-128); // 0x80: 128 as the unsigned operand
    let zero = _mm512_setzero_si512();
    let pick01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let pick23 = _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    // acc[p][j]: rows 2p (low half) and 2p + 1 (high half) against input j.
    let mut acc = [[_mm512_setzero_ps(); X]; 2];
    let tp = tile.as_ptr();
    for g in 0..gpr {
        // SAFETY: block `g` lies inside the tile (checked by the caller); prefetches never fault.
        let b = unsafe { tp.add(g * block) };
        crate::kernel::prefetch_ahead(b, block);
        // SAFETY: the header holds the four f32 scales, then the four rows' 32 values each.
        let (sw, w) = unsafe {
            (
                _mm512_castps128_ps512(_mm_loadu_ps(b.cast())),
                [
                    _mm512_loadu_si512(b.add(header).cast()),
                    _mm512_loadu_si512(b.add(header + 2 * GROUP).cast()),
                ],
            )
        };
        let swv = [
            _mm512_permutexvar_ps(pick01, sw),
            _mm512_permutexvar_ps(pick23, sw),
        ];
        let start = [
            _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, excess, w[0])),
            _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, excess, w[1])),
        ];
        for j in 0..X {
            // SAFETY: input `j < X` holds `cols` values and `gpr` scales.
            let (xv, sx) = unsafe {
                (
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        qu.as_ptr().add(j * cols + g * GROUP).cast(),
                    )),
                    _mm512_set1_ps(*s.get_unchecked(j * gpr + g)),
                )
            };
            for p in 0..2 {
                let prod = _mm512_dpbusd_epi32(start[p], xv, w[p]);
                let sc = _mm512_mul_ps(swv[p], sx);
                acc[p][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(prod), sc, acc[p][j]);
            }
        }
    }
    for (p, a) in acc.iter().enumerate() {
        for (j, aj) in a.iter().enumerate() {
            let mut lanes = [0.0f32; 16];
            // SAFETY: sixteen f32 into a sixteen-f32 array.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *aj) };
            res[2 * p][j] = lanes[..8].iter().sum();
            res[2 * p + 1][j] = lanes[8..].iter().sum();
        }
    }
}
