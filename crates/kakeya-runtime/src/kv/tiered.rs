//! Bounded layer caches: sink + recent window exact, evicted positions dropped, quantised or
//! restored ([`TieredCache`]); and every position quantised ([`QuantAllCache`]).
//!
//! Demotion sits behind a commit horizon: the exact ring keeps `window − 1 + slack` positions,
//! so a rollback of up to `slack` positions finds every position it needs exactly; a position is
//! only read from the evicted tier by queries at least `window` younger, and quantised copies
//! are made on write (deterministic, so a position reads the same whether it was written by a
//! prefill chunk, a plain step or a verified block).

use std::ops::Range;

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::{
    CacheSpec, DeferredKv, HostTier, KvPart, KvSegment, LayerCache, ModelError, Reach, SegmentKv,
};

use super::channels::ChannelRows;
use super::native::{KvDtype, RingCache, check_truncate, in_dtype, seq_slice};
use super::policy::Evicted;
use super::policy::{QuantFormat, Ranges};
use super::restore::Restorer;
use super::rotation::Rotation;
use super::rows::{Bits, MAX_GROUP, QuantRows, Rows};

/// Seed of the rotation's signs: fixed, so a cache's contents never depend on the run.
const ROTATION_SEED: u64 = 0x6b61_6b65_7961;
use super::store::CompactStore;

/// What a bounded layer reads besides its own tiers.
#[derive(Clone, Copy)]
pub struct Shared<'a> {
    /// The compact store (restoration input).
    pub store: Option<&'a CompactStore>,
    /// The restorer, when the mode restores.
    pub restorer: Option<&'a dyn Restorer>,
}

/// `[kv_heads, T, head_dim]` → host rows `[T, kv_heads · head_dim]`.
fn to_rows(t: &Tensor<3>) -> kakeya_models::Result<Vec<f32>> {
    let [h, n, d] = t.dims();
    t.clone()
        .swap_dims(0, 1)
        .reshape([n, h * d])
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| ModelError::Cache(format!("K/V rows: {e:?}")))
}

/// Host rows `[n, kv_heads · head_dim]` → `[kv_heads, n, head_dim]`.
fn from_rows(rows: Vec<f32>, heads: usize, dim: usize, device: &Device) -> Tensor<3> {
    let n = rows.len() / (heads * dim);
    Tensor::<3>::from_data(TensorData::new(rows, [n, heads, dim]), device).swap_dims(0, 1)
}

/// The inverse rotation of a head width, made once and shared by a sequence's layers.
pub type SharedUndo = std::sync::Arc<std::sync::OnceLock<Tensor<2>>>;

/// Quantised keys: per token (groups of 64 values) or per channel over blocks of positions.
#[derive(Debug, Clone)]
enum KeyRows {
    Tokens(Rows),
    Channels(ChannelRows),
}

/// Quantised K/V rows of positions `first..first + rows` (keys per channel: from the first
/// complete block on). With a rotation, what is grouped per token is rotated: values, and keys
/// when they are grouped per token (per-channel groups already give each channel its own step:
/// on the default model's global layers a rotation changes their error by under 1 %).
#[derive(Debug, Clone)]
struct QuantTier {
    k: KeyRows,
    v: Rows,
    first: usize,
    rotation: Option<Rotation>,
    /// The rotation's inverse as a `[head_dim, head_dim]` matrix, made at the first read off
    /// the CPU (a GPU's tensor path) and shared by the sequence's layers of this head width
    /// (counted once, by the sequence).
    undo: SharedUndo,
}

impl QuantTier {
    /// A tier in `format` for rows `width` wide (heads `head_dim` wide, for the rotation)
    /// whose first position is `first`.
    fn new(
        format: QuantFormat,
        (width, head_dim): (usize, usize),
        first: usize,
        undo: SharedUndo,
    ) -> Self {
        let rotation = format
            .rotate
            .then(|| Rotation::new(head_dim, ROTATION_SEED))
            .flatten();
        // Rotated rows: one group per head (the rotation spreads every channel's range over
        // all of the head's, so one scale serves them; a quarter of the parameters of groups
        // of 64 at 256-wide heads).
        let fitted = format.ranges == Ranges::Fitted;
        let tokens = |bits| {
            let rows = match &rotation {
                Some(_) if head_dim <= MAX_GROUP => QuantRows::with_group(bits, width, head_dim),
                _ => QuantRows::new(bits, width),
            };
            Rows::Quant(if fitted { rows.fitted() } else { rows })
        };
        Self {
            k: if format.k_per_channel {
                let rows = ChannelRows::new(format.k_bits, width, first);
                KeyRows::Channels(if fitted { rows.fitted() } else { rows })
            } else {
                KeyRows::Tokens(tokens(format.k_bits))
            },
            v: tokens(format.v_bits),
            first,
            rotation,
            undo,
        }
    }

    /// Quantises and appends positions `end()..end() + T`.
    fn push(&mut self, k: &Tensor<3>, v: &Tensor<3>) -> kakeya_models::Result<()> {
        let (mut k, mut v) = (to_rows(k)?, to_rows(v)?);
        if let Some(r) = &self.rotation {
            if matches!(self.k, KeyRows::Tokens(_)) {
                r.apply(&mut k);
            }
            r.apply(&mut v);
        }
        match &mut self.k {
            KeyRows::Tokens(rows) => rows.push(&k),
            KeyRows::Channels(rows) => rows.push(&k),
        }
        self.v.push(&v);
        Ok(())
    }

    /// Forgets rows of positions before `pos` (never read again).
    fn drop_before(&mut self, pos: usize) {
        // Compact in steps of 64 rows: a drain moves the whole buffer.
        let dead = pos.saturating_sub(self.first).min(self.v.len());
        if dead >= 64 {
            if let KeyRows::Tokens(rows) = &mut self.k {
                rows.drop_front(dead);
            }
            self.v.drop_front(dead);
            self.first += dead;
        }
        if let KeyRows::Channels(rows) = &mut self.k {
            rows.drop_before(pos);
        }
    }

    fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
        if len < self.first {
            return Err(ModelError::Cache(format!(
                "cannot roll back to {len}: quantised positions before {} were already dropped",
                self.first
            )));
        }
        match &mut self.k {
            KeyRows::Tokens(rows) => rows.truncate(len - self.first),
            KeyRows::Channels(rows) => rows.truncate(len)?,
        }
        self.v.truncate(len - self.first);
        Ok(())
    }

    /// K or V rows of `positions` (`[n, kv_heads · head_dim]`) into `out`: dequantised,
    /// rotated per-token keys rotated back, values left as stored (rotated or not).
    fn read_rows_into(
        &self,
        positions: Range<usize>,
        part: KvPart,
        out: &mut [f32],
    ) -> kakeya_models::Result<()> {
        if positions.start < self.first || positions.end > self.first + self.v.len() {
            return Err(ModelError::Cache(format!(
                "quantised tier holds positions {}..{}, asked for {positions:?}",
                self.first,
                self.first + self.v.len()
            )));
        }
        let (a, b) = (positions.start - self.first, positions.end - self.first);
        match (part, &self.k) {
            (KvPart::K, KeyRows::Tokens(rows)) => rows.read_into(a, b, out),
            (KvPart::K, KeyRows::Channels(rows)) => {
                rows.read_into(positions.start, positions.end, out)?
            }
            (KvPart::V, _) => self.v.read_into(a, b, out),
        }
        if let (Some(r), KvPart::K, KeyRows::Tokens(_)) = (&self.rotation, part, &self.k) {
            r.undo(out);
        }
        Ok(())
    }

    /// Dequantised K or V of `positions`, `[kv_heads, n, head_dim]`, and its bytes.
    fn read(
        &self,
        positions: Range<usize>,
        part: KvPart,
        (heads, dim): (usize, usize),
        device: &Device,
    ) -> kakeya_models::Result<(DeferredKv, usize)> {
        let mut rows = vec![0.0f32; positions.len() * heads * dim];
        self.read_rows_into(positions, part, &mut rows)?;
        let bytes = rows.len() * 4;
        // Rotated values: on the CPU rotated back row by row here (a fast transform, no
        // matrix held); elsewhere they go to attention as they are, with the inverse rotation
        // as a matrix applied to their weighted sum.
        if let (Some(r), KvPart::V) = (&self.rotation, part) {
            if *device == Device::flex() {
                r.undo(&mut rows);
                return Ok((
                    DeferredKv::Ready(from_rows(rows, heads, dim, device)),
                    bytes,
                ));
            }
            let undo = self.undo.get_or_init(|| r.undo_matrix(device)).clone();
            let v = from_rows(rows, heads, dim, device);
            return Ok((DeferredKv::Rotated { v, undo }, bytes));
        }
        Ok((
            DeferredKv::Ready(from_rows(rows, heads, dim, device)),
            bytes,
        ))
    }

    /// Head `head` of K or V of `positions` into `out` (`[n, head_dim]`), as
    /// [`HostTier::read_head`] hands it to the CPU row loops.
    fn read_head(
        &self,
        part: KvPart,
        head: usize,
        positions: Range<usize>,
        (heads, dim): (usize, usize),
        out: &mut [f32],
    ) -> kakeya_models::Result<()> {
        if heads == 1 {
            return self.read_rows_into(positions, part, out);
        }
        let mut all = vec![0.0f32; positions.len() * heads * dim];
        self.read_rows_into(positions, part, &mut all)?;
        for (o, row) in out.chunks_exact_mut(dim).zip(all.chunks_exact(heads * dim)) {
            o.copy_from_slice(&row[head * dim..(head + 1) * dim]);
        }
        Ok(())
    }

    fn nbytes(&self) -> usize {
        let k = match &self.k {
            KeyRows::Tokens(rows) => rows.nbytes(),
            KeyRows::Channels(rows) => rows.nbytes(),
        };
        k + self.v.nbytes()
    }
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
        Self {
            layer,
            spec,
            sink,
            window,
            evicted,
            sinks: RingCache::new(sink + 1, 0).with_dtype(dtype),
            ring: RingCache::starting_at(sink, window, slack).with_dtype(dtype),
            quant: match evicted {
                Evicted::Quantise(format) => {
                    Some(QuantTier::new(format, (width, head_dim), sink, undo))
                }
                _ => None,
            },
            shape: (0, 0),
            len: 0,
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
    }

    /// Positions of the evicted tier the queries `start..end` read.
    fn evicted_range(&self, start: usize, end: usize) -> Range<usize> {
        let lo = self.sink.max(self.spec.oldest_needed(start));
        let hi = start.min(end.saturating_sub(self.window));
        lo..hi.max(lo)
    }

    /// [`LayerCache::update`]: the sinks, the evicted tier as a deferred segment (read tile by
    /// tile through [`Self::deferred`]), the window and the chunk.
    ///
    /// # Shapes
    /// - `k`, `v`: `[kv_heads, T, head_dim]`
    pub fn update(
        &mut self,
        k: Tensor<3>,
        v: Tensor<3>,
        start: usize,
    ) -> kakeya_models::Result<Vec<KvSegment>> {
        if start != self.len {
            return Err(ModelError::Cache(format!(
                "layer {}: write at position {start} but the cache is at {}",
                self.layer, self.len
            )));
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
