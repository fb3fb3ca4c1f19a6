//! The dot-product kernel behind [`crate::QuantMatrix::matmul`]: the weight rows of a tile
//! against up to four input rows at a time.
//!
//! Every output follows one canonical order, whatever the tile: lane `l` of eight accumulates
//! `fma(w_k, x_k, acc_l)` over `k ≡ l (mod 8)` in ascending `k`, then the lanes are summed as
//! `((0+4)+(2+6)) + ((1+5)+(3+7))`. Tiling only decides which outputs share loads, so a row's
//! result is bit-identical whether it is decoded alone or verified in a block — the property
//! lossless speculative decoding rests on. On x86-64 with AVX2+FMA each weight is rebuilt in
//! a register from its int8 value and used for up to four input rows (explicit 8-wide FMAs;
//! more input rows are taken in chunks of four against each tile — of eight with AVX-512VL,
//! whose 32 registers hold their accumulators); elsewhere the
//! tile is rebuilt to f32 and a scalar loop with `f32::mul_add` computes the same bits
//! (`crate::quant`'s tests compare every path with [`dot`] bit for bit).

/// Accumulator lanes of the canonical order.
const LANES: usize = 8;

/// The canonical lane reduction.
#[inline(always)]
pub(crate) fn reduce(a: [f32; LANES]) -> f32 {
    let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (b[0] + b[2]) + (b[1] + b[3])
}

/// One dot product in the canonical order (the scalar path, and the tests' reference).
pub(crate) fn dot(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (k, (&a, &b)) in w.iter().zip(x).enumerate() {
        acc[k % LANES] = a.mul_add(b, acc[k % LANES]);
    }
    reduce(acc)
}

/// `out[r · t + j] = dot(w_r, x_j)` for the `rows` weight rows in `w` (`[rows, cols]`) and the
/// `t` input rows in `x` (`[t, cols]`): the portable path.
pub(crate) fn tile(w: &[f32], rows: usize, x: &[f32], t: usize, cols: usize, out: &mut [f32]) {
    debug_assert!(w.len() >= rows * cols && x.len() >= t * cols && out.len() >= rows * t);
    for r in 0..rows {
        for j in 0..t {
            out[r * t + j] = dot(&w[r * cols..(r + 1) * cols], &x[j * cols..(j + 1) * cols]);
        }
    }
}

/// Weight rows stored, and decoded, together.
pub(crate) const TILE: usize = 4;

/// How a quantised matrix lies in memory: tiles of [`TILE`] rows (the last one padded with
/// zero rows), each tile one sequential run of blocks, one block per group of `group` columns:
/// the tile's `TILE` f32 scales, then its `TILE` f32 offsets (asymmetric formats only), then
/// `TILE × group` int8 values, row by row. A decode step then reads one stream per tile instead
/// of `TILE` row streams and a scale stream, which the hardware prefetchers follow far better
/// (the 262 144-row head went from ≈ 12.7 to ≈ 9 ms per token on 2 Zen cores).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Values per group (16 or 32).
    pub group: usize,
    /// Groups per row.
    pub gpr: usize,
    /// Whether blocks carry offsets.
    pub asym: bool,
}

impl Layout {
    /// Bytes of a block's scales (and offsets).
    pub fn header(self) -> usize {
        4 * TILE * if self.asym { 2 } else { 1 }
    }

    /// Bytes of one block.
    pub fn block(self) -> usize {
        self.header() + TILE * self.group
    }

    /// Bytes of one tile.
    pub fn tile(self) -> usize {
        self.gpr * self.block()
    }

    /// Columns of a row.
    pub fn cols(self) -> usize {
        self.gpr * self.group
    }

    /// Writes row `i` of a tile from its values `q` (`[cols]`), scales `s` and offsets `o`
    /// (`[gpr]`; `o` ignored for symmetric formats).
    pub fn write_row(self, tile: &mut [u8], i: usize, q: &[i8], s: &[f32], o: &[f32]) {
        for g in 0..self.gpr {
            let b = &mut tile[g * self.block()..(g + 1) * self.block()];
            b[4 * i..4 * i + 4].copy_from_slice(&s[g].to_le_bytes());
            if self.asym {
                b[4 * (TILE + i)..4 * (TILE + i) + 4].copy_from_slice(&o[g].to_le_bytes());
            }
            let v = self.header() + i * self.group;
            for (d, &qv) in b[v..v + self.group]
                .iter_mut()
                .zip(&q[g * self.group..(g + 1) * self.group])
            {
                *d = qv as u8;
            }
        }
    }

    /// Reads row `i` of a tile back: its values `q` (`[cols]`), scales `s` and offsets `o`
    /// (`[gpr]`; zeros for symmetric formats) — the inverse of [`Self::write_row`].
    pub fn read_row(self, tile: &[u8], i: usize, q: &mut [i8], s: &mut [f32], o: &mut [f32]) {
        for g in 0..self.gpr {
            let b = &tile[g * self.block()..(g + 1) * self.block()];
            let f = |at: usize| f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            s[g] = f(4 * i);
            o[g] = if self.asym { f(4 * (TILE + i)) } else { 0.0 };
            let v = self.header() + i * self.group;
            for (d, &qv) in q[g * self.group..(g + 1) * self.group]
                .iter_mut()
                .zip(&b[v..v + self.group])
            {
                *d = qv as i8;
            }
        }
    }

    /// Rebuilds the tile's rows into `w` (`[TILE, cols]`): `w_j = q_j·s_g (+ o_g)`, exactly
    /// the f32 operations of [`crate::dequant`] (the values equal the dense model's bit for
    /// bit).
    #[inline(always)]
    pub fn rebuild(self, tile: &[u8], w: &mut [f32]) {
        let cols = self.cols();
        for g in 0..self.gpr {
            let b = &tile[g * self.block()..(g + 1) * self.block()];
            let f = |at: usize| f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            for i in 0..TILE {
                let sg = f(4 * i);
                let v = self.header() + i * self.group;
                let (vals, out) = (
                    &b[v..v + self.group],
                    &mut w[i * cols + g * self.group..i * cols + (g + 1) * self.group],
                );
                if self.asym {
                    let og = f(4 * (TILE + i));
                    for (wi, &qi) in out.iter_mut().zip(vals) {
                        *wi = qi as i8 as f32 * sg + og;
                    }
                } else {
                    for (wi, &qi) in out.iter_mut().zip(vals) {
                        *wi = qi as i8 as f32 * sg;
                    }
                }
            }
        }
    }
}

/// Asks the memory system for `bytes` ahead of use (the next tile while this one is
/// multiplied: a block product is long enough to hide the fetch). A hint only.
pub(crate) fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        for line in bytes.chunks(64) {
            // SAFETY: SSE is part of x86-64; a prefetch reads nothing and never faults.
            #[allow(unsafe_code)]
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast())
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Most input rows the fused kernel sums against a tile in one pass; more are taken in
/// chunks of this many per tile (the tile stays in L1 between chunks).
pub(crate) const FUSED_INPUTS: usize = 4;

/// `out[r · t + j] = dot(w_r, x_j)` for `rows` weight rows held in `tiles` (whole tiles, the
/// last one possibly partly used) and `t` input rows (`x`: `[t, cols]`), rebuilding each
/// weight in a register (`q·s (+ o)`, the dequantiser's f32 operations) and using it for up
/// to [`FUSED_INPUTS`] input rows at a time — each tile is streamed from memory once, then
/// re-read from L1 for the next chunk of inputs. `false` when no SIMD path applies (the caller
/// then rebuilds the rows and uses [`tile`]).
pub(crate) fn tiles_fused(
    l: Layout,
    tiles: &[u8],
    x: &[f32],
    t: usize,
    rows: usize,
    out: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if l.group.is_multiple_of(LANES) && t >= 1 && simd::available() {
        simd::tiles_fused(l, tiles, x, t, rows, out);
        return true;
    }
    let _ = (l, tiles, x, t, rows, out);
    false
}

/// Whether this CPU runs the AVX2/FMA paths (checked once).
pub(crate) fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return simd::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Streams in the bytes a few blocks ahead of the block at `b` (`block` bytes long) while it
/// is summed: the next blocks follow it, also across tiles. A prefetch never faults, so the
/// addresses need not exist.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_code)]
pub(crate) fn prefetch_ahead(b: *const u8, block: usize) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    /// Bytes ahead of the block being summed.
    const AHEAD: usize = 1024;
    let mut line = 0;
    while line < block {
        // SAFETY: SSE is part of x86-64; a prefetch reads nothing and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(AHEAD + line).cast()) };
        line += 64;
    }
}

/// The rows of a dense matrix, `[rows, cols]` row-major: f32, or bf16 (each widened to f32
/// exactly, by a 16-bit shift).
#[derive(Debug, Clone, Copy)]
pub(crate) enum DenseRows<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bf16 bit patterns.
    Bf16(&'a [u16]),
}

/// `out[r · t + j] = dot(w_r, x_j)` for the `rows` dense weight rows in `w` and the `t` input
/// rows in `x` (`[t, cols]`), in [`dot`]'s canonical order: a row's result is the same bits
/// whatever `t` — the property the quantised kernel gives GGUF blocks, for f32/bf16 weights
/// (HF checkpoints), where a GEMM's sums depend on how many rows it multiplies.
pub(crate) fn dense_tile(
    w: DenseRows<'_>,
    rows: usize,
    x: &[f32],
    t: usize,
    cols: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if simd::available() {
        simd::dense(w, rows, x, t, cols, out);
        return;
    }
    let mut widened = vec![0.0f32; cols];
    for r in 0..rows {
        let wr: &[f32] = match w {
            DenseRows::F32(v) => &v[r * cols..(r + 1) * cols],
            DenseRows::Bf16(v) => {
                for (d, &b) in widened.iter_mut().zip(&v[r * cols..(r + 1) * cols]) {
                    *d = f32::from_bits(u32::from(b) << 16);
                }
                &widened
            }
        };
        for j in 0..t {
            out[r * t + j] = dot(wr, &x[j * cols..(j + 1) * cols]);
        }
    }
}

/// Products laid out `[rows, t]` (per weight row) → `[t, rows]` (per input row).
pub(crate) fn by_input(by_row: Vec<f32>, rows: usize, t: usize) -> Vec<f32> {
    if t == 1 {
        return by_row;
    }
    let mut y = vec![0.0f32; t * rows];
    for r in 0..rows {
        for j in 0..t {
            y[j * rows + r] = by_row[r * t + j];
        }
    }
    y
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd {
    use std::arch::x86_64::{__m256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps};
    use std::sync::OnceLock;

    use super::{LANES, Layout, TILE};

    pub(super) fn available() -> bool {
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }

    /// [`super::reduce`] in registers: the same additions in the same order (lanes `l` and
    /// `l + 4` first, then `(0+2)` and `(1+3)` of those, then their sum), so the same bits.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn reduce_avx(v: __m256) -> f32 {
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
            "kernel::tiles_fused: slices too short"
        );
        // SAFETY: AVX2 and FMA are available (checked by the caller through `available`),
        // AVX-512VL where `wide_available` says so, and the lengths were checked above.
        unsafe {
            match (l.asym, t > super::FUSED_INPUTS && wide_available()) {
                (true, true) => fused_tiles_wide::<true>(l, tiles, x, t, rows, out),
                (false, true) => fused_tiles_wide::<false>(l, tiles, x, t, rows, out),
                (true, false) => fused_tiles_avx2::<true>(l, tiles, x, t, rows, out),
                (false, false) => fused_tiles_avx2::<false>(l, tiles, x, t, rows, out),
            }
        }
    }

    /// Whether AVX-512VL is there: its 32 vector registers hold the accumulators of eight
    /// input rows against two weight rows (the same 8-wide FMAs, so the same bits).
    fn wide_available() -> bool {
        static OK: OnceLock<bool> = OnceLock::new();
        *OK.get_or_init(|| {
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl")
        })
    }

    /// The tile loop of [`fused_tiles_avx2`] and [`fused_tiles_wide`]: every tile's rows
    /// against the `t` input rows in chunks of up to `$max` (the arms `$n` take shorter
    /// chunks), written to `out` (`[rows, t]`). A macro, not a function, so that each body is
    /// compiled with its own function's target features (a shared function was not inlined
    /// into the wide one, whose eight-row chunks then spilled registers: 2× slower).
    macro_rules! tiles_in_chunks {
        ([$($n:literal),*; $max:literal], $asym:ident, $l:ident, $tiles:ident, $x:ident, $t:ident, $rows:ident, $out:ident) => {{
            let cols = $l.cols();
            for k in 0..$rows.div_ceil(TILE) {
                let tile = &$tiles[k * $l.tile()..];
                let mut j0 = 0;
                while j0 < $t {
                    let xn = ($t - j0).min($max);
                    let xs = &$x[j0 * cols..(j0 + xn) * cols];
                    // SAFETY (all arms): tile `k` and the inputs are inside their slices
                    // (checked by the caller).
                    unsafe {
                        match xn {
                            $($n => chunk_avx2::<$n, $asym>($l, tile, k, xs, $rows, $out, $t, j0),)*
                            _ => chunk_avx2::<$max, $asym>($l, tile, k, xs, $rows, $out, $t, j0),
                        }
                    }
                    j0 += xn;
                }
            }
        }};
    }

    /// [`fused_tiles_avx2`] in chunks of up to eight input rows per tile: each
    /// weight is rebuilt half as often for blocks of 5–16 rows.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl")]
    unsafe fn fused_tiles_wide<const ASYM: bool>(
        l: Layout,
        tiles: &[u8],
        x: &[f32],
        t: usize,
        rows: usize,
        out: &mut [f32],
    ) {
        tiles_in_chunks!([1, 2, 3, 4, 5, 6, 7; 8], ASYM, l, tiles, x, t, rows, out)
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
        tiles_in_chunks!([1, 2, 3; 4], ASYM, l, tiles, x, t, rows, out)
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
        let mut put = |r0: usize, res: &[[f32; X]]| {
            for (i, r) in res.iter().enumerate() {
                let row = k * TILE + r0 + i;
                if row < rows {
                    out[row * t + j0..row * t + j0 + X].copy_from_slice(r);
                }
            }
        };
        // SAFETY (all calls): the tile and `x` are inside their slices (checked by the
        // caller), and the row ranges lie inside the tile.
        if X <= 2 {
            put(0, &unsafe { fused_avx2::<X, ASYM, TILE>(l, tile, 0, x) });
        } else {
            put(0, &unsafe { fused_avx2::<X, ASYM, HALF>(l, tile, 0, x) });
            if k * TILE + HALF < rows {
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
            _mm_loadl_epi64, _mm256_add_ps, _mm256_cvtepi8_epi32, _mm256_cvtepi32_ps,
            _mm256_mul_ps, _mm256_set1_ps,
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
                    ov[i] = _mm256_set1_ps(unsafe {
                        b.add(4 * (TILE + r)).cast::<f32>().read_unaligned()
                    });
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
        let (w, wlen, bf16) = match w {
            super::DenseRows::F32(v) => (v.as_ptr().cast::<u8>(), v.len(), false),
            super::DenseRows::Bf16(v) => (v.as_ptr().cast::<u8>(), v.len(), true),
        };
        assert!(
            wlen >= rows * cols && x.len() >= t * cols && out.len() >= rows * t,
            "kernel::dense: slices too short"
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
                    if bf16 {
                        dense_chunk::<true>(w, r, cols, xs, o);
                    } else {
                        dense_chunk::<false>(w, r, cols, xs, o);
                    }
                }
                j0 += xn;
            }
        }
    }

    /// [`dense_row`] for the `out.len()` (1 to 4) input rows of `x`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn dense_chunk<const BF16: bool>(
        w: *const u8,
        r: usize,
        cols: usize,
        x: &[f32],
        out: &mut [f32],
    ) {
        // SAFETY (all arms): as the caller's.
        unsafe {
            match out.len() {
                1 => dense_row::<1, BF16>(w, r, cols, x, out),
                2 => dense_row::<2, BF16>(w, r, cols, x, out),
                3 => dense_row::<3, BF16>(w, r, cols, x, out),
                _ => dense_row::<4, BF16>(w, r, cols, x, out),
            }
        }
    }

    /// Weight row `r` (f32, or bf16 when `BF16`, at `w`) against `X` input rows (`x`:
    /// `[X, cols]`) into `out[..X]`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn dense_row<const X: usize, const BF16: bool>(
        w: *const u8,
        r: usize,
        cols: usize,
        x: &[f32],
        out: &mut [f32],
    ) {
        use std::arch::x86_64::{
            __m128i, _mm_loadu_si128, _mm256_castsi256_ps, _mm256_cvtepu16_epi32,
            _mm256_slli_epi32, _mm256_storeu_ps,
        };
        let weight = |k: usize| -> f32 {
            // SAFETY: `k < cols`, inside row `r` (checked by the caller).
            unsafe {
                if BF16 {
                    f32::from_bits(u32::from(*w.cast::<u16>().add(r * cols + k)) << 16)
                } else {
                    *w.cast::<f32>().add(r * cols + k)
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
                let wv = if BF16 {
                    let h = _mm_loadu_si128(w.cast::<u16>().add(r * cols + k).cast::<__m128i>());
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                } else {
                    _mm256_loadu_ps(w.cast::<f32>().add(r * cols + k))
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
}
