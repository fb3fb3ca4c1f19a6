//! Integer products for quantised weights: the `int8` kernel (`--kernel int8`).
//!
//! The exact kernel ([`crate::quant`]) rebuilds every weight to f32 and multiplies in f32:
//! memory-bound for one input row, but above four rows (verify blocks, batched streams,
//! prefill) its cost grows with the rows. This kernel instead rounds each input row to int8
//! per weight group (`x ≈ d·x̂`, `d = max|x|/127`, as llama.cpp's `Q8_0` activations), takes
//! the group's dot product `Σ q·x̂` in exact integers — 64 products per AVX-512 VNNI
//! `vpdpbusd` — and applies the group's weight scale, input scale and offset in f32:
//!
//! `y = Σ_g fma(s_g · d_g, Σ_k q_k x̂_k, ·)` then, for the asymmetric formats, `+ o_g · Σ_k x_k`
//! (the input's exact f32 group sum, so the offsets add no rounding of the input).
//!
//! The weights lie in panels of [`PANEL`] rows, interleaved four bytes at a time so that one
//! 32-bit lane of a 512-bit register accumulates one row: a group costs `group/4` integer
//! instructions and three float ones for sixteen rows and one input. A row's result depends
//! only on its own input row — the rounding is per row and the float steps run in one fixed
//! order — so it is the same however many rows run together (batch-invariant, what lossless
//! speculation needs), and the AVX2 and portable paths compute the same bits (tested).
//!
//! The numbers are not the exact kernel's: the input rounding moves a product by ≈ 1 % of the
//! outputs' RMS (0.8–1.2 % on the random matrices of the tests below), and the default model's
//! logits by up to 0.54 against transformers' f32 ones (the golden test), so greedy choices can
//! differ from the f32 model's at near-ties. Hence the exact kernel stays the default.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod x86;

use crate::quant::QuantMatrix;
use crate::tiles::TILE;

/// Weight rows per panel: one 32-bit lane each of a 512-bit register.
pub(crate) const PANEL: usize = 16;

/// Input rows per kernel pass: sixteen inputs' integer and float accumulators, 32 registers,
/// so LLVM keeps a few on the stack — still faster at 12–16 inputs than two passes of at most
/// eight (`qbench` on the head measures it).
const MAX_X: usize = 16;

/// Panels per parallel task.
const PANELS_PER_TASK: usize = 2;

/// A quantised matrix as int8-kernel panels.
#[derive(Debug, Clone)]
pub(crate) struct Panels {
    rows: usize,
    cols: usize,
    group: usize,
    gpr: usize,
    asym: bool,
    /// Added to every value to make it unsigned (`vpdpbusd` multiplies unsigned weights by
    /// signed inputs); taken back through each input group's start value.
    bias: i32,
    /// Per panel, per group `g`, one block: the [`PANEL`] rows' f32 scales, their f32 offsets
    /// (asymmetric formats only), then `[k < group/4][lane < PANEL][4]` values + bias (row
    /// `panel·16 + lane`, columns `g·group + 4k .. + 4`). A panel is one sequential stream.
    data: Vec<u8>,
}

/// Bytes of a block's header: scales, and offsets when asymmetric.
fn header(asym: bool) -> usize {
    4 * PANEL * if asym { 2 } else { 1 }
}

/// Bytes of one block (one group of one panel).
fn block(group: usize, asym: bool) -> usize {
    header(asym) + group * PANEL
}

/// Where value `e` of its group lies in a block, for row `lane` of the panel.
#[inline(always)]
fn value_at(e: usize, lane: usize, asym: bool) -> usize {
    header(asym) + (e / 4) * 4 * PANEL + lane * 4 + e % 4
}

/// Input rows rounded for the kernel.
pub(crate) struct Rounded {
    /// `[t, cols]` values `x̂`.
    q: Vec<i8>,
    /// `[t, gpr]` scales `d`.
    d: Vec<f32>,
    /// `[t, gpr]` `−bias · Σ x̂`: each group's integer accumulator starts here.
    start: Vec<i32>,
    /// `[t, gpr]` exact f32 sums of the group's inputs (the offsets' factor).
    sum: Vec<f32>,
}

/// Rounds one group of inputs to int8: `q = round(x / d)` with `d = max|x| / 127` (returned;
/// 0 and all-zero values for a zero group). The rounding of both the int8 kernel and the
/// certified argmax ([`crate::argmax`]).
pub(crate) fn round_group(xs: &[f32], q: &mut [i8]) -> f32 {
    let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    for (qv, &v) in q.iter_mut().zip(xs) {
        *qv = if d > 0.0 {
            (v / d).round().clamp(-127.0, 127.0) as i8
        } else {
            0
        };
    }
    d
}

impl Panels {
    /// Repacks `m`'s values, scales and offsets (the same numbers the exact kernel rebuilds
    /// its weights from).
    pub(crate) fn new(m: &QuantMatrix) -> Self {
        let l = m.layout();
        let (rows, cols, group, gpr) = (m.rows(), m.cols(), l.group, l.gpr);
        let panels = rows.div_ceil(PANEL);
        let (mut q, mut s, mut o) = (vec![0i8; cols], vec![0.0f32; gpr], vec![0.0f32; gpr]);
        let (asym, bb) = (l.asym, block(group, l.asym));
        let mut data = vec![0u8; panels * gpr * bb];
        let mut min = 0i8;
        for r in 0..rows {
            l.read_row(m.tile(r / TILE), r % TILE, &mut q, &mut s, &mut o);
            let (p, lane) = (r / PANEL, r % PANEL);
            for g in 0..gpr {
                let b = &mut data[(p * gpr + g) * bb..(p * gpr + g + 1) * bb];
                b[4 * lane..4 * lane + 4].copy_from_slice(&s[g].to_le_bytes());
                if asym {
                    b[4 * (PANEL + lane)..4 * (PANEL + lane) + 4]
                        .copy_from_slice(&o[g].to_le_bytes());
                }
                for e in 0..group {
                    let v = q[g * group + e];
                    min = min.min(v);
                    b[value_at(e, lane, asym)] = v as u8;
                }
            }
        }
        // The smallest bias that makes every value unsigned.
        let bias = -i32::from(min);
        for b in data.chunks_exact_mut(bb) {
            b[header(asym)..]
                .iter_mut()
                .for_each(|v| *v = (i32::from(*v as i8) + bias) as u8);
        }
        Self {
            rows,
            cols,
            group,
            gpr,
            asym,
            bias,
            data,
        }
    }

    /// Bytes held.
    pub(crate) fn nbytes(&self) -> usize {
        self.data.len()
    }

    /// Rounds `t` input rows (`x`: `[t, cols]`) to int8 per group.
    pub(crate) fn round(&self, x: &[f32], t: usize) -> Rounded {
        let (cols, group, gpr) = (self.cols, self.group, self.gpr);
        let mut r = Rounded {
            q: vec![0; t * cols],
            d: vec![0.0; t * gpr],
            start: vec![0; t * gpr],
            sum: vec![0.0; t * gpr],
        };
        for (i, xs) in x.chunks_exact(group).enumerate().take(t * gpr) {
            let finite = xs.iter().all(|v| v.is_finite());
            let qs = &mut r.q[i * group..(i + 1) * group];
            let d = if finite { round_group(xs, qs) } else { 0.0 };
            let qsum: i32 = qs.iter().map(|&v| i32::from(v)).sum();
            let sum: f32 = xs.iter().sum();
            // Non-finite inputs make every output of the row NaN, as the f32 products would.
            r.d[i] = if finite { d } else { f32::NAN };
            r.start[i] = -self.bias * qsum;
            r.sum[i] = sum;
        }
        r
    }

    /// Inputs rounded elsewhere (the certified argmax's [`crate::argmax`] rounding, the same
    /// rule): values `q` (`[t, cols]`) and scales `d` (`[t, gpr]`). Symmetric formats only
    /// (no input sums are kept for offsets).
    pub(crate) fn rounded_from(&self, q: &[i8], d: &[f32]) -> Rounded {
        assert!(
            !self.asym && q.len() == d.len() * self.group,
            "int8: bad rounded inputs"
        );
        let start = q
            .chunks_exact(self.group)
            .map(|g| -self.bias * g.iter().map(|&v| i32::from(v)).sum::<i32>())
            .collect();
        Rounded {
            q: q.to_vec(),
            d: d.to_vec(),
            start,
            sum: vec![0.0; d.len()],
        }
    }

    /// `y = x · Wᵀ`.
    ///
    /// # Shapes
    /// - `x`: `[t, cols]` row-major → `[t, rows]` row-major
    pub(crate) fn matmul(&self, x: &[f32], t: usize) -> Vec<f32> {
        assert_eq!(
            x.len(),
            t * self.cols,
            "int8 matmul: input has the wrong length"
        );
        self.matmul_rounded(&self.round(x, t), t)
    }

    /// [`Self::matmul`] of inputs already rounded.
    ///
    /// # Shapes
    /// - `xr`: `t` rounded rows → `[t, rows]` row-major
    pub(crate) fn matmul_rounded(&self, xr: &Rounded, t: usize) -> Vec<f32> {
        assert_eq!(
            xr.q.len(),
            t * self.cols,
            "int8 matmul: input has the wrong length"
        );
        let panels = self.rows.div_ceil(PANEL);
        // `[panel][t][lane]`: each task writes its panels' block.
        let mut by_panel = vec![0.0f32; panels * t * PANEL];
        by_panel
            .par_chunks_mut(PANELS_PER_TASK * t * PANEL)
            .enumerate()
            .for_each(|(task, out)| self.panel_products(xr, t, task * PANELS_PER_TASK, out));
        let mut y = vec![0.0f32; t * self.rows];
        for (p, block) in by_panel.chunks_exact(t * PANEL).enumerate() {
            let n = (self.rows - p * PANEL).min(PANEL);
            for j in 0..t {
                y[j * self.rows + p * PANEL..j * self.rows + p * PANEL + n]
                    .copy_from_slice(&block[j * PANEL..j * PANEL + n]);
            }
        }
        y
    }

    /// The products of the panels from `p0` (as many as `out` holds, `[panel][t][PANEL]`)
    /// against the `t` rounded inputs, on the calling thread.
    pub(crate) fn panel_products(&self, xr: &Rounded, t: usize, p0: usize, out: &mut [f32]) {
        for (i, o) in out.chunks_exact_mut(t * PANEL).enumerate() {
            let p = p0 + i;
            let mut j0 = 0;
            while j0 < t {
                let xn = (t - j0).min(MAX_X);
                let res = &mut o[j0 * PANEL..(j0 + xn) * PANEL];
                if !simd_panel(self, p, xr, j0, xn, res) {
                    self.panel_portable(p, xr, j0, xn, res);
                }
                j0 += xn;
            }
        }
    }

    /// Panel `p` against inputs `j0..j0 + xn`, lane by lane: `out` is `[xn][PANEL]`. The same
    /// integer sums and the same float steps, in the same order, as the VNNI path.
    fn panel_portable(&self, p: usize, xr: &Rounded, j0: usize, xn: usize, out: &mut [f32]) {
        let (cols, group, gpr, asym) = (self.cols, self.group, self.gpr, self.asym);
        let bb = block(group, asym);
        let f32_at =
            |b: &[u8], at: usize| f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        for j in 0..xn {
            let jj = j0 + j;
            for lane in 0..PANEL {
                let mut f = 0.0f32;
                for g in 0..gpr {
                    let b = &self.data[(p * gpr + g) * bb..(p * gpr + g + 1) * bb];
                    let mut acc = xr.start[jj * gpr + g];
                    for e in 0..group {
                        acc += i32::from(b[value_at(e, lane, asym)])
                            * i32::from(xr.q[jj * cols + g * group + e]);
                    }
                    let sc = f32_at(b, 4 * lane) * xr.d[jj * gpr + g];
                    f = (acc as f32).mul_add(sc, f);
                    if asym {
                        f = f32_at(b, 4 * (PANEL + lane)).mul_add(xr.sum[jj * gpr + g], f);
                    }
                }
                out[j * PANEL + lane] = f;
            }
        }
    }
}

/// Whether this machine has AVX-512 VNNI (Zen 4, Sapphire Rapids and later), the int8
/// kernel's fastest path; AVX2 comes next, then the portable path, all giving the same bits.
pub(crate) fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return x86::vnni_available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Panel `p` against inputs `j0..j0 + xn` on the fastest SIMD path this machine has; `false`
/// (nothing written) where it has none.
fn simd_panel(m: &Panels, p: usize, xr: &Rounded, j0: usize, xn: usize, out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    return x86::panel(m, p, xr, j0, xn, out);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (m, p, xr, j0, xn, out);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dequant::{GgmlType, dequantize};
    use crate::quant::tests::blocks;

    fn inputs(t: usize, cols: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..t * cols)
            .map(|i| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let v = (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                // A few large channels, as real activations have.
                if i % 97 == 5 { 20.0 * v } else { v }
            })
            .collect()
    }

    const TYPES: [GgmlType; 7] = [
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
    ];

    #[test]
    fn every_path_and_every_row_count_gives_the_same_bits() {
        // 40 rows: two whole panels and a partial one.
        let (rows, cols) = (40, 512);
        for ty in TYPES {
            let m = QuantMatrix::new(ty, rows, cols, &blocks(ty, rows, cols)).unwrap();
            let p = Panels::new(&m);
            let x = inputs(16, cols, 7);
            let all = p.matmul(&x, 16);
            for t in [1, 3, 8, 9, 16] {
                // Row j of a t-row product equals row j of the 16-row one, bit for bit.
                let part = p.matmul(&x[..t * cols], t);
                assert!(
                    part.iter()
                        .zip(&all)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty:?}: {t} rows differ from 16"
                );
            }
            // The portable path gives the SIMD path's bits.
            let xr = p.round(&x, 16);
            for panel in 0..rows.div_ceil(PANEL) {
                let mut a = vec![0.0f32; 8 * PANEL];
                p.panel_portable(panel, &xr, 8, 8, &mut a);
                // The AVX2 path too, where the machine has it (whether or not it has VNNI).
                #[cfg(target_arch = "x86_64")]
                let avx2 = {
                    let mut b = vec![f32::NAN; 8 * PANEL];
                    x86::avx2_panel(&p, panel, &xr, 8, 8, &mut b).then_some(b)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let avx2: Option<Vec<f32>> = None;
                let n = (rows - panel * PANEL).min(PANEL);
                for j in 0..8 {
                    for r in 0..n {
                        let v = all[(8 + j) * rows + panel * PANEL + r];
                        assert_eq!(
                            a[j * PANEL + r].to_bits(),
                            v.to_bits(),
                            "{ty:?} panel {panel}"
                        );
                        if let Some(b) = &avx2 {
                            assert_eq!(
                                b[j * PANEL + r].to_bits(),
                                v.to_bits(),
                                "{ty:?} panel {panel}, AVX2"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn products_are_close_to_the_exact_ones() {
        // Reference: the dequantised weights (`crate::dequant`, checked against gguf-py) times
        // the f32 inputs, in f64. Tolerance: 2 % of the RMS output per matrix and 8 % at worst
        // per output — int8 inputs carry ≈ 0.4 % relative error per value.
        let (rows, cols) = (64, 1024);
        for ty in TYPES {
            let data = blocks(ty, rows, cols);
            let m = QuantMatrix::new(ty, rows, cols, &data).unwrap();
            let dense = dequantize(ty, &data, rows * cols);
            let t = 4;
            let x = inputs(t, cols, 3);
            let y = Panels::new(&m).matmul(&x, t);
            let (mut e2, mut y2, mut worst) = (0.0f64, 0.0f64, 0.0f64);
            let mut exact = vec![0.0f64; t * rows];
            for j in 0..t {
                for r in 0..rows {
                    exact[j * rows + r] = (0..cols)
                        .map(|c| f64::from(dense[r * cols + c]) * f64::from(x[j * cols + c]))
                        .sum();
                    y2 += exact[j * rows + r].powi(2);
                }
            }
            let rms = (y2 / (t * rows) as f64).sqrt();
            for (a, b) in y.iter().zip(&exact) {
                let e = f64::from(*a) - b;
                e2 += e * e;
                worst = worst.max(e.abs() / rms);
            }
            let rel = (e2 / y2).sqrt();
            assert!(
                rel < 0.02 && worst < 0.08,
                "{ty:?}: relative error {rel:.4}, worst {worst:.4}"
            );
        }
    }

    #[test]
    fn zero_and_non_finite_inputs() {
        let (rows, cols) = (16, 256);
        let ty = GgmlType::Q4K;
        let m = QuantMatrix::new(ty, rows, cols, &blocks(ty, rows, cols)).unwrap();
        let p = Panels::new(&m);
        assert!(p.matmul(&vec![0.0; cols], 1).iter().all(|&v| v == 0.0));
        let mut x = inputs(2, cols, 1);
        x[3] = f32::INFINITY;
        let y = p.matmul(&x, 2);
        assert!(
            y[..rows].iter().all(|v| v.is_nan()),
            "the row with an infinity is NaN"
        );
        assert!(
            y[rows..].iter().all(|v| v.is_finite()),
            "the other row is untouched"
        );
    }
}
