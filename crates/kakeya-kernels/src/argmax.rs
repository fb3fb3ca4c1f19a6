//! The greedy choice over a quantised matrix's products — the LM head's argmax — without
//! computing every exact product: a *certified* argmax.
//!
//! An approximate pass multiplies the int8 weights by the input rounded to int8 per group of 32
//! (integer dot products: with AVX2, 32 products in a few instructions; with AVX-512 VNNI, 64
//! in one `vpdpbusd`, through the int8 kernel's panels of [`crate::int8`] — against the exact
//! kernel's int→float rebuild and eight FMAs per eight products), and bounds each row's error:
//! with `x̂` the rounded input, `|w·x − w·x̂| ≤ ‖w‖₂·‖x − x̂‖₂` (Cauchy–Schwarz), plus the f32
//! rounding of both passes, bounded by `κ·‖w‖₂·(‖x‖₂ + ‖x̂‖₂)`. A row whose upper bound is below
//! the best lower bound cannot be the largest; the few that remain get their exact product —
//! the canonical-order f32 dot that [`QuantMatrix::matmul`] returns, bit for bit — and the
//! largest of those (first on ties) is the answer. So the result is always exactly the argmax of
//! `matmul`'s output; only its cost depends on how tight the bound is.
//!
//! Applies to symmetric formats with groups of 32 (Q8_0 — the tied head of the GGUF Gemmas —
//! Q4_0, Q5_0) on x86-64 with AVX2; elsewhere, and for non-finite inputs, [`QuantMatrix::argmax`]
//! returns `None` and the caller takes the exact path.

use rayon::prelude::*;

use crate::int8::PANEL;
use crate::quant::QuantMatrix;
use crate::tiles::{self, Layout, TILE};

/// Values per group this path handles.
const GROUP: usize = 32;
/// Weight rows per parallel task of the approximate pass (128 tasks for a 262 144-row head:
/// enough to balance two to sixteen threads, few enough that per-task costs vanish).
const ROWS_PER_TASK: usize = 2048;
/// Rows a task approximates at a time: their `[panel][t][PANEL]` products stay in L1 (8 KiB
/// at eight inputs) until their bounds are taken.
const ROWS_PER_CHUNK: usize = 256;
const _: () = assert!(
    ROWS_PER_CHUNK.is_multiple_of(crate::int8::PANEL)
        && ROWS_PER_TASK.is_multiple_of(ROWS_PER_CHUNK),
    "chunks are whole panels, tasks whole chunks"
);

/// An input row with more candidates than `rows / FULL_ROW_SHARE` takes every row's exact
/// product in one streamed pass instead.
const FULL_ROW_SHARE: usize = 16;
/// The unit roundoff of f32.
const U: f64 = f32::EPSILON as f64 / 2.0;

/// The certified argmax of `t` input rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Argmax {
    /// Per input row, the index of the largest exact product (first on ties).
    pub ids: Vec<u32>,
    /// Per input row, how many rows the bound could not exclude (their exact products were
    /// computed): 1 when the approximate pass alone decided.
    pub candidates: Vec<usize>,
}

/// Index of the largest value, first on ties (a NaN is never larger); `None` for an empty
/// slice. The greedy choice over a row of logits, everywhere in Kakeya.
pub fn first_max(values: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

/// Input rows rounded to int8 per group, with each row's error radius.
#[derive(Debug)]
pub(crate) struct Rounded {
    /// `[t, cols]` int8 values.
    pub q: Vec<i8>,
    /// `[t, gpr]` group scales (`x̂ = q · s`).
    pub s: Vec<f32>,
    /// `[t]`: the radius `C_j` such that `|approx_r − exact_r| ≤ ‖w_r‖₂ · C_j` for every row `r`
    /// (computed approximation and f32-computed exact product alike).
    pub radius: Vec<f32>,
}

/// Rounds `x` (`[t, cols]`, finite) to int8 per group of [`GROUP`] and bounds the error.
pub(crate) fn round_inputs(x: &[f32], t: usize, cols: usize) -> Rounded {
    let gpr = cols / GROUP;
    let mut q = vec![0i8; t * cols];
    let mut s = vec![0.0f32; t * gpr];
    let mut radius = Vec::with_capacity(t);
    // Rounding of the approximate pass (a product and an FMA per group and lane, the lane
    // sums) and of the exact one (cols/8 FMAs per lane, the lane sums), each relative to
    // ‖w‖·‖x̂‖ or ‖w‖·‖x‖, with room for the f32 bound arithmetic of the selection; doubled.
    let kappa = 4.0 * (2 * gpr + cols / 8 + 32) as f64 * U;
    for j in 0..t {
        let (mut e2, mut x2, mut h2) = (0.0f64, 0.0f64, 0.0f64);
        for g in 0..gpr {
            let xs = &x[j * cols + g * GROUP..j * cols + (g + 1) * GROUP];
            let qs = &mut q[j * cols + g * GROUP..j * cols + (g + 1) * GROUP];
            let sg = crate::int8::round_group(xs, qs);
            s[j * gpr + g] = sg;
            for (&v, &r) in xs.iter().zip(qs.iter()) {
                // Exact in f64: `sg · r` has at most 24 + 8 significant bits.
                let h = f64::from(sg) * f64::from(r);
                let e = f64::from(v) - h;
                e2 += e * e;
                x2 += f64::from(v) * f64::from(v);
                h2 += h * h;
            }
        }
        let c = e2.sqrt() * (1.0 + 1e-6) + kappa * (x2.sqrt() + h2.sqrt());
        radius.push((c as f32).next_up());
    }
    Rounded { q, s, radius }
}

/// `‖w_r‖₂` of every row, rounded up.
pub(crate) fn row_norms(m: &QuantMatrix) -> Vec<f32> {
    let (l, cols) = (m.layout(), m.cols());
    let mut out = Vec::with_capacity(m.rows());
    let mut w = vec![0.0f32; TILE * cols];
    for k in 0..m.rows().div_ceil(TILE) {
        l.rebuild(m.tile(k), &mut w);
        for r in 0..(m.rows() - k * TILE).min(TILE) {
            let n2: f64 = w[r * cols..(r + 1) * cols]
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum();
            out.push(((n2.sqrt() * (1.0 + 1e-6)) as f32).next_up());
        }
    }
    out
}

/// Whether `m` can take the certified path on this machine.
pub(crate) fn applies(m: &QuantMatrix) -> bool {
    let l = m.layout();
    l.group == GROUP && !l.asym && simd::available()
}

/// The approximate products `out[r · t + j] ≈ w_r · x_j` of the rows of `tiles` (whole tiles,
/// `rows` rows used) against the rounded inputs, with AVX2 (machines without AVX-512 VNNI).
fn approx_rows(l: Layout, tiles: &[u8], xr: &Rounded, t: usize, rows: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    simd::approx(l, tiles, &xr.q, &xr.s, t, rows, out);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (l, tiles, xr, t, rows, out);
}

/// One task's part of pass 1, as it goes: per input row, the best lower bound seen so far
/// (`low`) and the rows (index, upper bound) whose upper bound reached `low` when they were
/// looked at (`near`). `low` only rises and never exceeds the best lower bound over all rows,
/// so `near` holds every row of the task that reaches that final bound.
struct TaskBounds {
    low: Vec<f32>,
    near: Vec<Vec<(u32, f32)>>,
}

/// A task's reusable buffers (one set per worker, not per task).
struct Scratch {
    /// One chunk's approximations, `[panel][t][PANEL]`.
    buf: Vec<f32>,
    /// The AVX2 pass's products, `[row][t]`, before they go into `buf`.
    rows: Vec<f32>,
    /// Per input row, the lanes' best lower bounds in one chunk.
    lanes: Vec<[f32; PANEL]>,
    /// Per panel and input row, the largest upper bound in one chunk.
    panel_hi: Vec<f32>,
}

impl Scratch {
    fn new(t: usize) -> Self {
        let panels = ROWS_PER_CHUNK / PANEL;
        Self {
            buf: vec![0.0; panels * t * PANEL],
            rows: vec![0.0; ROWS_PER_CHUNK * t],
            lanes: vec![[f32::NEG_INFINITY; PANEL]; t],
            panel_hi: vec![f32::NEG_INFINITY; panels * t],
        }
    }
}

/// The best lower bound of each input row over every task so far, shared so that a task can
/// skip rows that an earlier task's bound already excludes: f32 bit patterns, only raised.
struct SharedLow(Vec<std::sync::atomic::AtomicU32>);

impl SharedLow {
    fn new(t: usize) -> Self {
        Self(
            (0..t)
                .map(|_| std::sync::atomic::AtomicU32::new(f32::NEG_INFINITY.to_bits()))
                .collect(),
        )
    }

    /// Raises the shared bounds to `low`'s where higher, and `low` to the shared ones.
    fn merge(&self, low: &mut [f32]) {
        use std::sync::atomic::Ordering::Relaxed;
        for (shared, l) in self.0.iter().zip(low) {
            let mut cur = shared.load(Relaxed);
            while f32::from_bits(cur) < *l {
                match shared.compare_exchange_weak(cur, l.to_bits(), Relaxed, Relaxed) {
                    Ok(_) => break,
                    Err(now) => cur = now,
                }
            }
            *l = l.max(f32::from_bits(shared.load(Relaxed)));
        }
    }
}

/// Pass 1's bounds of one chunk (rows `r0..r0 + norms.len()`) from its approximations in
/// `s.buf` (`[panel][t][PANEL]`), added to the task's `tb`. One sweep takes the lower bounds
/// and each panel's largest upper bound (sixteen rows at a time, with AVX2/FMA where the CPU
/// has them); only the panels that reach the best lower bound are then looked at row by row.
/// Both roundings of the bounds are within the radius' allowance, so either selects a
/// superset of the rows that can be the largest.
fn chunk_bounds(
    s: &mut Scratch,
    norms: &[f32],
    radius: &[f32],
    t: usize,
    r0: usize,
    tb: &mut TaskBounds,
) {
    let n = norms.len();
    let panels = n.div_ceil(PANEL);
    let panel_norms = |pi: usize| {
        let mut nr = [0.0f32; PANEL];
        let m = (n - pi * PANEL).min(PANEL);
        nr[..m].copy_from_slice(&norms[pi * PANEL..pi * PANEL + m]);
        (nr, m)
    };
    #[cfg(target_arch = "x86_64")]
    let fast = simd::available();
    #[cfg(not(target_arch = "x86_64"))]
    let fast = false;
    let buf = &s.buf[..panels * t * PANEL];
    s.lanes
        .iter_mut()
        .for_each(|l| *l = [f32::NEG_INFINITY; PANEL]);
    s.panel_hi[..panels * t].fill(f32::NEG_INFINITY);
    for (pi, pb) in buf.chunks_exact(t * PANEL).enumerate() {
        let (nr, m) = panel_norms(pi);
        let his = &mut s.panel_hi[pi * t..(pi + 1) * t];
        for (((blk, lj), &c), hi) in pb
            .chunks_exact(PANEL)
            .zip(&mut s.lanes)
            .zip(radius)
            .zip(his)
        {
            #[cfg(target_arch = "x86_64")]
            if fast && m == PANEL {
                *hi = simd::panel_bounds(blk, &nr, c, lj);
                continue;
            }
            let _ = fast;
            for l in 0..m {
                lj[l] = lj[l].max(blk[l] - nr[l] * c);
                *hi = hi.max(blk[l] + nr[l] * c);
            }
        }
    }
    for (lo, lanes) in tb.low.iter_mut().zip(&s.lanes) {
        *lo = lanes.iter().fold(*lo, |a, &b| a.max(b));
    }
    for (pi, pb) in buf.chunks_exact(t * PANEL).enumerate() {
        let (nr, m) = panel_norms(pi);
        for (j, (blk, &c)) in pb.chunks_exact(PANEL).zip(radius).enumerate() {
            let lo = tb.low[j];
            if s.panel_hi[pi * t + j] < lo {
                continue;
            }
            for l in 0..m {
                let hi = blk[l] + nr[l] * c;
                if hi >= lo {
                    tb.near[j].push(((r0 + pi * PANEL + l) as u32, hi));
                }
            }
        }
    }
}

/// [`approx_rows`] through the panels: rows `r0..r0 + rows` (`r0` a multiple of the panel).
#[cfg(test)]
fn approx_panel_rows(
    (p, pr): &(&crate::int8::Panels, crate::int8::Rounded),
    t: usize,
    r0: usize,
    rows: usize,
    out: &mut [f32],
) {
    let mut buf = vec![0.0f32; rows.div_ceil(PANEL) * t * PANEL];
    p.panel_products(pr, t, r0 / PANEL, &mut buf);
    for (i, o) in out.chunks_exact_mut(t).take(rows).enumerate() {
        let b = &buf[(i / PANEL) * t * PANEL + i % PANEL..];
        o.iter_mut()
            .enumerate()
            .for_each(|(j, v)| *v = b[j * PANEL]);
    }
}

impl QuantMatrix {
    /// For each of the `t` input rows of `x` (`[t, cols]`), the index of its largest product
    /// `w_r · x_j` exactly as [`Self::matmul`] computes them (first on ties), found by the
    /// certified two-pass search of [`crate::argmax`]. `None` when the path does not apply —
    /// another format, no AVX2, a non-finite input or product — and the caller must take the
    /// exact products instead.
    ///
    /// # Shapes
    /// - `x`: `[t, cols]` row-major → `t` ids
    pub fn argmax(&self, x: &[f32], t: usize) -> Option<Argmax> {
        self.certified_argmax(x, t, crate::int8::simd_available())
    }

    /// Whether [`Self::argmax`] beats the exact products for `t` input rows on this machine.
    /// From two rows it does everywhere. One row is another matter: its exact products are
    /// bound by their int→float rebuilds, not by memory. Through the int8 panels (AVX-512
    /// VNNI) the search costs less than the exact products; through AVX2's tiles it costs more,
    /// so one row keeps the exact products there (`qbench token_embd` measures both).
    pub fn argmax_pays(&self, t: usize) -> bool {
        t >= 2 || (t == 1 && crate::int8::simd_available())
    }

    /// [`Self::argmax`], its approximate pass through the int8 panels (`panels`, which needs
    /// AVX-512 VNNI for speed; the portable panel path gives the same bits) or AVX2's tiles.
    ///
    /// The panels' f32 rounding — a product and a fused add per group, summed in one
    /// sequence — is within the radius' allowance for the approximate pass.
    fn certified_argmax(&self, x: &[f32], t: usize, panels: bool) -> Option<Argmax> {
        assert_eq!(
            x.len(),
            t * self.cols(),
            "QuantMatrix::argmax: input has the wrong length"
        );
        if t == 0 || !applies(self) || x.iter().any(|v| !v.is_finite()) {
            return None;
        }
        let (l, rows, cols) = (self.layout(), self.rows(), self.cols());
        let xr = round_inputs(x, t, cols);
        let norms = self.norms();
        let panels = panels.then(|| {
            let p = self.panels();
            (p, p.rounded_from(&xr.q, &xr.s))
        });
        // Pass 1, per task of rows, a chunk at a time: approximate products, the best lower
        // bound of each input row, and the rows whose upper bound reaches the best lower bound
        // known when they are looked at (a superset of the rows that reach the final one,
        // which is at least as high).
        let shared = SharedLow::new(t);
        let tasks: Vec<TaskBounds> = (0..rows.div_ceil(ROWS_PER_TASK))
            .into_par_iter()
            .map_init(
                || Scratch::new(t),
                |sc, task| {
                    let mut tb = TaskBounds {
                        low: vec![f32::NEG_INFINITY; t],
                        near: vec![Vec::new(); t],
                    };
                    shared.merge(&mut tb.low);
                    let end = rows.min((task + 1) * ROWS_PER_TASK);
                    for r0 in (task * ROWS_PER_TASK..end).step_by(ROWS_PER_CHUNK) {
                        let n = (end - r0).min(ROWS_PER_CHUNK);
                        let buf = &mut sc.buf[..n.div_ceil(PANEL) * t * PANEL];
                        match &panels {
                            Some((p, pr)) => p.panel_products(pr, t, r0 / PANEL, buf),
                            None => {
                                let tiles = &self.data()
                                    [r0 / TILE * l.tile()..(r0 + n).div_ceil(TILE) * l.tile()];
                                let out = &mut sc.rows[..n * t];
                                approx_rows(l, tiles, &xr, t, n, out);
                                for (i, row) in out.chunks_exact(t).enumerate() {
                                    for (j, &a) in row.iter().enumerate() {
                                        buf[(i / PANEL) * t * PANEL + j * PANEL + i % PANEL] = a;
                                    }
                                }
                            }
                        }
                        chunk_bounds(sc, &norms[r0..r0 + n], &xr.radius, t, r0, &mut tb);
                        shared.merge(&mut tb.low);
                    }
                    tb
                },
            )
            .collect();
        let mut thr = vec![f32::NEG_INFINITY; t];
        for tb in &tasks {
            for (m, &v) in thr.iter_mut().zip(&tb.low) {
                *m = m.max(v);
            }
        }
        if thr.iter().any(|v| !v.is_finite()) {
            return None;
        }
        // Pass 2: the rows whose upper bound reaches the best lower bound, ascending.
        let cands: Vec<Vec<u32>> = (0..t)
            .map(|j| {
                tasks
                    .iter()
                    .flat_map(|tb| tb.near[j].iter())
                    .filter(|&&(_, hi)| hi >= thr[j])
                    .map(|&(r, _)| r)
                    .collect()
            })
            .collect();
        // Pass 3: the candidates' exact products (the matmul kernel's, so the same bits, a
        // tile of four rows at a time), the input rows in parallel; the largest, first on ties.
        let ids: Vec<Option<u32>> = cands
            .par_iter()
            .enumerate()
            .map(|(j, c)| self.best_candidate(&x[j * cols..(j + 1) * cols], c))
            .collect();
        let ids: Vec<u32> = ids.into_iter().collect::<Option<_>>()?;
        tracing::trace!(candidates = ?cands.iter().map(Vec::len).collect::<Vec<_>>(), "certified argmax");
        Some(Argmax {
            ids,
            candidates: cands.iter().map(Vec::len).collect(),
        })
    }

    /// Pass 3 of [`Self::certified_argmax`] for one input row `xj`: the exact products of its
    /// candidate rows `c` (ascending; the matmul kernel's, so the same bits, a tile of four
    /// rows at a time), and the largest, first on ties. `None` for a non-finite product.
    fn best_candidate(&self, xj: &[f32], c: &[u32]) -> Option<u32> {
        let (l, rows, cols) = (self.layout(), self.rows(), self.cols());
        if c.len() > rows / FULL_ROW_SHARE {
            // A flat row (the bound excludes little): one streamed pass over every
            // row is cheaper than this many scattered tiles. The same products.
            let all = self.matmul(xj, 1);
            if all.iter().any(|v| !v.is_finite()) {
                return None;
            }
            return first_max(&all).map(|b| b as u32);
        }
        let (mut loaded, mut four) = (usize::MAX, [0.0f32; TILE]);
        let mut w = Vec::new();
        let mut vals = Vec::with_capacity(c.len());
        for &r in c {
            let k = r as usize / TILE;
            if k != loaded {
                let n = (rows - k * TILE).min(TILE);
                if !tiles::tiles_fused(l, self.tile(k), xj, 1, n, &mut four) {
                    w.resize(TILE * cols, 0.0);
                    l.rebuild(self.tile(k), &mut w);
                    tiles::tile(&w, n, xj, 1, cols, &mut four);
                }
                loaded = k;
            }
            let v = four[r as usize % TILE];
            if !v.is_finite() {
                return None;
            }
            vals.push(v);
        }
        Some(c[first_max(&vals)?])
    }
}

#[cfg(target_arch = "x86_64")]
mod simd;

#[cfg(not(target_arch = "x86_64"))]
mod simd {
    pub(super) fn available() -> bool {
        false
    }
}

#[cfg(test)]
mod tests;
