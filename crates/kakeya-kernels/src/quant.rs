//! Matrix products on quantised weights, for CPU decoding.
//!
//! A decode step reads every weight once: held as f32 the default model moves ~1.07 GB per
//! token. [`QuantMatrix`] repacks a GGML-quantised matrix into int8 values with one f32 scale
//! (and, for the asymmetric formats, one f32 offset) per group of 16 or 32 — ~1.15 bytes per
//! weight — taken straight from the block fields, stored in tiles of four rows that a decode
//! step reads as one stream ([`crate::tiles::Layout`]). Each weight is rebuilt as `q·s` (`+ o`) with
//! exactly the f32 operations of [`crate::dequant`], so the weights are bit-identical to the
//! dense model's; the dot products follow the canonical order of [`crate::tiles`] (8 lanes,
//! FMA), which makes a row's result independent of how many input rows run together. Up to
//! four input rows (decoding, short verify blocks): weights are rebuilt in registers, a tile
//! (four rows) at a time, and used for every input row, so each tile is streamed once. More
//! (longer verify blocks, batched capture): the tile stays in L1 while it is summed against
//! the inputs four at a time. Inputs of more than [`INPUTS_PER_PASS`] rows (prefill) go in
//! passes of that many, so that a pass's inputs stay in L2. Rows are split across the rayon
//! pool, each task putting its products straight into the output's `[t, rows]` layout
//! ([`tiles::by_input_tasks_many`]).

use crate::dequant::GgmlType;
use crate::tiles::{self, Layout, TILE};

/// Rows of output per parallel task.
const ROWS_PER_TASK: usize = 32;
/// Most input rows one pass over the weights takes: longer inputs go in passes of this
/// many, so that a pass's inputs stay in L2 while every tile streams past them.
const INPUTS_PER_PASS: usize = 16;

/// A `[rows, cols]` weight as int8 groups with f32 scales (and offsets), in tiles of
/// [`TILE`] rows ([`Layout`]).
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    layout: Layout,
    /// `rows.div_ceil(TILE)` tiles of `layout.tile()` bytes.
    data: Vec<u8>,
    /// `‖w_r‖₂` per row, rounded up: made on the first [`Self::argmax`].
    norms: std::sync::OnceLock<Vec<f32>>,
    /// The int8 kernel's panels: made on the first [`Self::matmul_int8`].
    int8: std::sync::OnceLock<crate::int8::Panels>,
}

fn f16(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Unpacks one block into values `q`, group scales `s` and offsets `o` (when asymmetric), such
/// that the dequantiser's value of element `j` of group `g` is `q[j]·s[g] + o[g]` (as f32 ops).
fn unpack_block(ty: GgmlType, b: &[u8], q: &mut [i8], s: &mut [f32], o: &mut [f32]) {
    let nib = |qs: &[u8], j: usize| {
        if j < 16 {
            qs[j] & 0x0f
        } else {
            qs[j - 16] >> 4
        }
    };
    let high5 = |qh: u32, j: usize| (((qh >> j) & 1) << 4) as u8;
    match ty {
        GgmlType::Q8_0 => {
            s[0] = f16(b, 0);
            q.iter_mut().zip(&b[2..34]).for_each(|(q, &v)| *q = v as i8);
        }
        GgmlType::Q4_0 => {
            s[0] = f16(b, 0);
            (0..32).for_each(|j| q[j] = nib(&b[2..18], j) as i8 - 8);
        }
        GgmlType::Q4_1 => {
            (s[0], o[0]) = (f16(b, 0), f16(b, 2));
            (0..32).for_each(|j| q[j] = nib(&b[4..20], j) as i8);
        }
        GgmlType::Q5_0 => {
            s[0] = f16(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            (0..32).for_each(|j| q[j] = (nib(&b[6..22], j) | high5(qh, j)) as i8 - 16);
        }
        GgmlType::Q5_1 => {
            (s[0], o[0]) = (f16(b, 0), f16(b, 2));
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            (0..32).for_each(|j| q[j] = (nib(&b[8..24], j) | high5(qh, j)) as i8);
        }
        GgmlType::Q4K | GgmlType::Q5K => {
            let (d, dmin) = (f16(b, 0), f16(b, 2));
            let scales = &b[4..16];
            for g in 0..8 {
                let (sc, m) = crate::dequant::k_scale_min(g, scales);
                s[g] = d * sc as f32;
                o[g] = -(dmin * m as f32);
            }
            for (chunk, qc) in q.chunks_mut(64).enumerate() {
                for l in 0..32 {
                    let (lo, hi) = match ty {
                        GgmlType::Q4K => {
                            let v = b[16 + 32 * chunk + l];
                            (v & 0x0f, v >> 4)
                        }
                        _ => {
                            let v = b[48 + 32 * chunk + l];
                            let h = b[16 + l];
                            let h0 = if h & (1 << (2 * chunk)) != 0 { 16 } else { 0 };
                            let h1 = if h & (2 << (2 * chunk)) != 0 { 16 } else { 0 };
                            ((v & 0x0f) + h0, (v >> 4) + h1)
                        }
                    };
                    qc[l] = lo as i8;
                    qc[l + 32] = hi as i8;
                }
            }
        }
        GgmlType::Q6K => {
            let d = f16(b, 208);
            for half in 0..2 {
                let ql = &b[64 * half..64 * half + 64];
                let qh = &b[128 + 32 * half..128 + 32 * half + 32];
                let sc = &b[192 + 8 * half..192 + 8 * half + 8];
                for k in 0..4 {
                    for i in 0..2 {
                        s[8 * half + 2 * k + i] = d * (sc[i + 2 * k] as i8) as f32;
                    }
                }
                let out = &mut q[128 * half..128 * half + 128];
                for l in 0..32 {
                    out[l] = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
                    out[l + 32] = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                    out[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                    out[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                }
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => unreachable!("not a quantised type"),
    }
}

/// One task: rows `r0..` (`r0` a multiple of [`TILE`]), output laid out `[row][t]`. With
/// AVX2+FMA each tile is decoded with its weights rebuilt in registers, against up to four
/// input rows per pass; otherwise each tile is rebuilt into f32 once and handed to the scalar
/// kernel with every input row. The kernel's canonical order makes a row's result independent
/// of `t` and of the path.
#[inline(always)]
fn rows_kernel(m: &QuantMatrix, r0: usize, out: &mut [f32], x: &[f32], t: usize) {
    let (l, cols) = (m.layout, m.cols);
    let n = out.len() / t;
    let (k0, k1) = (r0 / TILE, (r0 + n).div_ceil(TILE));
    let tiles = &m.data[k0 * l.tile()..k1 * l.tile()];
    if tiles::tiles_fused(l, tiles, x, t, n, out) {
        return;
    }
    let mut w = Vec::new();
    let mut i = 0;
    while i < n {
        let rn = (n - i).min(TILE);
        let tile = m.tile((r0 + i) / TILE);
        w.resize(TILE * cols, 0.0);
        l.rebuild(tile, &mut w);
        // The next tile streams in while this one is multiplied by every input row.
        if (r0 + i) / TILE + 1 < m.rows.div_ceil(TILE) {
            tiles::prefetch(m.tile((r0 + i) / TILE + 1));
        }
        tiles::tile(&w, rn, x, t, cols, &mut out[i * t..(i + rn) * t]);
        i += rn;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn rows_kernel_avx2(m: &QuantMatrix, r0: usize, out: &mut [f32], x: &[f32], t: usize) {
    rows_kernel(m, r0, out, x, t)
}

#[allow(unsafe_code)]
fn rows_dispatch(m: &QuantMatrix, r0: usize, out: &mut [f32], x: &[f32], t: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above), all `rows_kernel_avx2` needs
        // beyond the baseline (it only widens the weight rebuild).
        unsafe { rows_kernel_avx2(m, r0, out, x, t) };
        return;
    }
    rows_kernel(m, r0, out, x, t)
}

impl QuantMatrix {
    /// Repacks GGML blocks of a `[rows, cols]` matrix, or `None` when the type is not a
    /// quantised one, a row is not a whole number of blocks, or the byte count is wrong.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Option<Self> {
        let row_bytes = ty.bytes_for(cols)?;
        // An empty matrix is refused before anything is sized from the other dimension (a
        // corrupt header's `0 × 2⁴⁰` has no bytes to check it against).
        if rows == 0
            || cols == 0
            || matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16)
            || Some(data.len()) != rows.checked_mul(row_bytes)
        {
            return None;
        }
        let group = if ty == GgmlType::Q6K { 16 } else { 32 };
        let asym = matches!(
            ty,
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K
        );
        let layout = Layout {
            group,
            gpr: cols / group,
            asym,
        };
        let (be, bb) = (ty.block_elems(), ty.block_bytes());
        let gpb = be / group;
        let mut tiles = vec![0u8; rows.div_ceil(TILE) * layout.tile()];
        let (mut q, mut s) = (vec![0i8; cols], vec![0.0f32; layout.gpr]);
        let mut o = vec![0.0f32; layout.gpr];
        // Zero-offset scratch for the symmetric formats (`unpack_block` writes none there).
        let mut unused = [0.0f32; 16];
        for (r, src) in data.chunks_exact(row_bytes).enumerate() {
            for (k, b) in src.chunks_exact(bb).enumerate() {
                let ob = if asym {
                    &mut o[k * gpb..(k + 1) * gpb]
                } else {
                    &mut unused[..gpb]
                };
                unpack_block(
                    ty,
                    b,
                    &mut q[k * be..(k + 1) * be],
                    &mut s[k * gpb..(k + 1) * gpb],
                    ob,
                );
            }
            let tile = &mut tiles[(r / TILE) * layout.tile()..(r / TILE + 1) * layout.tile()];
            layout.write_row(tile, r % TILE, &q, &s, &o);
        }
        Some(Self {
            ty,
            rows,
            cols,
            layout,
            data: tiles,
            norms: std::sync::OnceLock::new(),
            int8: std::sync::OnceLock::new(),
        })
    }

    /// The matrix of rows `ids` of this one, in that order (a reduced vocabulary's rows of a
    /// tied head): the same values, so the same products bit for bit. `None` when an id is out
    /// of range or `ids` is empty.
    pub fn select_rows(&self, ids: &[u32]) -> Option<Self> {
        if ids.is_empty() || ids.iter().any(|&i| i as usize >= self.rows) {
            return None;
        }
        let l = self.layout;
        let mut data = vec![0u8; ids.len().div_ceil(TILE) * l.tile()];
        let (mut q, mut s, mut o) = (
            vec![0i8; self.cols],
            vec![0.0f32; l.gpr],
            vec![0.0f32; l.gpr],
        );
        for (r, &id) in ids.iter().enumerate() {
            let id = id as usize;
            l.read_row(self.tile(id / TILE), id % TILE, &mut q, &mut s, &mut o);
            let tile = &mut data[(r / TILE) * l.tile()..(r / TILE + 1) * l.tile()];
            l.write_row(tile, r % TILE, &q, &s, &o);
        }
        Some(Self {
            ty: self.ty,
            rows: ids.len(),
            cols: self.cols,
            layout: l,
            data,
            norms: std::sync::OnceLock::new(),
            int8: std::sync::OnceLock::new(),
        })
    }

    /// The memory layout.
    pub(crate) fn layout(&self) -> Layout {
        self.layout
    }

    /// Every tile's bytes.
    pub(crate) fn data(&self) -> &[u8] {
        &self.data
    }

    /// `‖w_r‖₂` of every row (rounded up), made once.
    pub(crate) fn norms(&self) -> &[f32] {
        self.norms.get_or_init(|| crate::argmax::row_norms(self))
    }

    /// Tile `k`'s bytes.
    pub(crate) fn tile(&self, k: usize) -> &[u8] {
        let n = self.layout.tile();
        &self.data[k * n..(k + 1) * n]
    }

    /// Output rows (`out` features).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns (`in` features).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The GGML format it came from.
    pub fn ggml_type(&self) -> GgmlType {
        self.ty
    }

    /// Bytes held (the int8 kernel's panels included once made).
    pub fn nbytes(&self) -> usize {
        self.data.len()
            + self.norms.get().map_or(0, |n| 4 * n.len())
            + self.int8.get().map_or(0, crate::int8::Panels::nbytes)
    }

    /// `y ≈ x · Wᵀ` through the int8 kernel ([`crate::int8`]): each input row rounded to int8
    /// per group, integer dot products. Not the exact products; each row's result is
    /// independent of how many rows run together. The kernel's panels are made on the first
    /// call (≈ 1 byte per weight).
    ///
    /// # Shapes
    /// - `x`: `[t, cols]` row-major → `[t, rows]` row-major
    pub fn matmul_int8(&self, x: &[f32], t: usize) -> Vec<f32> {
        self.panels().matmul(x, t)
    }

    /// Makes now what the first [`Self::argmax`] (`argmax`) or [`Self::matmul_int8`]
    /// (`int8`) would otherwise make on first use — the row norms, the int8 panels — so that
    /// no request pays for it (the 262 144-row head: ≈ 0.1 s).
    pub fn prepare(&self, argmax: bool, int8: bool) {
        if argmax && crate::argmax::applies(self) {
            self.norms();
            if crate::int8::simd_available() {
                self.panels();
            }
        }
        if int8 {
            self.panels();
        }
    }

    /// The int8 kernel's panels, made on first use.
    pub(crate) fn panels(&self) -> &crate::int8::Panels {
        self.int8.get_or_init(|| crate::int8::Panels::new(self))
    }

    /// `y = x · Wᵀ`.
    ///
    /// # Shapes
    /// - `x`: `[t, cols]` row-major → `[t, rows]` row-major
    pub fn matmul(&self, x: &[f32], t: usize) -> Vec<f32> {
        Self::matmul_many(&[self], x, t)
            .pop()
            .expect("one matrix, one product")
    }

    /// `y_m = x · W_mᵀ` for several matrices of the same width (a layer's q, k and v, or gate
    /// and up) in one parallel loop per pass: each product is [`Self::matmul`]'s, bit for bit.
    ///
    /// # Shapes
    /// - `x`: `[t, cols]` row-major → per matrix `[t, rows_m]` row-major
    pub fn matmul_many(ms: &[&Self], x: &[f32], t: usize) -> Vec<Vec<f32>> {
        let cols = ms.first().map_or(0, |m| m.cols);
        assert!(
            ms.iter().all(|m| m.cols == cols) && x.len() == t * cols,
            "QuantMatrix::matmul: input has the wrong length"
        );
        let rows: Vec<usize> = ms.iter().map(|m| m.rows).collect();
        let mut ys: Vec<Vec<f32>> = rows.iter().map(|&r| vec![0.0f32; t * r]).collect();
        // Passes of at most INPUTS_PER_PASS inputs, each into its own rows of every `y`.
        for (p, xc) in x.chunks(INPUTS_PER_PASS * cols).enumerate() {
            let tc = xc.len() / cols;
            let mut outs: Vec<&mut [f32]> = ys
                .iter_mut()
                .zip(&rows)
                .map(|(y, &r)| {
                    let at = p * INPUTS_PER_PASS * r;
                    &mut y[at..at + tc * r]
                })
                .collect();
            tiles::by_input_tasks_many(&mut outs, &rows, tc, ROWS_PER_TASK, |m, r0, out| {
                rows_dispatch(ms[m], r0, out, xc, tc)
            });
        }
        ys
    }

    /// The dense values (for tests): must equal [`crate::dequant::dequantize`] bit for bit.
    pub fn to_dense(&self) -> Vec<f32> {
        let cols = self.cols;
        let mut w = vec![0.0f32; TILE * cols];
        let mut out = Vec::with_capacity(self.rows * cols);
        for k in 0..self.rows.div_ceil(TILE) {
            self.layout.rebuild(self.tile(k), &mut w);
            let n = (self.rows - k * TILE).min(TILE);
            out.extend_from_slice(&w[..n * cols]);
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests;
