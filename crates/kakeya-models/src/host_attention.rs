//! Decode-row attention on the CPU, read straight from the caches' buffers: a few query rows
//! over a few hundred keys are too small for a GEMM (Burn's matmul packs the keys and the
//! values for every call), so each row's scores,
//! softmax and value sums run here over the buffers in place, as the fixed-order sums of
//! [`kakeya_kernels::rowops`]. A row's result depends only on its query and the keys it
//! reads, never on the other rows.

use burn::backend::{BackendTensor, DispatchTensorKind};
use burn::tensor::Tensor;
use kakeya_kernels::rowops::{self, Rows};
use rayon::prelude::*;

use crate::cache::{HostTier, KvPart};
use crate::error::Result;

/// Keys per tile of a row's sums: a tile of 16-bit keys (or values) is widened to f32 into a
/// scratch buffer that stays in cache (64 rows of 256 values: 64 KiB) before its products.
pub const KEY_TILE: usize = 64;

/// A `[heads, rows, dim]` tensor's elements in place (no copy), when it lives in CPU memory
/// (burn-flex) as f32 or f16 with unit stride along `dim`.
pub struct HostView {
    tensor: burn::backend::flex::FlexTensor,
    half: bool,
    offset: usize,
    head_stride: usize,
    row_stride: usize,
    dims: [usize; 3],
}

/// Whether `t` lives in CPU memory as a plain burn-flex float tensor (not on a GPU, not
/// tracked by autodiff): the storage [`HostView`] reads.
pub fn on_host(t: &Tensor<3>) -> bool {
    matches!(
        t.clone().into_dispatch().kind,
        DispatchTensorKind::Flex(BackendTensor::Float(_))
    )
}

impl HostView {
    /// The view of `t`, or `None` off the CPU, for other dtypes or layouts.
    pub fn of(t: &Tensor<3>) -> Option<Self> {
        let dims = t.dims();
        let DispatchTensorKind::Flex(BackendTensor::Float(tensor)) = t.clone().into_dispatch().kind
        else {
            return None;
        };
        let half = match tensor.dtype() {
            burn::tensor::DType::F32 => false,
            burn::tensor::DType::F16 => true,
            _ => return None,
        };
        let layout = tensor.layout();
        let s = layout.strides();
        if s.len() != 3 || s[2] != 1 || s[0] < 0 || s[1] < 0 {
            return None;
        }
        let (offset, head_stride, row_stride) =
            (layout.start_offset(), s[0] as usize, s[1] as usize);
        Some(Self {
            tensor,
            half,
            offset,
            head_stride,
            row_stride,
            dims,
        })
    }

    /// `[heads, rows, dim]`.
    pub fn dims(&self) -> [usize; 3] {
        self.dims
    }

    /// Rows `keys` of head `h`, `[keys.len(), dim]`: in place (f32 or f16) when they are one
    /// run of adjacent rows, else gathered (and f16 widened) into `buf`.
    pub fn rows<'a>(&'a self, h: usize, keys: &[usize], buf: &'a mut Vec<f32>) -> Rows<'a> {
        let dim = self.dims[2];
        let run = keys.windows(2).all(|w| w[1] == w[0] + 1) && self.row_stride == dim;
        if let (true, Some(&first)) = (run, keys.first()) {
            let at = self.offset + h * self.head_stride + first * self.row_stride;
            let span = at..at + keys.len() * dim;
            return if self.half {
                Rows::F16(&self.tensor.storage::<half::f16>()[span])
            } else {
                Rows::F32(&self.tensor.storage::<f32>()[span])
            };
        }
        buf.resize(keys.len() * dim, 0.0);
        self.rows_into(h, keys, buf);
        Rows::F32(buf)
    }

    /// Rows `keys` of head `h` as f32 into `out` (`[keys.len(), dim]`; f16 widened).
    pub fn rows_into(&self, h: usize, keys: &[usize], out: &mut [f32]) {
        let dim = self.dims[2];
        let run = keys.windows(2).all(|w| w[1] == w[0] + 1) && self.row_stride == dim;
        let at = |j: usize| self.offset + h * self.head_stride + j * self.row_stride;
        let out = &mut out[..keys.len() * dim];
        if self.half {
            use kakeya_kernels::rowops::widen_f16;
            let src = self.tensor.storage::<half::f16>();
            match keys.first() {
                Some(&first) if run => {
                    let a = at(first);
                    widen_f16(&src[a..a + keys.len() * dim], out);
                }
                _ => {
                    for (o, &j) in out.chunks_exact_mut(dim).zip(keys) {
                        widen_f16(&src[at(j)..at(j) + dim], o);
                    }
                }
            }
            return;
        }
        let src = self.tensor.storage::<f32>();
        for (o, &j) in out.chunks_exact_mut(dim).zip(keys) {
            o.copy_from_slice(&src[at(j)..at(j) + dim]);
        }
    }

    /// Row `r` of head `h` (`dim` values) of an f32 view (queries).
    ///
    /// # Panics
    /// On an f16 view: read those through [`Self::rows`].
    pub fn row(&self, h: usize, r: usize) -> &[f32] {
        assert!(!self.half, "HostView::row reads f32 views only");
        let at = self.offset + h * self.head_stride + r * self.row_stride;
        &self.tensor.storage::<f32>()[at..at + self.dims[2]]
    }
}

/// Where the keys and values of one segment are read on the CPU.
// A few per layer and forward, in a Vec: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum RowSource<'a> {
    /// Buffers viewed in place (a cache's, or the chunk's own K/V), rows by index.
    View {
        /// Keys, `[kv_heads, n, dim]`.
        k: HostView,
        /// Values, `[kv_heads, n, dim]`.
        v: HostView,
    },
    /// A cache's own storage (quantised codes), rows by absolute position.
    Tier(&'a dyn HostTier),
}

/// One key a query row reads: the source it lives in and its row there (an index into a
/// view, an absolute position in a tier).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourcedKey {
    /// Index into the sources.
    pub source: usize,
    /// Row in that source.
    pub row: usize,
}

/// Head `h` of `part` for `keys` (in order) as rows `[keys.len(), dim]`: in place (f32 or f16)
/// when they are one run of adjacent rows of one view, else gathered as f32 (f16 widened, codes
/// dequantised) into `buf`.
fn tile_rows<'b>(
    sources: &'b [RowSource<'_>],
    part: KvPart,
    (h, dim): (usize, usize),
    keys: &[SourcedKey],
    rows: &mut Vec<usize>,
    buf: &'b mut Vec<f32>,
) -> Result<Rows<'b>> {
    let view = |s: &'b RowSource<'_>| match (s, part) {
        (RowSource::View { k, .. }, KvPart::K) => Some(k),
        (RowSource::View { v, .. }, KvPart::V) => Some(v),
        (RowSource::Tier(_), _) => None,
    };
    let first = keys[0].source;
    if keys.iter().all(|k| k.source == first)
        && let Some(view) = view(&sources[first])
    {
        rows.clear();
        rows.extend(keys.iter().map(|k| k.row));
        return Ok(view.rows(h, rows, buf));
    }
    buf.resize(keys.len() * dim, 0.0);
    let mut a = 0;
    while a < keys.len() {
        let s = keys[a].source;
        match &sources[s] {
            RowSource::View { .. } => {
                let b = a + keys[a..].iter().take_while(|k| k.source == s).count();
                rows.clear();
                rows.extend(keys[a..b].iter().map(|k| k.row));
                let at = a * dim..b * dim;
                view(&sources[s])
                    .expect("a view")
                    .rows_into(h, rows, &mut buf[at]);
                a = b;
            }
            RowSource::Tier(tier) => {
                let p = keys[a].row;
                let b = a + keys[a..]
                    .iter()
                    .enumerate()
                    .take_while(|(j, k)| k.source == s && k.row == p + j)
                    .count();
                let at = a * dim..b * dim;
                tier.read_head(part, h, p..p + (b - a), &mut buf[at])?;
                a = b;
            }
        }
    }
    Ok(Rows::F32(&buf[..keys.len() * dim]))
}

/// Keys per span of a row: a row over more keys than this splits them into spans of this many
/// (counted from its first key), each span's scores, softmax terms and value sums run on one
/// thread, and the spans' partial results merge in span order. The split depends only on the
/// row's key count, never on the threads or the other rows, so a row's bits do not either.
pub const KEY_SPAN: usize = 1024;

/// One span's share of a row over one key/value head: per query head of the group, the
/// span's largest scaled score, the sum of `exp(score − max)`, and those weights' sums of the
/// plain and of the rotated values.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    plain: Vec<f32>,
    rotated: Vec<f32>,
}

/// What every span of a block of rows reads: the sources, which of them hold rotated values,
/// the key/value head, and per row the group's queries.
#[derive(Clone)]
struct RowInputs<'s, 'a> {
    sources: &'s [RowSource<'a>],
    rotated: &'s [bool],
    any_rotated: bool,
    kvh: usize,
    dim: usize,
    group: usize,
    /// Per row, `[group, dim]`.
    qg: Vec<&'s [f32]>,
    scale: f32,
}

impl RowInputs<'_, '_> {
    /// Head `kvh`'s `part` rows of `keys` as f32 ([`tile_rows`] over these sources).
    fn tile<'b>(
        &'b self,
        part: KvPart,
        keys: &[SourcedKey],
        (rows, buf): (&mut Vec<usize>, &'b mut Vec<f32>),
    ) -> Result<Rows<'b>> {
        tile_rows(self.sources, part, (self.kvh, self.dim), keys, rows, buf)
    }

    /// Each row's partial result over its first `lens[r]` keys of the span `keys` (every
    /// `lens[r]` at least 1): a tile of keys or values is read (widened, dequantised) once for
    /// all the rows, and each row runs on it exactly the products it runs alone.
    fn partials(&self, keys: &[SourcedKey], lens: &[usize]) -> Result<Vec<Partial>> {
        let (group, dim) = (self.group, self.dim);
        let mut s: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0f32; n * group]).collect();
        let (mut buf, mut rows) = (Vec::new(), Vec::new());
        // Keys within a tile that row `r` reads, from `from` on.
        let reads = |r: usize, from: usize, len: usize| lens[r].saturating_sub(from).min(len);
        for (c, tile) in keys.chunks(KEY_TILE).enumerate() {
            let from = c * KEY_TILE;
            let needed = (0..lens.len()).map(|r| reads(r, from, tile.len())).max();
            let needed = needed.unwrap_or(0);
            if needed == 0 {
                break;
            }
            let ks = self.tile(KvPart::K, &tile[..needed], (&mut rows, &mut buf))?;
            for (r, (q, s)) in self.qg.iter().zip(&mut s).enumerate() {
                let n = reads(r, from, tile.len());
                if n > 0 {
                    rowops::row_dots(ks, n, q, group, dim, &mut s[from * group..]);
                }
            }
        }
        let terms: Vec<(Vec<f32>, Vec<f32>)> = s
            .iter_mut()
            .map(|s| softmax_terms(s, group, self.scale))
            .collect();
        let width = if self.any_rotated { group * dim } else { 0 };
        let mut plain = vec![vec![0.0f32; group * dim]; lens.len()];
        let mut rotated = vec![vec![0.0f32; width]; lens.len()];
        for (c, tile) in keys.chunks(KEY_TILE).enumerate() {
            // Runs of rotated and plain values go to their own sums.
            let mut a = 0;
            while a < tile.len() {
                let from = c * KEY_TILE + a;
                let r = self.rotated[tile[a].source];
                let b = a + tile[a..]
                    .iter()
                    .take_while(|k| self.rotated[k.source] == r)
                    .count();
                let needed = (0..lens.len()).map(|j| reads(j, from, b - a)).max();
                let needed = needed.unwrap_or(0);
                if needed == 0 {
                    break;
                }
                let vs = self.tile(KvPart::V, &tile[a..a + needed], (&mut rows, &mut buf))?;
                for j in 0..lens.len() {
                    let n = reads(j, from, b - a);
                    if n > 0 {
                        let acc = if r {
                            &mut rotated[j][..]
                        } else {
                            &mut plain[j][..]
                        };
                        rowops::weighted_sum(&s[j][from * group..], vs, n, group, dim, acc);
                    }
                }
                a = b;
            }
        }
        Ok(terms
            .into_iter()
            .zip(plain.into_iter().zip(rotated))
            .map(|((max, sum), (plain, rotated))| Partial {
                max,
                sum,
                plain,
                rotated,
            })
            .collect())
    }
}

/// Softmax terms of one row's span in place: `s` (`[n, group]`, raw scores) becomes
/// `exp(scale · s − max)` per query head; returns each head's `max` and sum of the terms.
fn softmax_terms(s: &mut [f32], group: usize, scale: f32) -> (Vec<f32>, Vec<f32>) {
    let n = s.len() / group;
    let (mut max, mut sum) = (vec![f32::NEG_INFINITY; group], vec![0.0f32; group]);
    for g in 0..group {
        for j in 0..n {
            s[j * group + g] *= scale;
            max[g] = max[g].max(s[j * group + g]);
        }
        for j in 0..n {
            let e = (s[j * group + g] - max[g]).exp();
            s[j * group + g] = e;
            sum[g] += e;
        }
    }
    (max, sum)
}

/// One query position's attention: for every query head `h` (reading key/value head
/// `h / (heads / kv_heads)`), `softmax(scale · q_h·k_j) · v_j` over `keys` (in position order,
/// the order their sums run), read from `sources`. Writes `out` (`heads · dim`, heads
/// concatenated). The keys split into spans of [`KEY_SPAN`] (in parallel when there are
/// several), each span's products [`kakeya_kernels::rowops`]'s fixed-order sums over tiles of
/// [`KEY_TILE`] keys counted from the row's first key (f16 keys and values widened, quantised
/// ones dequantised, a tile at a time); the spans merge in order, rescaled to the row's
/// largest score. Neither the tiling nor the split depends on how the keys are divided into
/// segments or on the threads, so a row reads the same bits either way, and f32 and
/// f16-rounded inputs take the same arithmetic. Values a tier holds rotated are summed apart
/// and mapped back once per head.
///
/// # Shapes
/// - `q`: `[heads, T, dim]` (row `i` is read, f32); the sources' keys and values
///   `[kv_heads, ·, dim]`
pub fn attend_row(
    q: &HostView,
    (i, kv_heads): (usize, usize),
    sources: &[RowSource<'_>],
    keys: &[SourcedKey],
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    attend_rows(q, (i, kv_heads), sources, (keys, &[keys.len()]), scale, out)
}

/// Rows `i..i + lens.len()` of `q` at once, row `i + r` over the first `lens[r]` of `keys`:
/// each row's result is bit for bit [`attend_row`]'s over those keys, while every tile of
/// keys and values is read once for all the rows (a prompt chunk's rows at depth share
/// nearly all their keys). Writes `out` (`[lens.len(), heads · dim]`).
///
/// # Shapes
/// - `q`: `[heads, T, dim]` (rows `i..i + lens.len()` are read, f32); the sources' keys and
///   values `[kv_heads, ·, dim]`
pub fn attend_rows(
    q: &HostView,
    (i, kv_heads): (usize, usize),
    sources: &[RowSource<'_>],
    (keys, lens): (&[SourcedKey], &[usize]),
    scale: f32,
    out: &mut [f32],
) -> Result<()> {
    let [heads, _, dim] = q.dims();
    let group = heads / kv_heads;
    assert!(
        lens.iter().all(|&n| n > 0 && n <= keys.len()),
        "attend_rows: every row reads at least one of the keys"
    );
    let rotated: Vec<bool> = sources
        .iter()
        .map(|s| matches!(s, RowSource::Tier(t) if t.values_rotated()))
        .collect();
    let undo = sources.iter().zip(&rotated).find_map(|(s, &r)| match s {
        RowSource::Tier(t) if r => Some(*t),
        _ => None,
    });
    let width = heads * dim;
    let mut qg = vec![0.0f32; lens.len() * group * dim];
    for kvh in 0..kv_heads {
        for (r, q_r) in qg.chunks_exact_mut(group * dim).enumerate() {
            for g in 0..group {
                q_r[g * dim..(g + 1) * dim].copy_from_slice(q.row(kvh * group + g, i + r));
            }
        }
        let inputs = RowInputs {
            sources,
            rotated: &rotated,
            any_rotated: undo.is_some(),
            kvh,
            dim,
            group,
            qg: qg.chunks_exact(group * dim).collect(),
            scale,
        };
        // Span `k` of every row that reaches it, each row over its own share.
        let span = |(k, span): (usize, &[SourcedKey])| -> Result<Vec<Partial>> {
            let from = k * KEY_SPAN;
            let (rows, span_lens): (Vec<usize>, Vec<usize>) = lens
                .iter()
                .enumerate()
                .filter(|&(_, &n)| n > from)
                .map(|(r, &n)| (r, (n - from).min(KEY_SPAN)))
                .unzip();
            let inputs = RowInputs {
                qg: rows.iter().map(|&r| inputs.qg[r]).collect(),
                ..inputs.clone()
            };
            inputs.partials(span, &span_lens)
        };
        let spans: Vec<Vec<Partial>> = if keys.len() > KEY_SPAN {
            keys.par_chunks(KEY_SPAN)
                .enumerate()
                .map(span)
                .collect::<Result<_>>()?
        } else {
            vec![span((0, keys))?]
        };
        // Each row's partials in span order (row r reaches spans 0..ceil(lens[r] / KEY_SPAN)).
        let mut taken = vec![0usize; spans.len()];
        for (r, &n) in lens.iter().enumerate() {
            let mine: Vec<&Partial> = (0..n.div_ceil(KEY_SPAN))
                .map(|k| {
                    let p = &spans[k][taken[k]];
                    taken[k] += 1;
                    p
                })
                .collect();
            let o = &mut out[r * width + kvh * group * dim..r * width + (kvh + 1) * group * dim];
            merge_spans(&mine, group, dim, undo, o);
        }
    }
    Ok(())
}

/// The row's result for one key/value head from its spans' partials (`o`: `[group, dim]`):
/// each span's sums rescaled to the largest score over all spans, added in span order,
/// divided by the softmax's total; the rotated values' share mapped back by `undo`.
fn merge_spans(
    parts: &[&Partial],
    group: usize,
    dim: usize,
    undo: Option<&dyn HostTier>,
    o: &mut [f32],
) {
    let mut back = vec![0.0f32; dim];
    for g in 0..group {
        let max = parts
            .iter()
            .map(|p| p.max[g])
            .fold(f32::NEG_INFINITY, f32::max);
        let o = &mut o[g * dim..(g + 1) * dim];
        o.fill(0.0);
        back.fill(0.0);
        let mut total = 0.0f32;
        for p in parts {
            let w = (p.max[g] - max).exp();
            total += p.sum[g] * w;
            for (x, y) in o.iter_mut().zip(&p.plain[g * dim..(g + 1) * dim]) {
                *x = w.mul_add(*y, *x);
            }
            if let Some(r) = p.rotated.get(g * dim..(g + 1) * dim) {
                for (x, y) in back.iter_mut().zip(r) {
                    *x = w.mul_add(*y, *x);
                }
            }
        }
        let inv = 1.0 / total;
        o.iter_mut().for_each(|x| *x *= inv);
        if let Some(t) = undo {
            back.iter_mut().for_each(|x| *x *= inv);
            t.undo_values(&mut back);
            for (x, y) in o.iter_mut().zip(&back) {
                *x += y;
            }
        }
    }
}

#[cfg(test)]
#[path = "host_attention_tests.rs"]
mod tests;
