//! Decode-row attention on the CPU, read straight from the caches' buffers: a few query rows
//! over a few hundred keys are too small for a GEMM (Burn's matmul packs the keys and the
//! values for every call, ≈ 11 % of an eight-sequence decode step), so each row's scores,
//! softmax and value sums run here over the buffers in place, as the fixed-order sums of
//! [`kakeya_weights::rowops`]. A row's result depends only on its query and the keys it
//! reads, never on the other rows.

use burn::backend::{BackendTensor, DispatchTensorKind};
use burn::tensor::Tensor;
use kakeya_weights::rowops;

/// A `[heads, rows, dim]` f32 tensor's elements in place (no copy), when it lives in CPU
/// memory (burn-flex) with unit stride along `dim`.
pub struct HostView {
    tensor: burn::backend::flex::FlexTensor,
    offset: usize,
    head_stride: usize,
    row_stride: usize,
    dims: [usize; 3],
}

impl HostView {
    /// The view of `t`, or `None` off the CPU, for other dtypes or layouts.
    pub fn of(t: &Tensor<3>) -> Option<Self> {
        let dims = t.dims();
        let DispatchTensorKind::Flex(BackendTensor::Float(tensor)) = t.clone().into_dispatch().kind
        else {
            return None;
        };
        if tensor.dtype() != burn::tensor::DType::F32 {
            return None;
        }
        let layout = tensor.layout();
        let s = layout.strides();
        if s.len() != 3 || s[2] != 1 || s[0] < 0 || s[1] < 0 {
            return None;
        }
        let (offset, head_stride, row_stride) =
            (layout.start_offset(), s[0] as usize, s[1] as usize);
        Some(Self {
            tensor,
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

    /// Rows `keys` of head `h`, `[keys.len(), dim]`: in place when they are one run of
    /// adjacent rows, else gathered into `buf`.
    pub fn rows<'a>(&'a self, h: usize, keys: &[usize], buf: &'a mut Vec<f32>) -> &'a [f32] {
        let dim = self.dims[2];
        let run = keys.windows(2).all(|w| w[1] == w[0] + 1);
        if let (true, Some(&first)) = (run && self.row_stride == dim, keys.first()) {
            let at = self.offset + h * self.head_stride + first * self.row_stride;
            return &self.tensor.storage::<f32>()[at..at + keys.len() * dim];
        }
        buf.clear();
        for &j in keys {
            buf.extend_from_slice(self.row(h, j));
        }
        buf
    }

    /// Row `r` of head `h` (`dim` values).
    pub fn row(&self, h: usize, r: usize) -> &[f32] {
        let at = self.offset + h * self.head_stride + r * self.row_stride;
        &self.tensor.storage::<f32>()[at..at + self.dims[2]]
    }
}

/// One query position's attention: for every query head `h` (reading key/value head
/// `h / (heads / kv_heads)`), `softmax(scale · q_h·k_j) · v_j` over the keys `keys` (indices
/// into the cached rows, in the order their sums run). Writes `out` (`heads · dim`, heads
/// concatenated). The products are [`kakeya_weights::rowops`]'s fixed-order sums.
///
/// # Shapes
/// - `q`: `[heads, T, dim]` (row `i` is read); `k`, `v`: `[kv_heads, S, dim]`
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
        let ks = k.rows(kvh, keys, &mut kbuf);
        rowops::row_dots(ks, n, &qg, group, dim, &mut s);
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
        let vs = v.rows(kvh, keys, &mut vbuf);
        rowops::weighted_sum(&s, vs, n, group, dim, o);
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
}
