//! The dot-product kernel behind [`crate::QuantMatrix::matmul`]: the weight rows of a tile
//! against up to four input rows at a time.
//!
//! Every output follows one canonical order, whatever the tile: lane `l` of eight accumulates
//! `fma(w_k, x_k, acc_l)` over `k ≡ l (mod 8)` in ascending `k`, then the lanes are summed as
//! `((0+4)+(2+6)) + ((1+5)+(3+7))`. Tiling only decides which outputs share loads, so a row's
//! result is bit-identical whether it is decoded alone or verified in a block — the property
//! lossless speculative decoding rests on. On x86-64 with AVX2+FMA each weight is rebuilt in
//! a register from its int8 value and used for up to four input rows (explicit 8-wide FMAs;
//! more input rows are taken in chunks of four against each tile); with AVX-512F and VL two
//! weight rows share each 16-wide register, against up to eight input rows ([`zmm`]);
//! elsewhere the tile is rebuilt to f32 and a scalar loop with `f32::mul_add` computes the
//! same bits (`crate::quant`'s tests compare every path with [`dot`] bit for bit).

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
/// of `TILE` row streams and a scale stream, which the hardware prefetchers follow far better.
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

/// Most input rows the AVX2 fused kernel sums against a tile in one pass; more are taken in
/// chunks of this many per tile (the tile stays in L1 between chunks). The AVX-512 path,
/// with twice the registers, takes eight (`zmm::INPUTS`).
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

/// The rows of a dense matrix, `[rows, cols]` row-major: f32, or bf16 or f16 (each widened to
/// f32 exactly: bf16 by a 16-bit shift, f16 by `vcvtph2ps` or its scalar equivalent).
#[derive(Debug, Clone, Copy)]
pub(crate) enum DenseRows<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bf16 bit patterns.
    Bf16(&'a [u16]),
    /// f16 values.
    F16(&'a [half::f16]),
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
            DenseRows::F16(v) => {
                for (d, &b) in widened.iter_mut().zip(&v[r * cols..(r + 1) * cols]) {
                    *d = b.to_f32();
                }
                &widened
            }
        };
        for j in 0..t {
            out[r * t + j] = dot(wr, &x[j * cols..(j + 1) * cols]);
        }
    }
}

/// Where a fused tile's results go: rows `k · TILE + r0 ..` of tile `k` (those below
/// `rows`), columns `j0..` of `out` (`[rows, t]`) — for the AVX2 and the AVX-512 paths.
#[cfg(target_arch = "x86_64")]
struct TileOut {
    k: usize,
    rows: usize,
    t: usize,
    j0: usize,
}

#[cfg(target_arch = "x86_64")]
impl TileOut {
    /// Writes `res[i][..X]` (row `r0 + i` of the tile against `X` inputs).
    fn put<const X: usize>(&self, r0: usize, res: &[[f32; X]], out: &mut [f32]) {
        for (i, r) in res.iter().enumerate() {
            let row = self.k * TILE + r0 + i;
            if row < self.rows {
                let at = row * self.t + self.j0;
                out[at..at + X].copy_from_slice(r);
            }
        }
    }
}

/// Fills `y` (`[t, rows]`, by input row) from parallel tasks of `per_task` weight rows:
/// `task(r0, block)` writes the products of rows `r0..r0 + n` as `block` (`[n, t]`, by weight
/// row, the kernels' layout), and the task itself then puts them in their columns of `y` —
/// no serial transpose after the parallel part.
pub(crate) fn by_input_tasks(
    rows: usize,
    t: usize,
    per_task: usize,
    y: &mut [f32],
    task: impl Fn(usize, &mut [f32]) + Sync,
) {
    by_input_tasks_many(&mut [y], &[rows], t, per_task, |_, r0, block| {
        task(r0, block)
    });
}

/// [`by_input_tasks`] for several matrices against the same `t` inputs in one parallel loop
/// (one wake-up of the pool instead of one per matrix): output `m` (`ys[m]`, `[t, rows[m]]`)
/// is filled by `task(m, r0, block)`.
pub(crate) fn by_input_tasks_many(
    ys: &mut [&mut [f32]],
    rows: &[usize],
    t: usize,
    per_task: usize,
    task: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    use rayon::prelude::*;
    assert!(
        ys.len() == rows.len() && ys.iter().zip(rows).all(|(y, &r)| y.len() == r * t),
        "tiles::by_input_tasks: an output has the wrong length"
    );
    let outs: Vec<Columns> = ys.iter_mut().map(|y| Columns(y.as_mut_ptr())).collect();
    let tasks: Vec<(usize, usize)> = rows
        .iter()
        .enumerate()
        .flat_map(|(m, &r)| (0..r).step_by(per_task).map(move |r0| (m, r0)))
        .collect();
    tasks.par_iter().for_each(|&(m, r0)| {
        let (out, n) = (&outs[m], (rows[m] - r0).min(per_task));
        if t == 1 {
            // One input: the two layouts are the same.
            // SAFETY: `r0 + n <= rows[m] = ys[m].len()`, and the range belongs to this task
            // alone (the tasks' row ranges of one output are disjoint).
            #[allow(unsafe_code)]
            let dst = unsafe { std::slice::from_raw_parts_mut(out.at(r0), n) };
            task(m, r0, dst);
            return;
        }
        // On the stack when small (a decode step's tasks), else on the heap.
        let mut stack = [0.0f32; 512];
        let mut heap = Vec::new();
        let block = if n * t <= stack.len() {
            &mut stack[..n * t]
        } else {
            heap.resize(n * t, 0.0);
            &mut heap[..]
        };
        task(m, r0, block);
        for j in 0..t {
            // SAFETY: `j · rows + r0 + n <= t · rows = ys[m].len()`, and the columns
            // `r0..r0 + n` of input row `j` belong to this task alone (the tasks' row ranges
            // of one output are disjoint), so no other reference to them exists while this
            // one lives.
            #[allow(unsafe_code)]
            let dst = unsafe { std::slice::from_raw_parts_mut(out.at(j * rows[m] + r0), n) };
            for (d, &v) in dst.iter_mut().zip(block[j..].iter().step_by(t)) {
                *d = v;
            }
        }
    });
}

/// An output of [`by_input_tasks_many`], shared by tasks that write disjoint columns of it.
struct Columns(*mut f32);

impl Columns {
    /// The address `i` values in (within the output: the caller's to check).
    fn at(&self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

// SAFETY: the tasks only write disjoint ranges through it (see `by_input_tasks_many`), and
// the output outlives the parallel loop that borrows it.
#[allow(unsafe_code)]
unsafe impl Sync for Columns {}

/// Tests only: the AVX2 path even where AVX-512F is there, so that both are tested on any
/// machine. Both give the same bits, so tests running meanwhile are unaffected.
#[cfg(test)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
static AVX2_FORCED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Tests only: takes the AVX2 path of [`tiles_fused`] (`true`) or the best one (`false`).
#[cfg(test)]
pub(crate) fn force_avx2(on: bool) {
    AVX2_FORCED.store(on, std::sync::atomic::Ordering::SeqCst);
}

/// Whether a test asked for the AVX2 path.
#[cfg(target_arch = "x86_64")]
fn avx2_forced() -> bool {
    #[cfg(test)]
    return AVX2_FORCED.load(std::sync::atomic::Ordering::SeqCst);
    #[cfg(not(test))]
    false
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod zmm;
