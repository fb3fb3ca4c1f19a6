//! Decode-row attention on the CPU, read straight from the caches' buffers: a few query rows
//! over a few hundred keys are too small for a GEMM (Burn's matmul packs the keys and the
//! values for every call, ≈ 11 % of an eight-sequence decode step), so each row's scores,
//! softmax and value sums run here over the buffers in place, as the fixed-order sums of
//! [`kakeya_weights::rowops`]. A row's result depends only on its query and the keys it
//! reads, never on the other rows.

use burn::backend::{BackendTensor, DispatchTensorKind};
use burn::tensor::Tensor;
use kakeya_weights::rowops;

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

    /// Rows `keys` of head `h` as f32, `[keys.len(), dim]`: in place when they are one run of
    /// adjacent f32 rows, else gathered (and f16 widened) into `buf`.
    pub fn rows<'a>(&'a self, h: usize, keys: &[usize], buf: &'a mut Vec<f32>) -> &'a [f32] {
        let dim = self.dims[2];
        let run = keys.windows(2).all(|w| w[1] == w[0] + 1) && self.row_stride == dim;
        if let (false, true, Some(&first)) = (self.half, run, keys.first()) {
            let at = self.offset + h * self.head_stride + first * self.row_stride;
            return &self.tensor.storage::<f32>()[at..at + keys.len() * dim];
        }
        buf.resize(keys.len() * dim, 0.0);
        self.rows_into(h, keys, buf);
        buf
    }

    /// Rows `keys` of head `h` as f32 into `out` (`[keys.len(), dim]`; f16 widened).
    pub fn rows_into(&self, h: usize, keys: &[usize], out: &mut [f32]) {
        let dim = self.dims[2];
        let run = keys.windows(2).all(|w| w[1] == w[0] + 1) && self.row_stride == dim;
        let at = |j: usize| self.offset + h * self.head_stride + j * self.row_stride;
        let out = &mut out[..keys.len() * dim];
        if self.half {
            use kakeya_weights::rowops::widen_f16;
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

/// Head `h` of `part` for `keys` (in order) as f32 rows `[keys.len(), dim]`: in place when they
/// are one run of adjacent f32 rows of one view, else gathered (f16 widened, codes
/// dequantised) into `buf`.
fn tile_rows<'b>(
    sources: &'b [RowSource<'_>],
    part: KvPart,
    (h, dim): (usize, usize),
    keys: &[SourcedKey],
    rows: &mut Vec<usize>,
    buf: &'b mut Vec<f32>,
) -> Result<&'b [f32]> {
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
    Ok(&buf[..keys.len() * dim])
}

/// One query position's attention: for every query head `h` (reading key/value head
/// `h / (heads / kv_heads)`), `softmax(scale · q_h·k_j) · v_j` over `keys` (in position order,
/// the order their sums run), read from `sources`. Writes `out` (`heads · dim`, heads
/// concatenated). The products are [`kakeya_weights::rowops`]'s fixed-order sums, run over
/// tiles of [`KEY_TILE`] keys counted from the row's first key (f16 keys and values widened,
/// quantised ones dequantised, a tile at a time); the tiling changes no sum's order, so a row
/// reads the same bits however its keys are split into segments, and f32 and f16-rounded
/// inputs take the same arithmetic. Values a tier holds rotated are summed apart and mapped
/// back once per head.
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
    let [heads, _, dim] = q.dims();
    let group = heads / kv_heads;
    let n = keys.len();
    let rotated: Vec<bool> = sources
        .iter()
        .map(|s| matches!(s, RowSource::Tier(t) if t.values_rotated()))
        .collect();
    let undo = sources.iter().zip(&rotated).find_map(|(s, &r)| match s {
        RowSource::Tier(t) if r => Some(*t),
        _ => None,
    });
    let mut qg = vec![0.0f32; group * dim];
    let mut s = vec![0.0f32; n * group];
    let mut back = vec![0.0f32; if undo.is_some() { group * dim } else { 0 }];
    let (mut buf, mut rows) = (Vec::new(), Vec::new());
    for kvh in 0..kv_heads {
        for g in 0..group {
            qg[g * dim..(g + 1) * dim].copy_from_slice(q.row(kvh * group + g, i));
        }
        for (c, tile) in keys.chunks(KEY_TILE).enumerate() {
            let ks = tile_rows(sources, KvPart::K, (kvh, dim), tile, &mut rows, &mut buf)?;
            let at = c * KEY_TILE * group;
            rowops::row_dots(ks, tile.len(), &qg, group, dim, &mut s[at..]);
        }
        // Softmax over the keys, per query head (`s` is `[n, group]`).
        for g in 0..group {
            let mut max = f32::NEG_INFINITY;
            for j in 0..n {
                s[j * group + g] *= scale;
                max = max.max(s[j * group + g]);
            }
            let mut sum = 0.0f32;
            for j in 0..n {
                let e = (s[j * group + g] - max).exp();
                s[j * group + g] = e;
                sum += e;
            }
            for j in 0..n {
                s[j * group + g] /= sum;
            }
        }
        let o = &mut out[kvh * group * dim..(kvh + 1) * group * dim];
        o.fill(0.0);
        back.fill(0.0);
        for (c, tile) in keys.chunks(KEY_TILE).enumerate() {
            // Runs of rotated and plain values go to their own sums.
            let mut a = 0;
            while a < tile.len() {
                let r = rotated[tile[a].source];
                let b = a + tile[a..]
                    .iter()
                    .take_while(|k| rotated[k.source] == r)
                    .count();
                let run = &tile[a..b];
                let vs = tile_rows(sources, KvPart::V, (kvh, dim), run, &mut rows, &mut buf)?;
                let at = (c * KEY_TILE + a) * group;
                let acc = if r { &mut back[..] } else { &mut o[..] };
                rowops::weighted_sum(&s[at..], vs, run.len(), group, dim, acc);
                a = b;
            }
        }
        if let Some(t) = undo {
            for (o, b) in o.chunks_exact_mut(dim).zip(back.chunks_exact_mut(dim)) {
                t.undo_values(b);
                for (x, y) in o.iter_mut().zip(b.iter()) {
                    *x += y;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    /// Keys of the one source 0.
    fn sourced(rows: &[usize]) -> Vec<SourcedKey> {
        rows.iter()
            .map(|&row| SourcedKey { source: 0, row })
            .collect()
    }

    fn tensor(dims: [usize; 3], seed: u32) -> Tensor<3> {
        let mut z = seed.wrapping_mul(2_654_435_761).wrapping_add(7);
        let vals: Vec<f32> = (0..dims.iter().product::<usize>())
            .map(|_| {
                z = z.wrapping_mul(1_103_515_245).wrapping_add(12345);
                ((z >> 8) & 0xffff) as f32 / 32768.0 - 1.0
            })
            .collect();
        Tensor::from_data(TensorData::new(vals, dims), &Device::flex())
    }

    #[test]
    fn a_row_matches_the_tensor_ops_reference() {
        // Four query heads over one key/value head (Gemma 3 270M's grouping), odd sizes.
        let (heads, kvh, s, d) = (4, 1, 37, 72);
        let q = tensor([heads, 3, d], 1);
        // Keys as a view into a larger cache (offset and stride), as the caches hand them out.
        let k_all = tensor([kvh, s + 9, d], 2);
        let v_all = tensor([kvh, s + 9, d], 3);
        let k = k_all.slice([0..kvh, 4..4 + s, 0..d]);
        let v = v_all.slice([0..kvh, 4..4 + s, 0..d]);
        let (qv, kv, vv) = (
            HostView::of(&q).unwrap(),
            HostView::of(&k).unwrap(),
            HostView::of(&v).unwrap(),
        );
        let keys: Vec<usize> = (0..s).filter(|j| j % 5 != 2).collect();
        let scale = 0.125f32;
        let mut out = vec![0.0f32; heads * d];
        attend_row(
            &qv,
            (1, kvh),
            &[RowSource::View { k: kv, v: vv }],
            &sourced(&keys),
            scale,
            &mut out,
        )
        .unwrap();
        // Reference: Burn's ops over the same keys.
        let ids: Vec<i64> = keys.iter().map(|&j| j as i64).collect();
        let ids = Tensor::<1, burn::tensor::Int>::from_data(
            TensorData::new(ids, [keys.len()]),
            &Device::flex(),
        );
        let want = crate::sdpa::grouped_attention(
            q.slice([0..heads, 1..2, 0..d]),
            k.clone().select(1, ids.clone()),
            v.clone().select(1, ids),
            f64::from(scale),
            None,
        );
        let want: Vec<f32> = want.into_data().try_to_vec().unwrap();
        let worst = out
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "max |Δ| {worst}");
    }

    #[test]
    fn f16_keys_and_values_take_the_f32_arithmetic_of_their_rounded_values() {
        // More keys than one tile, a gathered (non-run) key list, and a run.
        let (heads, kvh, s, d) = (4, 1, 150, 72);
        let q = tensor([heads, 2, d], 4);
        let (k, v) = (tensor([kvh, s, d], 5), tensor([kvh, s, d], 6));
        let (k16, v16) = (
            k.clone().cast(burn::tensor::DType::F16),
            v.clone().cast(burn::tensor::DType::F16),
        );
        // The rounded values, held as f32.
        let (kr, vr) = (
            k16.clone().cast(burn::tensor::DType::F32),
            v16.clone().cast(burn::tensor::DType::F32),
        );
        let qv = HostView::of(&q).unwrap();
        let scale = 0.1f32;
        for keys in [
            (0..s).collect::<Vec<_>>(),
            (0..s).filter(|j| j % 3 != 1).collect(),
        ] {
            let run = |k: &Tensor<3>, v: &Tensor<3>| {
                let mut out = vec![0.0f32; heads * d];
                let (k, v) = (HostView::of(k).unwrap(), HostView::of(v).unwrap());
                let keys = sourced(&keys);
                attend_row(
                    &qv,
                    (1, kvh),
                    &[RowSource::View { k, v }],
                    &keys,
                    scale,
                    &mut out,
                )
                .unwrap();
                out
            };
            let (half, rounded, exact) = (run(&k16, &v16), run(&kr, &vr), run(&k, &v));
            assert_eq!(
                half, rounded,
                "the same bits as f32 rows of the rounded values"
            );
            let worst = half
                .iter()
                .zip(&exact)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            // Inputs in [-1, 1] rounded to f16 (relative error ≤ 2^-11): a few 1e-3 at most.
            assert!(worst < 5e-3, "max |Δ| against unrounded f32 {worst}");
        }
    }

    /// Rows held by position from `first` (one KV head), values optionally held as
    /// `−reverse(v)` (an orthogonal map whose inverse changes no bit).
    struct Tier {
        k: Vec<f32>,
        v: Vec<f32>,
        first: usize,
        dim: usize,
        rotated: bool,
    }

    impl HostTier for Tier {
        fn read_head(
            &self,
            part: KvPart,
            _head: usize,
            positions: std::ops::Range<usize>,
            out: &mut [f32],
        ) -> Result<()> {
            let d = self.dim;
            let src = if part == KvPart::K { &self.k } else { &self.v };
            let rows = &src[(positions.start - self.first) * d..(positions.end - self.first) * d];
            out.copy_from_slice(rows);
            if part == KvPart::V && self.rotated {
                for r in out.chunks_exact_mut(d) {
                    r.reverse();
                    r.iter_mut().for_each(|x| *x = -*x);
                }
            }
            Ok(())
        }

        fn values_rotated(&self) -> bool {
            self.rotated
        }

        fn undo_values(&self, row: &mut [f32]) {
            row.reverse();
            row.iter_mut().for_each(|x| *x = -*x);
        }
    }

    #[test]
    fn keys_split_over_views_and_a_tier_give_the_bits_of_one_view() {
        // 150 keys: rows 0..40 and 100..150 from views, 40..100 from a tier (a tile boundary
        // falls inside it), rotated or not.
        let (heads, s, d) = (4, 150, 72);
        let q = tensor([heads, 2, d], 7);
        let (k, v) = (tensor([1, s, d], 8), tensor([1, s, d], 9));
        let qv = HostView::of(&q).unwrap();
        let whole: Vec<f32> = {
            let mut out = vec![0.0f32; heads * d];
            let src = [RowSource::View {
                k: HostView::of(&k).unwrap(),
                v: HostView::of(&v).unwrap(),
            }];
            let keys: Vec<usize> = (0..s).collect();
            attend_row(&qv, (1, 1), &src, &sourced(&keys), 0.1, &mut out).unwrap();
            out
        };
        let host = |t: &Tensor<3>, r: std::ops::Range<usize>| -> Vec<f32> {
            t.clone()
                .slice([0..1, r, 0..d])
                .into_data()
                .try_to_vec::<f32>()
                .unwrap()
        };
        for rotated in [false, true] {
            let tier = Tier {
                k: host(&k, 40..100),
                v: host(&v, 40..100),
                first: 40,
                dim: d,
                rotated,
            };
            let view = |r: std::ops::Range<usize>| RowSource::View {
                k: HostView::of(&k.clone().slice([0..1, r.clone(), 0..d])).unwrap(),
                v: HostView::of(&v.clone().slice([0..1, r, 0..d])).unwrap(),
            };
            let src = [view(0..40), RowSource::Tier(&tier), view(100..s)];
            let keys: Vec<SourcedKey> = (0..40)
                .map(|row| SourcedKey { source: 0, row })
                .chain((40..100).map(|row| SourcedKey { source: 1, row }))
                .chain((0..50).map(|row| SourcedKey { source: 2, row }))
                .collect();
            let mut out = vec![0.0f32; heads * d];
            attend_row(&qv, (1, 1), &src, &keys, 0.1, &mut out).unwrap();
            if rotated {
                // The rotated values' sum is added to the others' once at the end.
                let worst = out
                    .iter()
                    .zip(&whole)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(worst < 1e-5, "rotated tier: max |Δ| {worst}");
            } else {
                assert_eq!(out, whole, "split over sources");
            }
        }
    }
}
