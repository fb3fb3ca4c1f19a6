//! A stacked forward's chunks written and attended in place on a GPU: one launch per sequence
//! and layer ([`crate::gpu::span_attention`]) where its cache hands out plain buffers
//! ([`crate::cache::LayerCache::in_place`]).

use burn::tensor::Tensor;
use kakeya_weights::AttentionKind;

use super::attention::{Attention, Span};
use crate::cache::KvLayers;
use crate::gpu::{self, ChunkSlots, GPU_ROWS_MAX};

impl Attention {
    /// Each chunk of `spans` whose cache takes it in place ([`KvLayers::in_place`]) written into
    /// that cache and attended in one launch, into one output for the forward; returns that
    /// output (`None`: no chunk went this way) and which chunks did. The others (off a GPU,
    /// with Burn's fusion, prompt chunks of more than [`GPU_ROWS_MAX`] rows, caches that are
    /// not plain buffers) are left to [`Attention::forward`]'s per-sequence path.
    ///
    /// # Shapes
    /// - `q`: `[heads, R, head_dim]`, `kv`: two `[kv_heads, R, head_dim]` (normed, rotated)
    ///   → `[R, heads · head_dim]` (the rows of the chunks that went this way)
    pub(super) fn chunks_in_place(
        &self,
        q: &Tensor<3>,
        (k, v): (&Tensor<3>, &Tensor<3>),
        (spans, positions): (&[Span], Option<(&Tensor<1>, usize)>),
        (kvs, layer): (&mut [&mut dyn KvLayers], usize),
    ) -> (Option<Tensor<2>>, Vec<bool>) {
        let mut done = vec![false; spans.len()];
        let Some(positions) = positions.filter(|_| gpu::writes_in_place(q)) else {
            return (None, done);
        };
        let window = match self.kind {
            AttentionKind::Sliding => self.window,
            AttentionKind::Full => 0,
        };
        // v_proj's columns of the joint product: made dense once, at the first chunk that
        // goes this way (none may: bounded caches, prompt chunks).
        let mut v_dense = None;
        let mut out = None;
        for ((span, caches), done) in spans.iter().zip(kvs.iter_mut()).zip(&mut done) {
            let r = &span.rows;
            if r.len() > GPU_ROWS_MAX {
                continue;
            }
            let like = k
                .clone()
                .slice([0..self.kv_heads, r.clone(), 0..self.head_dim]);
            let Some(place) = caches.in_place(layer, span.start, &like) else {
                continue;
            };
            let at = ChunkSlots {
                row0: r.start,
                t: r.len(),
                start: span.start,
                origin: place.origin,
                modulus: place.modulus,
                window,
            };
            let v = v_dense.get_or_insert_with(|| gpu::dense(v.clone()));
            let cache = (&place.k, &place.v);
            out = Some(
                gpu::span_attention(q, k, v, cache, positions, out.take(), self.scale, at)
                    .expect("span_attention runs where writes_in_place holds"),
            );
            *done = true;
        }
        (out, done)
    }
}
