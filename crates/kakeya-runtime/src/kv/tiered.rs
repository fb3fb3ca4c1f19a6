//! Bounded layer caches: sink + recent window exact, evicted positions dropped, quantised or
//! restored ([`TieredCache`]); and every position quantised ([`QuantAllCache`]).
//!
//! Demotion sits behind a commit horizon: the exact ring keeps `window − 1 + slack` positions,
//! so a rollback of up to `slack` positions finds every position it needs exactly; a position is
//! only read from the evicted tier by queries at least `window` younger, and quantised copies
//! are made on write (deterministic, so a position reads the same whether it was written by a
//! prefill chunk, a plain step or a verified block).

use std::ops::Range;

use burn::tensor::{Device, Tensor};
use kakeya_models::{
    CacheSpec, DeferredKv, HostTier, KvPart, KvSegment, LayerCache, ModelError, Reach, SegmentKv,
};

use super::native::{KvDtype, RingCache, check_truncate, in_dtype, seq_slice};
use super::policy::{Evicted, QuantFormat};
use super::quant_tier::{KeyRows, QuantTier, SharedUndo, to_rows};
use super::residual::ResidualTier;
use super::restore::Restorer;
use super::rows::{Bits, Rows};
use super::store::CompactStore;

/// What a bounded layer reads besides its own tiers.
#[derive(Clone, Copy)]
pub struct Shared<'a> {
    /// The compact store (restoration input).
    pub store: Option<&'a CompactStore>,
    /// The restorer, when the mode restores.
    pub restorer: Option<&'a dyn Restorer>,
}

/// Exact sink + window, evicted positions per the policy.
#[derive(Debug, Clone)]
pub struct TieredCache {
    layer: usize,
    spec: CacheSpec,
    sink: usize,
    window: usize,
    evicted: Evicted,
    /// Positions `0..sink`, exactly (a ring that never wraps: sized to hold them all).
    sinks: RingCache,
    ring: RingCache,
    quant: Option<QuantTier>,
    residual: Option<ResidualTier>,
    /// `(kv_heads, head_dim)`, known from the first write.
    shape: (usize, usize),
    len: usize,
}

impl TieredCache {
    /// Layer `layer` (declared `spec`) keeping `sink` + `window` positions exactly (stored as
    /// `dtype`), with `slack` positions of exact rollback; K/V rows are `width` wide, heads
    /// `head_dim` wide; `undo` is the sequence's inverse rotation for that width.
    pub fn new(
        layer: usize,
        spec: CacheSpec,
        (sink, window, slack): (usize, usize, usize),
        (evicted, dtype, undo): (Evicted, KvDtype, SharedUndo),
        (width, head_dim): (usize, usize),
    ) -> Self {
        let undo_residual = undo.clone();
        Self {
            layer,
            spec,
            sink,
            window,
            evicted,
            sinks: RingCache::new(sink + 1, 0).with_dtype(dtype),
            ring: RingCache::starting_at(sink, window, slack).with_dtype(dtype),
            quant: match evicted {
                Evicted::Quantise(format) => Some(QuantTier::new(
                    format,
                    (width, head_dim),
                    sink,
                    undo.clone(),
                )),
                _ => None,
            },
            residual: match evicted {
                Evicted::Residual(format) => Some(ResidualTier::new(
                    format,
                    (width, head_dim),
                    sink,
                    undo_residual,
                )),
                _ => None,
            },
            shape: (0, 0),
            len: 0,
        }
    }

    /// Whether the layer keeps residuals of raw K/V (and so wants each forward's raw rows).
    pub fn wants_raw(&self) -> bool {
        self.residual.is_some()
    }

    /// The raw K/V of the positions the next [`Self::update`] writes (residual tiers).
    ///
    /// # Shapes
    /// - `k_raw`, `v_raw`: `[T, kv_heads · head_dim]`
    pub fn record_raw(
        &mut self,
        k_raw: Tensor<2>,
        v_raw: Tensor<2>,
        start: usize,
    ) -> kakeya_models::Result<()> {
        if start != self.len {
            return Err(ModelError::Cache(format!(
                "layer {}: raw K/V at position {start} but the cache is at {}",
                self.layer, self.len
            )));
        }
        match &mut self.residual {
            Some(r) => r.record(k_raw, v_raw, start),
            None => Ok(()),
        }
    }

    /// Bytes of exact K/V (sinks and window).
    pub fn exact_bytes(&self) -> usize {
        self.sinks.nbytes() + self.ring.nbytes()
    }

    /// The quantised tier of per-token keys, unrotated (inspection and tests): the position
    /// of its first row, K and V rows (`kv_heads · head_dim` wide, keys after RoPE).
    pub fn quantised(&self) -> Option<(usize, &Rows, &Rows)> {
        match self.quant.as_ref()? {
            QuantTier {
                k: KeyRows::Tokens(k),
                v,
                first,
                rotation: None,
                ..
            } => Some((*first, k, v)),
            _ => None,
        }
    }

    /// The quantised tier's K or V of `positions` as attention reads them (dequantised and
    /// rotated back), rows `kv_heads · head_dim` wide (inspection and tests).
    pub fn evicted_rows(&self, positions: Range<usize>, part: KvPart) -> Option<Vec<f32>> {
        let q = self.quant.as_ref()?;
        let (tile, _) = q.read(positions, part, self.shape, &Device::flex()).ok()?;
        match tile {
            DeferredKv::Ready(t) => to_rows(&t).ok(),
            DeferredKv::Rotated { v, .. } => {
                let mut rows = to_rows(&v).ok()?;
                q.rotation.as_ref()?.undo(&mut rows);
                Some(rows)
            }
            DeferredKv::Raw(_) => None,
        }
    }

    /// The exact recent window (inspection and tests).
    pub fn window(&self) -> Option<super::native::HeldKv> {
        self.ring.held()
    }

    /// Bytes of quantised K/V.
    pub fn quantised_bytes(&self) -> usize {
        self.quant.as_ref().map_or(0, QuantTier::nbytes)
            + self.residual.as_ref().map_or(0, ResidualTier::nbytes)
    }

    /// Positions of the evicted tier the queries `start..end` read.
    fn evicted_range(&self, start: usize, end: usize) -> Range<usize> {
        let lo = self.sink.max(self.spec.oldest_needed(start));
        let hi = start.min(end.saturating_sub(self.window));
        lo..hi.max(lo)
    }

    /// [`LayerCache::update`]: the sinks, the evicted tier as a deferred segment (read tile by
    /// tile through [`Self::deferred`]), the window and the chunk. `shared` gives a residual
    /// tier its predictor.
    ///
    /// # Shapes
    /// - `k`, `v`: `[kv_heads, T, head_dim]`
    pub fn update(
        &mut self,
        (k, v): (Tensor<3>, Tensor<3>),
        start: usize,
        shared: Shared<'_>,
    ) -> kakeya_models::Result<Vec<KvSegment>> {
        if start != self.len {
            return Err(ModelError::Cache(format!(
                "layer {}: write at position {start} but the cache is at {}",
                self.layer, self.len
            )));
        }
        if let Some(r) = &mut self.residual {
            r.drop_before(self.spec.oldest_needed(start).max(self.sink));
            r.settle(self.layer, shared)?;
        }
        let [heads, t, dim] = k.dims();
        self.shape = (heads, dim);
        let mut segs = Vec::with_capacity(4);
        if let Some(h) = self.sinks.held_stored() {
            segs.push(KvSegment::ready(h.k, h.v, h.positions, Reach::Always));
        }
        let old = self.evicted_range(start, start + t);
        if let Some(q) = &mut self.quant {
            q.drop_before(self.spec.oldest_needed(start).max(self.sink));
        }
        if !old.is_empty() && self.evicted != Evicted::Drop {
            segs.push(KvSegment {
                kv: SegmentKv::Deferred,
                positions: old.collect(),
                reach: Reach::AtLeast(self.window),
            });
        }
        if let Some(h) = self.ring.held_stored() {
            segs.push(KvSegment::ready(
                h.k,
                h.v,
                h.positions,
                Reach::Younger(self.window),
            ));
        }
        // The chunk's own keys as the exact tiers store them (the same precision a later
        // query reads them at).
        let dt = self.ring.stored_dtype(&k);
        segs.push(KvSegment::ready(
            in_dtype(k.clone(), dt),
            in_dtype(v.clone(), dt),
            (start..start + t).collect(),
            Reach::Always,
        ));
        // Write: positions before the sink boundary to the sinks, the rest to the ring (and,
        // quantised, to the evicted tier).
        let split = self.sink.saturating_sub(start).min(t);
        if split > 0 {
            self.sinks
                .push(seq_slice(&k, 0, split), seq_slice(&v, 0, split), start)?;
        }
        if split < t {
            let (rk, rv) = (seq_slice(&k, split, t), seq_slice(&v, split, t));
            if let Some(q) = &mut self.quant {
                q.push(&rk, &rv)?;
            }
            self.ring.push(rk, rv, start + split)?;
        }
        self.len = start + t;
        Ok(segs)
    }

    /// A tile of the evicted tier (the deferred segment of the last update): dequantised or
    /// restored, with the bytes materialised.
    pub fn deferred(
        &self,
        positions: Range<usize>,
        part: KvPart,
        shared: Shared<'_>,
        device: &Device,
    ) -> kakeya_models::Result<(DeferredKv, usize)> {
        match self.evicted {
            Evicted::Drop => Err(ModelError::Cache(format!(
                "layer {}: evicted positions are dropped",
                self.layer
            ))),
            Evicted::Quantise(_) => self
                .quant
                .as_ref()
                .expect("quantised tier")
                .read(positions, part, self.shape, device),
            Evicted::Residual(_) => self.residual.as_ref().expect("residual tier").read(
                (self.layer, positions),
                part,
                shared,
                device,
            ),
            Evicted::Restore => {
                let r = shared.restorer.ok_or_else(|| {
                    ModelError::Cache(format!("layer {}: no restorer", self.layer))
                })?;
                let raw = r.restore(self.layer, positions, part, shared.store)?;
                // The raw rows and their attention form (k_norm, RoPE) exist together.
                let bytes = 2 * raw.shape().num_elements() * 4;
                Ok((DeferredKv::Raw(raw), bytes))
            }
        }
    }
}

impl HostTier for TieredCache {
    fn read_head(
        &self,
        part: KvPart,
        head: usize,
        positions: Range<usize>,
        out: &mut [f32],
    ) -> kakeya_models::Result<()> {
        let q = self
            .quant
            .as_ref()
            .ok_or_else(|| ModelError::Cache(format!("layer {}: no quantised tier", self.layer)))?;
        q.read_head(part, head, positions, self.shape, out)
    }

    fn values_rotated(&self) -> bool {
        self.quant.as_ref().is_some_and(|q| q.rotation.is_some())
    }

    fn undo_values(&self, row: &mut [f32]) {
        if let Some(r) = self.quant.as_ref().and_then(|q| q.rotation.as_ref()) {
            r.undo(row);
        }
    }
}

impl TieredCache {
    /// The quantised tier as the CPU row loops read it (`None` when evicted positions are
    /// dropped or restored).
    pub fn host_tier(&self) -> Option<&dyn HostTier> {
        self.quant.as_ref().map(|_| self as &dyn HostTier)
    }

    /// Positions recorded.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets positions `>= len`, refusing when a position it needs exactly was demoted.
    pub fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
        check_truncate(len, self.len)?;
        self.ring
            .truncate(len.max(self.sink))
            .map_err(|e| ModelError::Cache(format!("layer {}: {e}", self.layer)))?;
        if len < self.sink {
            self.sinks.truncate(len)?;
        }
        if let Some(q) = &mut self.quant {
            q.truncate(len.max(self.sink))?;
        }
        if let Some(r) = &mut self.residual {
            r.truncate(len.max(self.sink))?;
        }
        self.len = len;
        Ok(())
    }

    /// Every byte held.
    pub fn nbytes(&self) -> usize {
        self.exact_bytes() + self.quantised_bytes()
    }
}

/// Every position quantised on write; attention reads dequantised K/V, the chunk's own included
/// (as llama.cpp does with a quantised cache type).
#[derive(Debug, Clone)]
pub struct QuantAllCache {
    spec: CacheSpec,
    tier: QuantTier,
    shape: (usize, usize),
    device: Option<Device>,
    len: usize,
}

impl QuantAllCache {
    /// A layer declared `spec`, rows `width` wide.
    pub fn new(spec: CacheSpec, bits: Bits, width: usize) -> Self {
        Self {
            spec,
            tier: QuantTier::new(
                QuantFormat::per_token(bits),
                (width, width),
                0,
                SharedUndo::default(),
            ),
            shape: (0, 0),
            device: None,
            len: 0,
        }
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.tier.nbytes()
    }

    /// The positions the queries `start..` read.
    fn read_from(&self, start: usize) -> usize {
        self.spec.oldest_needed(start).max(self.tier.first)
    }
}

impl QuantAllCache {
    /// A tile of the cache's positions, dequantised, with its bytes.
    pub fn deferred_counted(
        &self,
        positions: Range<usize>,
        part: KvPart,
        device: &Device,
    ) -> kakeya_models::Result<(DeferredKv, usize)> {
        self.tier.read(positions, part, self.shape, device)
    }
}

impl HostTier for QuantAllCache {
    fn read_head(
        &self,
        part: KvPart,
        head: usize,
        positions: Range<usize>,
        out: &mut [f32],
    ) -> kakeya_models::Result<()> {
        self.tier.read_head(part, head, positions, self.shape, out)
    }
}

impl LayerCache for QuantAllCache {
    fn update(
        &mut self,
        k: Tensor<3>,
        v: Tensor<3>,
        start: usize,
    ) -> kakeya_models::Result<Vec<KvSegment>> {
        if start != self.len {
            return Err(ModelError::Cache(format!(
                "write at position {start} but the cache is at {}",
                self.len
            )));
        }
        let [heads, t, dim] = k.dims();
        self.shape = (heads, dim);
        self.device = Some(k.device());
        self.tier.drop_before(self.spec.oldest_needed(start));
        self.tier.push(&k, &v)?;
        self.len = start + t;
        let from = self.read_from(start);
        Ok(vec![KvSegment {
            kv: SegmentKv::Deferred,
            positions: (from..self.len).collect(),
            reach: Reach::Always,
        }])
    }

    fn deferred(
        &mut self,
        positions: Range<usize>,
        part: KvPart,
    ) -> kakeya_models::Result<DeferredKv> {
        let device = self.device.clone().unwrap_or_else(Device::flex);
        Ok(self.deferred_counted(positions, part, &device)?.0)
    }

    fn host_tier(&mut self) -> Option<&dyn HostTier> {
        Some(self)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
        check_truncate(len, self.len)?;
        self.tier.truncate(len)?;
        self.len = len;
        Ok(())
    }

    fn nbytes(&self) -> usize {
        self.tier.nbytes()
    }
}
