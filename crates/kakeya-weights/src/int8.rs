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
//! speculation needs), and the portable path computes the same bits (tested).
//!
//! The numbers are not the exact kernel's: the input rounding moves a product by ≈ 1 % of the
//! outputs' RMS (0.8–1.2 % on the random matrices of the tests below), and the default model's
//! logits by up to 0.54 against transformers' f32 ones (the golden test), so greedy choices can
//! differ from the f32 model's at near-ties. Hence the exact kernel stays the default.

use rayon::prelude::*;

use crate::kernel::TILE;
use crate::quant::QuantMatrix;

/// Weight rows per panel: one 32-bit lane each of a 512-bit register.
pub(crate) const PANEL: usize = 16;

/// Input rows per kernel pass: sixteen inputs' integer and float accumulators, 32 registers,
/// so LLVM keeps a few on the stack — still 10–25 % faster at 12–16 inputs than two passes of
/// at most eight (the head's certified argmax, Zen 5: 12 rows 6.4 → 4.8–5.1 ms, 16 rows 7.9 →
/// 6.9–7.2 ms on two threads).
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
        let vnni = simd_available();
        for (i, o) in out.chunks_exact_mut(t * PANEL).enumerate() {
            let p = p0 + i;
            let mut j0 = 0;
            while j0 < t {
                let xn = (t - j0).min(MAX_X);
                let res = &mut o[j0 * PANEL..(j0 + xn) * PANEL];
                if vnni {
                    simd_panel(self, p, xr, j0, xn, res);
                } else {
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

/// Whether this machine has AVX-512 VNNI (Zen 4, Sapphire Rapids and later), which the fast
/// path needs; elsewhere the portable path computes the same bits.
#[cfg(target_arch = "x86_64")]
pub(crate) fn simd_available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("fma")
    })
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn simd_available() -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
fn simd_panel(m: &Panels, p: usize, xr: &Rounded, j0: usize, xn: usize, out: &mut [f32]) {
    m.panel_portable(p, xr, j0, xn, out)
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
fn simd_panel(m: &Panels, p: usize, xr: &Rounded, j0: usize, xn: usize, out: &mut [f32]) {
    assert!(
        (p + 1) * m.gpr * block(m.group, m.asym) <= m.data.len()
            && (j0 + xn) * m.cols <= xr.q.len()
            && out.len() >= xn * PANEL
            && matches!(m.group, 16 | 32)
            && simd_available(),
        "int8::simd_panel: bad inputs"
    );
    // SAFETY: the features are available and the slices were checked above.
    unsafe {
        match (m.group, m.asym) {
            (32, false) => by_inputs::<32, false>(m, p, xr, j0, xn, out),
            (32, true) => by_inputs::<32, true>(m, p, xr, j0, xn, out),
            (16, false) => by_inputs::<16, false>(m, p, xr, j0, xn, out),
            _ => by_inputs::<16, true>(m, p, xr, j0, xn, out),
        }
    }
}

/// [`vnni`] for `xn` inputs.
///
/// # Safety
/// The CPU has AVX-512 VNNI and the slices were checked by [`simd_panel`].
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
unsafe fn by_inputs<const G: usize, const ASYM: bool>(
    m: &Panels,
    p: usize,
    xr: &Rounded,
    j0: usize,
    xn: usize,
    out: &mut [f32],
) {
    // SAFETY (every arm): the caller's guarantees.
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
#[cfg(target_arch = "x86_64")]
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
            crate::kernel::prefetch_ahead(b, bb);
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
                let n = (rows - panel * PANEL).min(PANEL);
                for j in 0..8 {
                    for r in 0..n {
                        let v = all[(8 + j) * rows + panel * PANEL + r];
                        assert_eq!(
                            a[j * PANEL + r].to_bits(),
                            v.to_bits(),
                            "{ty:?} panel {panel}"
                        );
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
