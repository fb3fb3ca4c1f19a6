//! Attention as the formula reads: the yardstick every route of [`Attention::attend`] is tested
//! against ([`AttentionRoute`]). For the query row at position `p` and head `h`, reading the
//! key/value head `h / (heads / kv_heads)`:
//!
//! `out[p, h] = Σ_j softmax_j(scale · q[h, p] · k[j]) · v[j]`
//!
//! over the keys `j` the row sees: not after `p`, within the window on a sliding layer, and
//! allowed by its segment's [`crate::Reach`]. Plain loops over every segment's K/V read whole,
//! the sums in f64. Slow by design; nothing on a decoding path calls it.

use burn::tensor::{Device, Tensor, TensorData};

use super::Attention;
use crate::cache::{DeferredKv, KvLayers, KvPart, KvSegment, SegmentKv};
use crate::error::{ModelError, Result};

/// The ways [`Attention::attend`] computes one sequence's chunk, tried in this order: the first
/// that applies runs. Each gives [`Attention::attend_reference`]'s result within rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionRoute {
    /// On the CPU: row loops over the caches' buffers and quantised tiers read in place
    /// (`attention/host.rs`). The only route for tree rows.
    Host,
    /// Deferred K/V read a tile at a time in tensor operations (a GPU, autodiff, f_θ's
    /// restored rows: `attention/tiled.rs`).
    Tiled,
    /// Each row alone over exactly its keys in tensor operations, for chunks of at most
    /// [`crate::linear::QUANT_MAX_ROWS`] rows (`attention/rows.rs`).
    Rows,
    /// One masked grouped product over every row (long chunks off the CPU).
    Masked,
}

impl AttentionRoute {
    /// Every route, in the order [`Attention::attend`] tries them.
    pub const ALL: [AttentionRoute; 4] = [Self::Host, Self::Tiled, Self::Rows, Self::Masked];
}

/// One segment's K and V on the host, `[kv_heads][n][head_dim]` flattened, in attention form.
struct HostKv {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// A tensor's values as f32 on the host.
fn host_f32<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("a float tensor")
}

impl Attention {
    /// One sequence's chunk of `T` queries at positions `start..start+T` over `segments`, by
    /// the formula alone (module docs). Deferred segments are read whole from cache `layer`
    /// ([`KvLayers::deferred`]), rotated values mapped back first.
    ///
    /// # Shapes
    /// - `q`: `[heads, T, head_dim]` (normed, RoPE'd) → `[T, heads · head_dim]`
    pub fn attend_reference(
        &self,
        q: &Tensor<3>,
        start: usize,
        segments: &[KvSegment],
        (caches, layer): (&mut dyn KvLayers, usize),
        device: &Device,
    ) -> Result<Tensor<2>> {
        let [heads, t, d] = q.dims();
        let groups = heads / self.kv_heads;
        let held = segments
            .iter()
            .map(|s| self.host_kv(s, (&mut *caches, layer), device))
            .collect::<Result<Vec<_>>>()?;
        let q = host_f32(q.clone());
        let mut out = vec![0.0f32; t * heads * d];
        for i in 0..t {
            let p = start + i;
            for h in 0..heads {
                let (g, qh) = (h / groups, &q[(h * t + i) * d..(h * t + i + 1) * d]);
                // (score, segment, row) of every key the row sees.
                let mut seen = Vec::new();
                for (s, (seg, kv)) in segments.iter().zip(&held).enumerate() {
                    for (j, &kp) in seg.positions.iter().enumerate() {
                        if self.sees(p, (kp, seg.reach)) {
                            let k = &kv.k[(g * seg.len() + j) * d..][..d];
                            let dot: f64 = qh.iter().zip(k).map(|(a, b)| (a * b) as f64).sum();
                            seen.push((dot * self.scale, s, j));
                        }
                    }
                }
                if seen.is_empty() {
                    return Err(ModelError::Cache(format!(
                        "layer {layer}: no key for the query at {p}"
                    )));
                }
                let max = seen.iter().map(|e| e.0).fold(f64::NEG_INFINITY, f64::max);
                let mut acc = vec![0.0f64; d];
                let mut total = 0.0f64;
                for &(score, s, j) in &seen {
                    let w = (score - max).exp();
                    total += w;
                    let v = &held[s].v[(g * segments[s].len() + j) * d..][..d];
                    acc.iter_mut().zip(v).for_each(|(a, &x)| *a += w * x as f64);
                }
                let o = &mut out[(i * heads + h) * d..][..d];
                o.iter_mut()
                    .zip(&acc)
                    .for_each(|(o, a)| *o = (a / total) as f32);
            }
        }
        Ok(Tensor::from_data(
            TensorData::new(out, [t, heads * d]),
            device,
        ))
    }

    /// A segment's K and V whole, in attention form, on the host.
    fn host_kv(
        &self,
        seg: &KvSegment,
        (caches, layer): (&mut dyn KvLayers, usize),
        device: &Device,
    ) -> Result<HostKv> {
        let (k, v) = match &seg.kv {
            SegmentKv::Deferred => {
                let first = *seg.positions.first().unwrap_or(&0);
                let at = first..first + seg.len();
                let k = caches.deferred(layer, at.clone(), KvPart::K)?;
                let k = self.ready_tile(k, &seg.positions, KvPart::K, device);
                let v = match caches.deferred(layer, at, KvPart::V)? {
                    DeferredKv::Rotated { v, undo } => {
                        let [kvh, n, d] = v.dims();
                        v.matmul(undo.reshape([1, d, d]).repeat_dim(0, kvh))
                            .reshape([kvh, n, d])
                    }
                    other => self.ready_tile(other, &seg.positions, KvPart::V, device),
                };
                (k, v)
            }
            _ => self.ready(seg, device),
        };
        Ok(HostKv {
            k: host_f32(k),
            v: host_f32(v),
        })
    }
}
