//! Gemma 3 self-attention: q/k/v projections, per-head q_norm/k_norm, half-split RoPE,
//! grouped-query attention with a causal or sliding mask, o_proj.

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_weights::AttentionKind;
use rayon::prelude::*;

use crate::cache::{DeferredKv, KvLayers, KvPart, KvSegment, Reach, SegmentKv};
use crate::error::{ModelError, Result};
use crate::linear::{Linear, QUANT_MAX_ROWS};
use crate::norm::RmsNorm;
use crate::rope::Rope;
use crate::sdpa::grouped_attention;
use crate::tree_rows::TreeRows;

mod host;
mod reference;
mod rows;
mod tiled;

pub use reference::AttentionRoute;

/// Positions per tile of a deferred segment on a GPU: the most dequantised or restored K (or
/// V) of one layer held at once.
pub const DEFERRED_TILE: usize = 256;

/// Positions per tile of a deferred segment on the CPU: a quarter of [`DEFERRED_TILE`], so that
/// what a prompt chunk materialises stays small beside the quantised tiers it reads.
pub const HOST_DEFERRED_TILE: usize = 64;

/// Query rows attended together on the CPU when they share most of their keys (a prompt
/// chunk or verify block at depth): each tile of keys and values is read once for them all.
pub const SHARED_ROWS: usize = 16;

/// The deferred tile for `device`.
pub fn deferred_tile(device: &Device) -> usize {
    if *device == Device::flex() {
        HOST_DEFERRED_TILE
    } else {
        DEFERRED_TILE
    }
}

/// What one layer's attention produced, for capture.
#[derive(Debug, Clone)]
pub struct AttentionCapture {
    /// q_proj output, `[T, heads · head_dim]` (before q_norm and RoPE).
    pub q_raw: Tensor<2>,
    /// k_proj output, `[T, kv_heads · head_dim]` (before k_norm and RoPE).
    pub k_raw: Tensor<2>,
    /// v_proj output, `[T, kv_heads · head_dim]`.
    pub v_raw: Tensor<2>,
    /// Attention block output after o_proj (before post_attention_layernorm), `[T, hidden]`.
    pub out: Tensor<2>,
}

/// One layer's attention weights and shape facts.
#[derive(Debug, Clone)]
pub struct Attention {
    /// `[heads · head_dim, hidden]`.
    pub q_proj: Linear,
    /// `[kv_heads · head_dim, hidden]`; `None` on a layer that reads another layer's K/V
    /// ([`Self::kv_source`]).
    pub k_proj: Option<Linear>,
    /// `[kv_heads · head_dim, hidden]`; `None` where the values are the raw `k_proj` output
    /// (Gemma 4's `attention_k_eq_v`) or come from another layer.
    pub v_proj: Option<Linear>,
    /// `[hidden, heads · head_dim]`.
    pub o_proj: Linear,
    /// Per-head query norm over `head_dim`.
    pub q_norm: RmsNorm,
    /// Per-head key norm over `head_dim`; a layer with a [`Self::kv_source`] holds its
    /// source's (it turns the source's raw keys into keys when a restorer rebuilds them).
    pub k_norm: RmsNorm,
    /// Gemma 4's weightless per-head value norm (a multiplier of ones); `None` for Gemma 3.
    pub v_norm: Option<RmsNorm>,
    /// The earlier layer whose K/V this layer attends over (Gemma 4's KV sharing); it then
    /// computes only queries, and its own cache holds nothing.
    pub kv_source: Option<usize>,
    /// Whether a later layer reads this layer's K/V ([`Self::kv_source`]).
    pub shares_kv: bool,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Score scale, `query_pre_attn_scalar^-1/2`.
    pub scale: f64,
    /// Full or sliding.
    pub kind: AttentionKind,
    /// Sliding window (used when `kind` is sliding).
    pub window: usize,
    /// RoPE of this layer's kind.
    pub rope: Rope,
    /// Whether this layer's rows take the GPU's attention kernel, decided at load from the
    /// weights' device ([`crate::gpu::kernels_on`]).
    pub on_gpu: bool,
}

impl Attention {
    fn heads_first(&self, x: Tensor<2>, heads: usize) -> Tensor<3> {
        let t = x.dims()[0];
        x.reshape([t, heads, self.head_dim]).swap_dims(0, 1)
    }

    /// Keys from raw k_proj rows: k_norm then RoPE at `positions`.
    ///
    /// # Shapes
    /// - `k_raw`: `[n, kv_heads · head_dim]` → `[kv_heads, n, head_dim]`
    pub fn keys_from_raw(
        &self,
        k_raw: Tensor<2>,
        positions: &[usize],
        device: &Device,
    ) -> Tensor<3> {
        let (cos, sin) = self.rope.tables(positions, device);
        self.k_norm
            .forward_rope(self.heads_first(k_raw, self.kv_heads), &cos, &sin)
    }

    /// Values from raw v_proj (or, with k_eq_v, k_proj) rows: heads first, then Gemma 4's
    /// value norm.
    ///
    /// # Shapes
    /// - `v_raw`: `[n, kv_heads · head_dim]` → `[kv_heads, n, head_dim]`
    fn values_from_raw(&self, v_raw: Tensor<2>) -> Tensor<3> {
        let v = self.heads_first(v_raw, self.kv_heads);
        match &self.v_norm {
            Some(n) => n.forward(v),
            None => v,
        }
    }

    /// May a query at `q` attend to a key at `k`?
    fn visible(&self, q: usize, k: usize) -> bool {
        k <= q && (self.kind == AttentionKind::Full || q - k < self.window)
    }

    /// May a query at `q` attend to `key` (a position and its segment's reach)?
    fn sees(&self, q: usize, (k, reach): (usize, Reach)) -> bool {
        self.visible(q, k) && reach.allows(q, k)
    }

    /// Additive mask `[1, G·T, S]` (rows ordered group-major) over the keys of `segments` in
    /// order, or `None` when every key is visible to every query.
    fn mask(
        &self,
        start: usize,
        t: usize,
        segments: &[KvSegment],
        groups: usize,
        device: &Device,
    ) -> Option<Tensor<3>> {
        let keys = segment_keys(segments);
        if (0..t).all(|i| keys.iter().all(|&key| self.sees(start + i, key))) {
            return None;
        }
        let row: Vec<f32> = (0..t)
            .flat_map(|i| keys.iter().map(move |&key| (start + i, key)))
            .map(|(q, key)| {
                if self.sees(q, key) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let s = keys.len();
        let data: Vec<f32> = (0..groups).flat_map(|_| row.iter().copied()).collect();
        Some(Tensor::from_data(
            TensorData::new(data, [1, groups * t, s]),
            device,
        ))
    }

    /// A segment's K/V in attention form, `[kv_heads, n, head_dim]` each: raw rows get this
    /// layer's k_norm and RoPE at their positions.
    fn ready(&self, seg: &KvSegment, device: &Device) -> (Tensor<3>, Tensor<3>) {
        match &seg.kv {
            SegmentKv::Ready { k, v } => (k.clone(), v.clone()),
            SegmentKv::Raw { k, v } => (
                self.keys_from_raw(k.clone(), &seg.positions, device),
                self.values_from_raw(v.clone()),
            ),
            SegmentKv::Deferred => unreachable!("deferred segments are read tile by tile"),
        }
    }

    /// A deferred tile in attention form, `[kv_heads, n, head_dim]`.
    fn ready_tile(
        &self,
        tile: DeferredKv,
        positions: &[usize],
        part: KvPart,
        device: &Device,
    ) -> Tensor<3> {
        match (tile, part) {
            (DeferredKv::Ready(x), _) | (DeferredKv::Rotated { v: x, .. }, _) => x,
            (DeferredKv::Raw(k), KvPart::K) => self.keys_from_raw(k, positions, device),
            (DeferredKv::Raw(v), KvPart::V) => self.values_from_raw(v),
        }
    }

    /// Attends chunks of several sequences stacked row-wise: the projections, norms and RoPE
    /// run over all rows at once; each span's K/V go to cache `layer` of its own
    /// [`KvLayers`], and each span attends only over what its cache returns. `rope` holds this
    /// layer kind's cos/sin tables for every row (built once per forward by the model). A
    /// layer that [`Self::shares_kv`] leaves each span's segments in `shared` under its index;
    /// a layer with a [`Self::kv_source`] attends over the source's instead of computing K/V.
    ///
    /// # Shapes
    /// - `x`: `[R, hidden]` (after input_layernorm) → `[R, hidden]` (after o_proj)
    /// - `spans`: per sequence, its first absolute position and its rows of `x`
    /// - `rope`: cos and sin, each `[R, head_dim/2]`; with the stacked rows' positions on a
    ///   GPU (the forward's [`crate::gpu::StepInputs`]), which the in-place attention reads
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        x: Tensor<2>,
        spans: &[Span],
        (rope, positions): (&(Tensor<2>, Tensor<2>), Option<(&Tensor<1>, usize)>),
        (kvs, layer): (&mut [&mut dyn KvLayers], usize),
        capture: bool,
        shared: &mut SharedKv,
    ) -> Result<(Tensor<2>, Vec<AttentionCapture>)> {
        let device = x.device();
        let (cos, sin) = rope;
        let (q_raw, q, own) = self.project(x, cos, sin);
        // On a GPU, chunks whose caches are plain buffers: written and attended in place.
        let (fused, in_place) = match own.as_ref() {
            Some((_, _, k, v)) if !self.shares_kv => {
                self.chunks_in_place(&q, (k, v), (spans, positions), (&mut *kvs, layer))
            }
            _ => (None, vec![false; spans.len()]),
        };
        // Each sequence writes its own caches and attends over them: on the CPU the
        // sequences of a stacked forward run in parallel (each result is the same bits on any
        // thread); on a GPU one after another (each launch is the device's).
        let read = &*shared;
        let one = |s: usize, span: &Span, caches: &mut dyn KvLayers| {
            self.span_attention((s, span), caches, (&q, own.as_ref()), layer, read, &device)
        };
        let results: Vec<Result<(Tensor<2>, Option<Vec<KvSegment>>)>> =
            if spans.len() > 1 && !crate::gpu::is_gpu(&device) {
                spans
                    .par_iter()
                    .zip(kvs.par_iter_mut())
                    .enumerate()
                    .map(|(s, (span, caches))| one(s, span, &mut **caches))
                    .collect()
            } else {
                spans
                    .iter()
                    .zip(kvs.iter_mut())
                    .enumerate()
                    .filter(|(s, _)| !in_place[*s])
                    .map(|(s, (span, caches))| one(s, span, &mut **caches))
                    .collect()
            };
        let mut outs = Vec::with_capacity(spans.len());
        let mut mine = Vec::new();
        for res in results {
            let (out, segs) = res?;
            outs.push(out);
            mine.extend(segs);
        }
        // Chunks that went the per-sequence way beside written-in-place ones: into their rows.
        if let Some(mut all) = fused {
            let w = self.heads * self.head_dim;
            let rest = spans.iter().zip(&in_place).filter(|(_, done)| !**done);
            for ((span, _), out) in rest.zip(outs.drain(..)) {
                all = all.slice_assign([span.rows.clone(), 0..w], out);
            }
            outs.push(all);
        }
        if self.shares_kv {
            shared.segments.insert(layer, mine);
            if let Some((k_raw, v_raw, _, _)) = own.as_ref().filter(|_| capture) {
                shared.raw.insert(layer, (k_raw.clone(), v_raw.clone()));
            }
        }
        let attn = if outs.len() == 1 {
            outs.pop().expect("one span")
        } else {
            Tensor::cat(outs, 0)
        };
        let out = self.o_proj.forward(attn);
        if !capture {
            return Ok((out, Vec::new()));
        }
        // A sharing layer reports its source's raw K/V: what it attends over.
        let raw = match (own, self.kv_source) {
            (Some((k_raw, v_raw, _, _)), _) => Some((k_raw, v_raw)),
            (None, Some(src)) => shared.raw.get(&src).cloned(),
            (None, None) => None,
        };
        let Some((k_raw, v_raw)) = raw else {
            return Err(ModelError::Cache(format!(
                "layer {layer}: the raw K/V it reads were not kept in this forward"
            )));
        };
        let caps = spans
            .iter()
            .map(|s| AttentionCapture {
                q_raw: row_range(&q_raw, &s.rows),
                k_raw: row_range(&k_raw, &s.rows),
                v_raw: row_range(&v_raw, &s.rows),
                out: row_range(&out, &s.rows),
            })
            .collect();
        Ok((out, caps))
    }

    /// The projections of the rows `x` (in one launch on a GPU): the raw queries; the
    /// queries normed and rotated; and, when this layer has its own keys, its raw keys and
    /// values and the keys normed and rotated (with the queries, in one launch on a GPU) and
    /// the values through the value norm (v_proj's, or with k_eq_v the raw keys).
    ///
    /// # Shapes
    /// - `x`: `[R, hidden]` → raw queries `[R, heads·head_dim]`, queries
    ///   `[heads, R, head_dim]`; own K/V raw `[R, kv_heads·head_dim]`, normed
    ///   `[kv_heads, R, head_dim]`
    /// - `cos`, `sin`: `[R, head_dim/2]`
    fn project(
        &self,
        x: Tensor<2>,
        cos: &Tensor<2>,
        sin: &Tensor<2>,
    ) -> (Tensor<2>, Tensor<3>, Option<OwnKv>) {
        let mut maps = vec![&self.q_proj];
        maps.extend(&self.k_proj);
        maps.extend(self.k_proj.as_ref().and(self.v_proj.as_ref()));
        let mut raw = Linear::forward_many(&maps, x).into_iter();
        let q_raw = raw.next().expect("q_proj's output");
        let q_heads = self.heads_first(q_raw.clone(), self.heads);
        let (q, own) = match raw.next() {
            Some(k_raw) => {
                let v_raw = raw.next().unwrap_or_else(|| k_raw.clone());
                let k_heads = self.heads_first(k_raw.clone(), self.kv_heads);
                let (q, k) =
                    self.q_norm
                        .forward_rope_qk(q_heads, (&self.k_norm, k_heads), cos, sin);
                let v = self.values_from_raw(v_raw.clone());
                (q, Some((k_raw, v_raw, k, v)))
            }
            None => (self.q_norm.forward_rope(q_heads, cos, sin), None),
        };
        (q_raw, q, own)
    }

    /// Sequence `s`'s chunk: writes its own K/V rows to its cache (when the layer has its
    /// own) and attends its queries over what the cache returns — or over the source layer's
    /// segments kept in `shared`. Returns the attention output and, for a layer that
    /// [`Self::shares_kv`], the segments to keep.
    ///
    /// # Shapes
    /// - `q`: `[heads, R, head_dim]` for every stacked row; the span's rows are taken
    /// - returns `[T, heads·head_dim]` for the span's `T` rows
    fn span_attention(
        &self,
        (s, span): (usize, &Span),
        caches: &mut dyn KvLayers,
        (q, own): (&Tensor<3>, Option<&OwnKv>),
        layer: usize,
        shared: &SharedKv,
        device: &Device,
    ) -> Result<(Tensor<2>, Option<Vec<KvSegment>>)> {
        let r = &span.rows;
        let (segments, read_layer, mine) =
            match (own, self.kv_source) {
                (Some((k_raw, v_raw, k, v)), _) => {
                    if caches.wants_raw(layer) {
                        caches.record_raw(
                            layer,
                            row_range(k_raw, r),
                            row_range(v_raw, r),
                            span.start,
                        )?;
                    }
                    let segs =
                        caches.update(layer, head_rows(k, r), head_rows(v, r), span.start)?;
                    let mine = self.shares_kv.then(|| segs.clone());
                    (segs, layer, mine)
                }
                (None, Some(src)) => {
                    let segs = shared.segments.get(&src).and_then(|per| per.get(s)).ok_or_else(|| {
                    ModelError::Cache(format!(
                        "layer {layer} reads layer {src}'s K/V, which this forward did not keep"
                    ))
                })?;
                    (segs.clone(), src, None)
                }
                (None, None) => unreachable!("a layer without keys reads another's"),
            };
        let out = self.attend(
            head_rows(q, r),
            (span.start, span.tree.as_deref()),
            segments,
            (caches, read_layer),
            device,
        )?;
        Ok((out, mine))
    }

    /// One sequence's chunk of `T` queries at positions `start..start+T` (or, as a `tree`, at
    /// `start` plus each row's depth) over the segments its cache (layer `layer`, or the layer
    /// it shares K/V with) returned.
    ///
    /// # Shapes
    /// - `q`: `[heads, T, head_dim]` (normed, RoPE'd)
    /// - returns `[T, heads · head_dim]` (before o_proj)
    fn attend(
        &self,
        q: Tensor<3>,
        (start, tree): (usize, Option<&TreeRows>),
        segments: Vec<KvSegment>,
        (caches, layer): (&mut dyn KvLayers, usize),
        device: &Device,
    ) -> Result<Tensor<2>> {
        let t = q.dims()[1];
        let segments: Vec<KvSegment> = segments.into_iter().filter(|s| !s.is_empty()).collect();
        if segments.is_empty() {
            return Err(ModelError::Cache(format!(
                "layer {layer}: the cache returned no keys for positions {start}..{}",
                start + t
            )));
        }
        for route in AttentionRoute::ALL {
            if let Some(out) = self.attend_by(
                route,
                &q,
                (start, tree),
                &segments,
                (&mut *caches, layer),
                device,
            )? {
                return Ok(out);
            }
        }
        Err(ModelError::Cache(format!(
            "layer {layer}: tree rows are attended on the CPU over caches it reads in place"
        )))
    }

    /// [`Self::attend`] by one route, `None` where the route does not apply
    /// ([`AttentionRoute`]): the host loops off the CPU (or over a tier without host storage),
    /// the tensor routes for tree rows, the tiled route without deferred segments, the others
    /// with them, the per-row route over more than [`QUANT_MAX_ROWS`] rows. `segments` holds no
    /// empty segment.
    ///
    /// # Shapes
    /// - `q`: `[heads, T, head_dim]` (normed, RoPE'd) → `[T, heads · head_dim]`
    pub fn attend_by(
        &self,
        route: AttentionRoute,
        q: &Tensor<3>,
        (start, tree): (usize, Option<&TreeRows>),
        segments: &[KvSegment],
        (caches, layer): (&mut dyn KvLayers, usize),
        device: &Device,
    ) -> Result<Option<Tensor<2>>> {
        // On the CPU, at any length: each row's loops read the caches' buffers and quantised
        // tiers in place, over exactly the keys the row sees (a causal prompt chunk costs
        // half the square a masked product computes, and a prompt row's bits are those of the
        // same row decoded alone).
        if route == AttentionRoute::Host {
            return self.attend_on_host(q, (start, tree), segments, (caches, layer), device);
        }
        if tree.is_some() {
            return Ok(None);
        }
        let t = q.dims()[1];
        let deferred = segments.iter().any(|s| matches!(s.kv, SegmentKv::Deferred));
        if (route == AttentionRoute::Tiled) != deferred {
            return Ok(None);
        }
        let q = q.clone();
        if route == AttentionRoute::Tiled {
            let (deferred, ready): (Vec<KvSegment>, Vec<KvSegment>) = segments
                .iter()
                .cloned()
                .partition(|s| matches!(s.kv, SegmentKv::Deferred));
            let out = self.tiled_attention(q, start, &ready, &deferred, (caches, layer), device);
            return out.map(Some);
        }
        let ready = segments;
        // Row by row for short chunks (a row's bits do not depend on the other rows); long
        // chunks elsewhere (a GPU, autodiff) take one masked product.
        if route == AttentionRoute::Rows && t > QUANT_MAX_ROWS {
            return Ok(None);
        }
        let (ks, vs): (Vec<_>, Vec<_>) = ready.iter().map(|s| self.ready(s, device)).unzip();
        let (k, v) = (cat_keys(ks), cat_keys(vs));
        if route == AttentionRoute::Rows {
            return Ok(Some(self.attend_rows(q, start, ready, k, v, device)));
        }
        let groups = self.heads / self.kv_heads;
        let mask = self.mask(start, t, ready, groups, device);
        Ok(Some(grouped_attention(
            q,
            as_f32(k),
            as_f32(v),
            self.scale,
            mask,
        )))
    }
}

/// Segments' keys (or values) `[kv_heads, n_i, head_dim]` joined along the positions: in
/// their stored dtype when they share one (16-bit caches stay 16-bit for the host loops),
/// else widened to f32.
fn cat_keys(parts: Vec<Tensor<3>>) -> Tensor<3> {
    let dtype = parts[0].dtype();
    if parts.iter().all(|p| p.dtype() == dtype) {
        return Tensor::cat(parts, 1);
    }
    Tensor::cat(parts.into_iter().map(as_f32).collect(), 1)
}

/// `t` as f32 (a cache's 16-bit K/V for the tensor-op paths, which compute in f32).
fn as_f32(t: Tensor<3>) -> Tensor<3> {
    if t.dtype() == burn::tensor::DType::F32 {
        t
    } else {
        t.cast(burn::tensor::DType::F32)
    }
}

/// Every key of `segments`, in order: its position and its segment's reach.
fn segment_keys(segments: &[KvSegment]) -> Vec<(usize, Reach)> {
    segments
        .iter()
        .flat_map(|s| s.positions.iter().map(move |&k| (k, s.reach)))
        .collect()
}

/// What the layers that share their K/V leave for the layers that read it, in one forward.
#[derive(Debug, Default)]
pub struct SharedKv {
    /// Per source layer, the segments each span's cache returned.
    segments: std::collections::BTreeMap<usize, Vec<Vec<KvSegment>>>,
    /// Per source layer, its raw K and V `[T, kv_heads · head_dim]` (when capturing: a
    /// sharing layer's capture reports the raw K/V it attends over).
    raw: std::collections::BTreeMap<usize, (Tensor<2>, Tensor<2>)>,
}

impl SharedKv {
    /// Nothing shared yet.
    pub fn new() -> Self {
        Self::default()
    }
}

/// One sequence's rows in a stacked forward.
#[derive(Debug, Clone)]
pub struct Span {
    /// Absolute position of the span's first row.
    pub start: usize,
    /// The span's rows of the stacked input.
    pub rows: std::ops::Range<usize>,
    /// The rows as a tree (row `i` at `start + depth(i)`, seeing its ancestors), or `None`
    /// for a causal chunk (row `i` at `start + i`).
    pub tree: Option<std::sync::Arc<TreeRows>>,
}

/// A layer's own K/V for the stacked rows: raw keys and values `[R, kv_heads·head_dim]`, then
/// keys normed and rotated and values normed, `[kv_heads, R, head_dim]`.
type OwnKv = (Tensor<2>, Tensor<2>, Tensor<3>, Tensor<3>);

/// Rows `r` of a row-major `[R, width]` tensor.
fn row_range(t: &Tensor<2>, r: &std::ops::Range<usize>) -> Tensor<2> {
    let w = t.dims()[1];
    t.clone().slice([r.clone(), 0..w])
}

/// Rows `r` of a heads-first `[heads, R, head_dim]` tensor.
fn head_rows(t: &Tensor<3>, r: &std::ops::Range<usize>) -> Tensor<3> {
    let [h, _, d] = t.dims();
    t.clone().slice([0..h, r.clone(), 0..d])
}
