//! Host-side row storage for K/V tiers and the compact store: f32 or f16 rows, or rows
//! affine-quantised in groups of 64 values (2 to 8 bits; like llama.cpp's `q8_1`/`q4_1` and
//! mlx-lm's `--kv-bits`, one scale and one minimum per group, held as f16; codes packed low
//! bits first).
//!
//! Quantisation of a group `x[0..64]`: `m` = f16 of `min x` rounded down, `s` = f16 of
//! `(max x − m) / (2^bits − 1)` rounded up, `q = clamp(round((x − m) / s), 0, 2^bits − 1)`,
//! dequantised `q·s + m`. Because `[m, m + (2^bits − 1)·s]` covers the group, every value comes
//! back within `s / 2` (plus f32 rounding) — the bound the tests check.
//!
//! Rows made [`QuantRows::fitted`] (rotated rows, whose values a rotation has made near-Gaussian)
//! instead fit the range: of sixteen ranges shrunk towards the group's mean, and the least-squares
//! refit of the best one's codes, the one whose dequantised values err least (squared error) is
//! kept. Values inside `[m, m + (2^bits − 1)·s]` come back within `s / 2`, values outside within
//! their distance to it. At 2 bits this cuts the error of a Gaussian group by about a third.

use half::f16;
use half::slice::HalfFloatSliceExt;
use kakeya_kernels::codes::{Affine, dequantize_codes};

/// Values per quantisation group.
pub const GROUP: usize = 64;

/// The largest group [`QuantRows::with_group`] takes (a head of Gemma's widest layers).
pub const MAX_GROUP: usize = 512;

/// Bits per quantised value: 2 to 8.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct Bits(u8);

impl Bits {
    /// 8-bit values.
    pub const B8: Bits = Bits(8);
    /// 4-bit values, two per byte.
    pub const B4: Bits = Bits(4);
    /// 3-bit values.
    pub const B3: Bits = Bits(3);
    /// 2-bit values.
    pub const B2: Bits = Bits(2);

    /// `n` bits, when the quantiser supports that width (2 to 8).
    pub fn new(n: u32) -> Option<Bits> {
        (2..=8).contains(&n).then_some(Bits(n as u8))
    }

    /// `n` bits from 1 to 8: also 1, which mixed per-channel blocks give their narrowest
    /// channels (not a width of its own for a whole tier).
    pub(crate) fn narrow(n: u32) -> Option<Bits> {
        (1..=8).contains(&n).then_some(Bits(n as u8))
    }

    /// Largest code.
    fn max_code(self) -> u8 {
        ((1u16 << self.0) - 1) as u8
    }

    /// Bytes of codes per group of `group` values (packed, the last byte padded).
    fn group_bytes(self, group: usize) -> usize {
        (group * self.0 as usize).div_ceil(8)
    }

    /// Number of bits.
    pub fn count(self) -> u32 {
        u32::from(self.0)
    }
}

/// Packs `codes` (each below `2^bits`) low bits first into `out` (appended, whole bytes).
pub(crate) fn pack_codes(codes: &[u8], bits: Bits, out: &mut Vec<u8>) {
    match bits.0 {
        8 => out.extend_from_slice(codes),
        4 => out.extend(
            codes
                .chunks(2)
                .map(|p| p[0] | (p.get(1).copied().unwrap_or(0) << 4)),
        ),
        b => {
            let (mut acc, mut filled) = (0u32, 0u32);
            for &c in codes {
                acc |= u32::from(c) << filled;
                filled += u32::from(b);
                while filled >= 8 {
                    out.push(acc as u8);
                    acc >>= 8;
                    filled -= 8;
                }
            }
            if filled > 0 {
                out.push(acc as u8);
            }
        }
    }
}

/// Affine parameters `[scale, minimum]` (f16) of `values` at `bits`, and their codes.
pub(crate) fn quantise_group(values: &[f32], bits: Bits, codes: &mut Vec<u8>) -> [f16; 2] {
    let top = f32::from(bits.max_code());
    let (lo, hi) = values
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    let m = f16_down(lo);
    let s = f16_up((hi - m.to_f32()) / top);
    let (mf, sf) = (m.to_f32(), s.to_f32());
    codes.clear();
    codes.extend(values.iter().map(|&x| {
        if sf > 0.0 {
            ((x - mf) / sf).round().clamp(0.0, top) as u8
        } else {
            0
        }
    }));
    [s, m]
}

/// Candidate ranges [`quantise_group_fitted`] tries: the group's range shrunk towards its mean
/// by `1 − i / 32` for `i` in `0..16`.
const FIT_CANDIDATES: usize = 16;

/// Squared error of `values` quantised with step `s` from `m` at `top` (f32 as dequantised).
fn affine_error(values: &[f32], m: f32, s: f32, top: f32) -> f32 {
    values
        .iter()
        .map(|&x| {
            let q = if s > 0.0 {
                ((x - m) / s).round().clamp(0.0, top)
            } else {
                0.0
            };
            let e = x - (q * s + m);
            e * e
        })
        .sum()
}

/// Affine parameters `[scale, minimum]` (f16) of `values` at `bits` whose dequantised values
/// err least (squared error, over [`FIT_CANDIDATES`] shrunk ranges and a least-squares refit),
/// and their codes. Deterministic: ties keep the wider range.
pub(crate) fn quantise_group_fitted(values: &[f32], bits: Bits, codes: &mut Vec<u8>) -> [f16; 2] {
    let top = f32::from(bits.max_code());
    let n = values.len() as f32;
    let (lo, hi) = values
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    let mean = values.iter().sum::<f32>() / n;
    // Candidates as f16 `[scale, minimum]`; the first is the min–max range.
    let min_max = {
        let m = f16_down(lo);
        [f16_up((hi - m.to_f32()) / top), m]
    };
    let error = |p: [f16; 2]| affine_error(values, p[1].to_f32(), p[0].to_f32(), top);
    let mut best = (min_max, error(min_max));
    let consider = |p: [f16; 2], best: &mut ([f16; 2], f32)| {
        let e = error(p);
        if e < best.1 {
            *best = (p, e);
        }
    };
    for i in 1..FIT_CANDIDATES {
        let c = 1.0 - i as f32 / 32.0;
        let (a, b) = (mean + c * (lo - mean), mean + c * (hi - mean));
        consider([f16::from_f32((b - a) / top), f16::from_f32(a)], &mut best);
    }
    // Least-squares refit of the best candidate's codes q: x ≈ m + s·q.
    let (s0, m0) = (best.0[0].to_f32(), best.0[1].to_f32());
    if s0 > 0.0 {
        let q = |x: f32| ((x - m0) / s0).round().clamp(0.0, top);
        let (mut sq, mut sqq, mut sx, mut sqx) = (0.0f32, 0.0f32, 0.0f32, 0.0f32);
        for &x in values {
            let c = q(x);
            (sq, sqq, sx, sqx) = (sq + c, sqq + c * c, sx + x, sqx + c * x);
        }
        let det = n * sqq - sq * sq;
        if det > 0.0 {
            let s = (n * sqx - sq * sx) / det;
            if s > 0.0 {
                consider(
                    [f16::from_f32(s), f16::from_f32((sx - s * sq) / n)],
                    &mut best,
                );
            }
        }
    }
    let best = best.0;
    let (s, m) = (best[0].to_f32(), best[1].to_f32());
    codes.clear();
    codes.extend(values.iter().map(|&x| {
        if s > 0.0 {
            ((x - m) / s).round().clamp(0.0, top) as u8
        } else {
            0
        }
    }));
    best
}

/// The largest f16 not above `x` (finite `x`).
fn f16_down(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() <= x {
        return h;
    }
    let b = h.to_bits();
    f16::from_bits(if b == 0 {
        0x8001
    } else if b & 0x8000 == 0 {
        b - 1
    } else {
        b + 1
    })
}

/// The smallest f16 not below `x` (finite `x`).
fn f16_up(x: f32) -> f16 {
    -f16_down(-x)
}

/// Rows per page of [`QuantRows`]: storage is allocated a page at a time (each page exactly
/// its size), so what is held stays within a page at each end of what the rows use.
pub const PAGE_ROWS: usize = 64;

/// Up to [`PAGE_ROWS`] rows' codes and group parameters.
#[derive(Debug, Clone)]
struct Page {
    codes: Vec<u8>,
    params: Vec<[f16; 2]>,
}

/// Rows of `width` values, quantised group by group: groups of [`GROUP`] values, or of the
/// largest even divisor of `width` below it when `width` is not a multiple (tiny test models).
#[derive(Debug, Clone)]
pub struct QuantRows {
    bits: Bits,
    width: usize,
    group: usize,
    /// Ranges fitted for least squared error ([`quantise_group_fitted`]) instead of min–max.
    fitted: bool,
    pages: std::collections::VecDeque<Page>,
    /// Rows dropped from the front of the first page (freed with the page).
    skip: usize,
    rows: usize,
}

impl QuantRows {
    /// Empty rows of `width` values, in groups of [`GROUP`] (or the largest even divisor of
    /// `width` below it).
    pub fn new(bits: Bits, width: usize) -> Self {
        let group = (2..=GROUP)
            .rev()
            .step_by(2)
            .find(|g| width.is_multiple_of(*g))
            .unwrap_or_else(|| panic!("row width {width} has no even group size"));
        Self::with_group(bits, width, group)
    }

    /// Empty rows of `width` values in groups of `group` values (even, at most [`MAX_GROUP`],
    /// dividing `width`): e.g. one group per head for rotated rows, whose channels a rotation
    /// has made alike.
    pub fn with_group(bits: Bits, width: usize, group: usize) -> Self {
        assert!(
            group > 0
                && group.is_multiple_of(2)
                && group <= MAX_GROUP
                && width.is_multiple_of(group),
            "group of {group} values for rows of {width}"
        );
        Self {
            bits,
            width,
            group,
            fitted: false,
            pages: Default::default(),
            skip: 0,
            rows: 0,
        }
    }

    /// The same rows with each group's range fitted for least squared error (for rotated
    /// rows, whose near-Gaussian values a min–max range spreads too thin).
    pub fn fitted(self) -> Self {
        Self {
            fitted: true,
            ..self
        }
    }

    /// Whether group ranges are fitted ([`Self::fitted`]).
    pub fn is_fitted(&self) -> bool {
        self.fitted
    }

    fn groups_per_row(&self) -> usize {
        self.width / self.group
    }

    /// Values per group.
    pub fn group(&self) -> usize {
        self.group
    }

    /// The page holding row `row` and the index of the row's first group in it.
    fn locate(&self, row: usize) -> (&Page, usize) {
        let p = self.skip + row;
        (
            &self.pages[p / PAGE_ROWS],
            (p % PAGE_ROWS) * self.groups_per_row(),
        )
    }

    /// Quantises and appends rows (`values.len()` a multiple of the width).
    pub fn push(&mut self, values: &[f32]) {
        let gb = self.bits.group_bytes(self.group);
        let gpr = self.groups_per_row();
        let mut codes = Vec::with_capacity(self.group);
        for row in values.chunks_exact(self.width) {
            if self
                .pages
                .back()
                .is_none_or(|p| p.params.len() == PAGE_ROWS * gpr)
            {
                self.pages.push_back(Page {
                    codes: Vec::with_capacity(PAGE_ROWS * gpr * gb),
                    params: Vec::with_capacity(PAGE_ROWS * gpr),
                });
            }
            let page = self.pages.back_mut().expect("a page with room");
            for g in row.chunks_exact(self.group) {
                let p = if self.fitted {
                    quantise_group_fitted(g, self.bits, &mut codes)
                } else {
                    quantise_group(g, self.bits, &mut codes)
                };
                pack_codes(&codes, self.bits, &mut page.codes);
                page.params.push(p);
            }
            self.rows += 1;
        }
    }

    /// Keeps the first `rows` rows.
    pub fn truncate(&mut self, rows: usize) {
        self.rows = rows.min(self.rows);
        if self.rows == 0 {
            self.pages.clear();
            self.skip = 0;
            return;
        }
        let end = self.skip + self.rows;
        self.pages.truncate(end.div_ceil(PAGE_ROWS));
        let in_last = end - (self.pages.len() - 1) * PAGE_ROWS;
        let g = in_last * self.groups_per_row();
        let gb = self.bits.group_bytes(self.group);
        let last = self.pages.back_mut().expect("a page holds the kept rows");
        last.codes.truncate(g * gb);
        last.params.truncate(g);
    }

    /// Drops the first `rows` rows.
    pub fn drop_front(&mut self, rows: usize) {
        let rows = rows.min(self.rows);
        self.rows -= rows;
        self.skip += rows;
        if self.rows == 0 {
            self.pages.clear();
            self.skip = 0;
            return;
        }
        while self.skip >= PAGE_ROWS {
            self.pages.pop_front();
            self.skip -= PAGE_ROWS;
        }
    }

    /// Dequantised rows `from..to`, row-major.
    pub fn dequantize(&self, from: usize, to: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; (to - from) * self.width];
        self.dequantize_into(from, to, &mut out);
        out
    }

    /// Dequantised rows `from..to`, row-major, into `out` (`(to − from) · width` long).
    pub fn dequantize_into(&self, from: usize, to: usize, out: &mut [f32]) {
        let gb = self.bits.group_bytes(self.group);
        for (r, o) in (from..to).zip(out.chunks_exact_mut(self.width)) {
            let (page, first) = self.locate(r);
            for (g, o) in (first..).zip(o.chunks_exact_mut(self.group)) {
                let [s, m] = page.params[g];
                let affine = Affine::Group {
                    scale: s.to_f32(),
                    min: m.to_f32(),
                };
                let codes = &page.codes[g * gb..(g + 1) * gb];
                dequantize_codes(codes, self.bits.count(), affine, o);
            }
        }
    }

    /// Scale of group `g` of row `row` (for error bounds).
    pub fn scale(&self, row: usize, g: usize) -> f32 {
        self.params(row, g)[0]
    }

    /// `[scale, minimum]` of group `g` of row `row` (for error bounds).
    pub fn params(&self, row: usize, g: usize) -> [f32; 2] {
        let (page, first) = self.locate(row);
        let [s, m] = page.params[first + g];
        [s.to_f32(), m.to_f32()]
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.rows
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Bytes allocated (codes and group parameters, page by page, and the page list).
    pub fn nbytes(&self) -> usize {
        self.pages
            .iter()
            .map(|p| p.codes.capacity() + p.params.capacity() * std::mem::size_of::<[f16; 2]>())
            .sum::<usize>()
            + self.pages.capacity() * std::mem::size_of::<Page>()
    }
}

/// Reserves room for `more` elements, growing by an eighth at least (allocated bytes stay
/// within ~12% of what is used, and appends stay amortised O(1)).
fn grow<T>(v: &mut Vec<T>, more: usize) {
    let need = v.len() + more;
    if need > v.capacity() {
        let target = need.max(v.len() + v.len() / 8 + 64);
        v.reserve_exact(target - v.len());
    }
}

/// Gives back capacity beyond an eighth over what is used (after dropping old rows, so that a
/// sliding tier does not keep the allocation of its largest moment).
fn shrink<T>(v: &mut Vec<T>) {
    if v.capacity() > v.len() + v.len() / 4 + 64 {
        v.shrink_to(v.len() + v.len() / 8 + 64);
    }
}

/// Rows of `width` values, as f32, f16 or quantised.
#[derive(Debug, Clone)]
pub enum Rows {
    /// Exact f32 rows.
    F32 {
        /// Row width.
        width: usize,
        /// Values, row-major.
        data: Vec<f32>,
    },
    /// f16 rows (each value rounded to nearest), read back as f32.
    F16 {
        /// Row width.
        width: usize,
        /// Values, row-major.
        data: Vec<f16>,
    },
    /// Affine-quantised rows.
    Quant(QuantRows),
}

impl Rows {
    /// Empty rows of `width` values, quantised when `bits` is given.
    pub fn new(width: usize, bits: Option<Bits>) -> Self {
        match bits {
            None => Rows::F32 {
                width,
                data: Vec::new(),
            },
            Some(b) => Rows::Quant(QuantRows::new(b, width)),
        }
    }

    /// Empty f16 rows of `width` values.
    pub fn f16(width: usize) -> Self {
        Rows::F16 {
            width,
            data: Vec::new(),
        }
    }

    /// Row width.
    pub fn width(&self) -> usize {
        match self {
            Rows::F32 { width, .. } | Rows::F16 { width, .. } => *width,
            Rows::Quant(q) => q.width,
        }
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        match self {
            Rows::F32 { width, data } => data.len() / width,
            Rows::F16 { width, data } => data.len() / width,
            Rows::Quant(q) => q.rows,
        }
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends rows (`values.len()` a multiple of the width).
    pub fn push(&mut self, values: &[f32]) {
        debug_assert_eq!(values.len() % self.width(), 0);
        match self {
            Rows::F32 { data, .. } => {
                grow(data, values.len());
                data.extend_from_slice(values);
            }
            Rows::F16 { data, .. } => {
                grow(data, values.len());
                let at = data.len();
                data.resize(at + values.len(), f16::ZERO);
                data[at..].convert_from_f32_slice(values);
            }
            Rows::Quant(q) => q.push(values),
        }
    }

    /// Keeps the first `rows` rows.
    pub fn truncate(&mut self, rows: usize) {
        match self {
            Rows::F32 { width, data } => data.truncate(rows * *width),
            Rows::F16 { width, data } => data.truncate(rows * *width),
            Rows::Quant(q) => q.truncate(rows),
        }
    }

    /// Drops the first `rows` rows.
    pub fn drop_front(&mut self, rows: usize) {
        match self {
            Rows::F32 { width, data } => {
                data.drain(..(rows * *width).min(data.len()));
                shrink(data);
            }
            Rows::F16 { width, data } => {
                data.drain(..(rows * *width).min(data.len()));
                shrink(data);
            }
            Rows::Quant(q) => q.drop_front(rows),
        }
    }

    /// Rows `from..to` as f32 (dequantised when quantised), row-major.
    pub fn read(&self, from: usize, to: usize) -> Vec<f32> {
        match self {
            Rows::F32 { width, data } => data[from * width..to * width].to_vec(),
            Rows::F16 { width, data } => data[from * width..to * width].to_f32_vec(),
            Rows::Quant(q) => q.dequantize(from, to),
        }
    }

    /// [`Self::read`] into `out` (`(to − from) · width` long).
    pub fn read_into(&self, from: usize, to: usize, out: &mut [f32]) {
        match self {
            Rows::F32 { width, data } => out.copy_from_slice(&data[from * width..to * width]),
            Rows::F16 { width, data } => {
                data[from * width..to * width].convert_to_f32_slice(out);
            }
            Rows::Quant(q) => q.dequantize_into(from, to, out),
        }
    }

    /// Bytes allocated.
    pub fn nbytes(&self) -> usize {
        match self {
            Rows::F32 { data, .. } => data.capacity() * 4,
            Rows::F16 { data, .. } => data.capacity() * 2,
            Rows::Quant(q) => q.nbytes(),
        }
    }
}

#[cfg(test)]
#[path = "rows_tests.rs"]
mod tests;
