//! [`Attention::attend`] over deferred segments with tensor ops (a GPU, autodiff, or a cache
//! whose deferred K/V have no host tier to read in place, as f_θ's restored rows): deferred K/V
//! read a tile at a time.

use burn::tensor::{Device, Tensor};

use super::{Attention, as_f32, cat_keys, deferred_tile};
use crate::cache::{DeferredKv, KvLayers, KvPart, KvSegment};
use crate::error::Result;
use crate::sdpa::{group_queries, merge_heads, scores};

impl Attention {
    /// Attention over ready segments and deferred ones read tile by tile: the scores of every
    /// key (one softmax over the whole row, as [`crate::sdpa::grouped_attention`]), then the values of each
    /// tile. Only one tile of deferred K or V is held at a time.
    ///
    /// # Shapes
    /// - `q`: `[heads, T, head_dim]` → `[T, heads · head_dim]`
    #[allow(clippy::too_many_arguments)]
    pub(super) fn tiled_attention(
        &self,
        q: Tensor<3>,
        start: usize,
        ready: &[KvSegment],
        deferred: &[KvSegment],
        kv: (&mut dyn KvLayers, usize),
        device: &Device,
    ) -> Result<Tensor<2>> {
        let (caches, layer) = kv;
        let t = q.dims()[1];
        let groups = self.heads / self.kv_heads;
        let order: Vec<KvSegment> = ready.iter().chain(deferred).cloned().collect();
        let mask = self.mask(start, t, &order, groups, device);
        let qg = group_queries(q, self.kv_heads);
        let mut parts = Vec::new();
        let mut v_ready = None;
        if !ready.is_empty() {
            let (ks, vs): (Vec<_>, Vec<_>) = ready.iter().map(|s| self.ready(s, device)).unzip();
            parts.push(scores(qg.clone(), as_f32(cat_keys(ks)), self.scale));
            v_ready = Some(as_f32(cat_keys(vs)));
        }
        let tile_len = deferred_tile(device);
        let tiles: Vec<(usize, usize, &KvSegment)> = deferred
            .iter()
            .flat_map(|s| {
                (0..s.len())
                    .step_by(tile_len)
                    .map(move |a| (a, (a + tile_len).min(s.len()), s))
            })
            .collect();
        let range =
            |(a, b, s): (usize, usize, &KvSegment)| s.positions[a]..s.positions[a] + (b - a);
        for &tile in &tiles {
            let (a, b, s) = tile;
            let k = caches.deferred(layer, range(tile), KvPart::K)?;
            let k = self.ready_tile(k, &s.positions[a..b], KvPart::K, device);
            parts.push(scores(qg.clone(), k, self.scale));
        }
        let mut sc = Tensor::cat(parts, 2);
        if let Some(m) = mask {
            sc = sc + m;
        }
        let p = burn::tensor::activation::softmax(sc, 2);
        let [kvh, gt, total] = p.dims();
        let mut col = 0;
        let mut out = None;
        let mut add = |w: Tensor<3>, v: Tensor<3>, col: &mut usize| {
            let n = v.dims()[1];
            let o = crate::gpu::matmul(w.slice([0..kvh, 0..gt, *col..*col + n]), v);
            *col += n;
            out = Some(match out.take() {
                Some(acc) => acc + o,
                None => o,
            });
        };
        if let Some(v) = v_ready {
            add(p.clone(), v, &mut col);
        }
        // Rotated values: their weighted sums apart, mapped back once at the end.
        let mut rotated: Option<(Tensor<3>, Tensor<2>)> = None;
        for &tile in &tiles {
            let (a, b, s) = tile;
            match caches.deferred(layer, range(tile), KvPart::V)? {
                DeferredKv::Rotated { v, undo } => {
                    let n = v.dims()[1];
                    let o = crate::gpu::matmul(p.clone().slice([0..kvh, 0..gt, col..col + n]), v);
                    col += n;
                    rotated = Some(match rotated.take() {
                        Some((acc, u)) => (acc + o, u),
                        None => (o, undo),
                    });
                }
                v => {
                    let v = self.ready_tile(v, &s.positions[a..b], KvPart::V, device);
                    add(p.clone(), v, &mut col);
                }
            }
        }
        debug_assert_eq!(col, total);
        let mut out = out;
        if let Some((acc, undo)) = rotated {
            let d = undo.dims()[0];
            let back = crate::gpu::matmul(acc, undo.reshape([1, d, d]).repeat_dim(0, kvh));
            out = Some(match out.take() {
                Some(o) => o + back,
                None => back,
            });
        }
        Ok(merge_heads(out.expect("at least one key"), self.heads))
    }
}
