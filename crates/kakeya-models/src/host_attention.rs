//! Decode-row attention on the CPU, read straight from the caches' buffers: a few query rows
//! over a few hundred keys are too small for a GEMM (Burn's matmul packs the keys and the
//! values for every call, ≈ 11 % of an eight-sequence decode step), so each row's scores,
//! softmax and value sums run here over the buffers in place, as the fixed-order sums of
//! [`kakeya_weights::rowops`]. A row's result depends only on its query and the keys it
//! reads, never on the other rows.

use burn::backend::{BackendTensor, DispatchTensorKind};
use burn::tensor::Tensor;
use kakeya_weights::rowops;

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
        let at = |j: usize| self.offset + h * self.head_stride + j * self.row_stride;
        if self.half {
            use half::slice::HalfFloatSliceExt;
            let src = self.tensor.storage::<half::f16>();
            buf.resize(keys.len() * dim, 0.0);
            match keys.first() {
                Some(&first) if run => {
                    let a = at(first);
                    src[a..a + keys.len() * dim].convert_to_f32_slice(buf);
                }
                _ => {
                    for (o, &j) in buf.chunks_exact_mut(dim).zip(keys) {
                        src[at(j)..at(j) + dim].convert_to_f32_slice(o);
                    }
                }
            }
            return buf;
        }
        if let (true, Some(&first)) = (run, keys.first()) {
            return &self.tensor.storage::<f32>()[at(first)..at(first) + keys.len() * dim];
        }
        buf.clear();
        for &j in keys {
            buf.extend_from_slice(self.row(h, j));
        }
        buf
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

/// One query position's attention: for every query head `h` (reading key/value head
/// `h / (heads / kv_heads)`), `softmax(scale · q_h·k_j) · v_j` over the keys `keys` (indices
/// into the cached rows, in the order their sums run). Writes `out` (`heads · dim`, heads
/// concatenated). The products are [`kakeya_weights::rowops`]'s fixed-order sums, run over
/// tiles of [`KEY_TILE`] keys (f16 keys and values widened to f32 a tile at a time); the
/// tiling changes no sum's order, so f32 and f16-rounded inputs take the same arithmetic.
///
/// # Shapes
/// - `q`: `[heads, T, dim]` (row `i` is read, f32); `k`, `v`: `[kv_heads, S, dim]` (f32 or f16)
pub fn attend_row(
    q: &HostView,
    i: usize,
    k: &HostView,
    v: &HostView,
    keys: &[usize],
    scale: f32,
    out: &mut [f32],
) {
    let [heads, _, dim] = q.dims();
    let group = heads / k.dims()[0];
    let n = keys.len();
    let mut qg = vec![0.0f32; group * dim];
    let mut s = vec![0.0f32; n * group];
    let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
    for kvh in 0..k.dims()[0] {
        for g in 0..group {
            qg[g * dim..(g + 1) * dim].copy_from_slice(q.row(kvh * group + g, i));
        }
        for (c, tile) in keys.chunks(KEY_TILE).enumerate() {
            let ks = k.rows(kvh, tile, &mut kbuf);
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
        for (c, tile) in keys.chunks(KEY_TILE).enumerate() {
            let vs = v.rows(kvh, tile, &mut vbuf);
            let at = c * KEY_TILE * group;
            rowops::weighted_sum(&s[at..], vs, tile.len(), group, dim, o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

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
        attend_row(&qv, 1, &kv, &vv, &keys, scale, &mut out);
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
                let (kv, vv) = (HostView::of(k).unwrap(), HostView::of(v).unwrap());
                attend_row(&qv, 1, &kv, &vv, &keys, scale, &mut out);
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
}
