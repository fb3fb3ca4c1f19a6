//! The interface between a model's attention and the caller-owned KV caches.
//!
//! A model declares one [`CacheSpec`] per layer: what its attention needs. The caller (the
//! runtime) decides what it keeps — every position exactly, a sink + recent window, older
//! positions quantised or rebuilt from a compact store — and hands attention the tiers it holds
//! as [`KvSegment`]s, each with its keys' absolute positions and the queries that may read them.
//! The model's math knows nothing of the policy.

use std::ops::Range;

use burn::tensor::Tensor;

use crate::error::Result;

/// What one layer's cache must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSpec {
    /// Every position (full-attention layer).
    Full,
    /// The last `window` positions suffice (sliding layer: query `q` sees keys `k > q - window`).
    Sliding {
        /// Attention window.
        window: usize,
    },
    /// Nothing: the layer attends over layer `source`'s K/V (Gemma 4's KV sharing).
    Shared {
        /// The layer whose cache holds the K/V.
        source: usize,
        /// Its attention window (`None`: full attention).
        window: Option<usize>,
    },
}

impl CacheSpec {
    /// The oldest position a query at `q` can attend to.
    pub fn oldest_needed(&self, q: usize) -> usize {
        match *self {
            CacheSpec::Full | CacheSpec::Shared { window: None, .. } => 0,
            CacheSpec::Sliding { window }
            | CacheSpec::Shared {
                window: Some(window),
                ..
            } => (q + 1).saturating_sub(window),
        }
    }
}

/// Which queries may read a segment's keys, on top of the layer's own causal / sliding rule.
/// The age of key `k` for query `q` is `q - k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Every query the layer's rule allows.
    Always,
    /// Queries for which the key is younger than `age` (the exact recent window).
    Younger(usize),
    /// Queries for which the key is at least `age` old (a degraded copy of an evicted key).
    AtLeast(usize),
}

impl Reach {
    /// May a query at `q` read a key at `k` (`k <= q`)?
    pub fn allows(&self, q: usize, k: usize) -> bool {
        match *self {
            Reach::Always => true,
            Reach::Younger(age) => q - k < age,
            Reach::AtLeast(age) => q - k >= age,
        }
    }
}

/// The form a segment's K/V are in.
#[derive(Debug, Clone)]
pub enum SegmentKv {
    /// As attention uses them: keys after k_norm and RoPE at their positions, values as
    /// projected. `k`, `v`: `[kv_heads, n, head_dim]`.
    Ready {
        /// Keys.
        k: Tensor<3>,
        /// Values.
        v: Tensor<3>,
    },
    /// Raw k_proj / v_proj outputs (e.g. rebuilt by a restorer); the layer applies its own
    /// k_norm and RoPE. `k`, `v`: `[n, kv_heads · head_dim]`.
    Raw {
        /// Raw keys.
        k: Tensor<2>,
        /// Raw values.
        v: Tensor<2>,
    },
    /// Produced on demand, a tile of positions and one of K or V at a time, by
    /// [`KvLayers::deferred`] (dequantised or restored K/V): attention never holds more than one
    /// tile of them.
    Deferred,
}

/// Keys or values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvPart {
    /// Keys.
    K,
    /// Values.
    V,
}

/// One tile of a deferred segment.
// One value per tile, moved once: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum DeferredKv {
    /// As attention uses it, `[kv_heads, n, head_dim]` (keys after k_norm and RoPE).
    Ready(Tensor<3>),
    /// Raw k_proj / v_proj rows, `[n, kv_heads · head_dim]`: the layer applies k_norm and RoPE.
    Raw(Tensor<2>),
    /// Values in a rotated basis, `[kv_heads, n, head_dim]`: attention sums them weighted as
    /// they are and maps the sum back with `undo` (`[head_dim, head_dim]`, right-multiplied:
    /// `x = y · undo` for a row `y`), once per query row instead of once per value row.
    Rotated {
        /// The rotated values.
        v: Tensor<3>,
        /// The inverse rotation.
        undo: Tensor<2>,
    },
}

/// One tier of keys/values attention reads.
#[derive(Debug, Clone)]
pub struct KvSegment {
    /// The keys and values.
    pub kv: SegmentKv,
    /// Absolute position of each of the `n` keys.
    pub positions: Vec<usize>,
    /// Which queries may read them.
    pub reach: Reach,
}

impl KvSegment {
    /// Ready K/V (`[kv_heads, n, head_dim]`) at `positions`.
    pub fn ready(k: Tensor<3>, v: Tensor<3>, positions: Vec<usize>, reach: Reach) -> Self {
        Self {
            kv: SegmentKv::Ready { k, v },
            positions,
            reach,
        }
    }

    /// Keys in the segment.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// True when the segment holds no key.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }
}

/// A chunk's place in a cache that attention writes and reads in place, in one kernel on a
/// GPU ([`LayerCache::in_place`], [`crate::gpu::span_attention`]).
#[derive(Debug, Clone)]
pub struct InPlace {
    /// Keys, `[kv_heads, slots, head_dim]`: dense, held by the cache alone (its buffer).
    pub k: Tensor<3>,
    /// Values, as `k`.
    pub v: Tensor<3>,
    /// Position `p` lives in slot `(p − origin) % modulus`.
    pub origin: usize,
    /// See `origin`.
    pub modulus: usize,
}

/// A deferred segment's K/V read on the CPU straight from the cache's own storage
/// (quantised codes), a tile of positions at a time, by the row loops of
/// [`crate::host_attention`]: no tensor is built for them.
pub trait HostTier: Sync {
    /// Head `head` of `part` at absolute `positions` (inside the deferred segment) as f32 rows
    /// `[positions.len, head_dim]`, written into `out` (exactly that long). Keys come back as
    /// attention reads them; values in the basis [`HostTier::undo_values`] maps back from.
    fn read_head(
        &self,
        part: KvPart,
        head: usize,
        positions: Range<usize>,
        out: &mut [f32],
    ) -> Result<()>;

    /// Whether the values come back rotated: attention sums them as they are, then maps each
    /// head's sum back with [`HostTier::undo_values`].
    fn values_rotated(&self) -> bool {
        false
    }

    /// Maps one head's weighted sum of rotated values (`head_dim`) back, in place.
    fn undo_values(&self, row: &mut [f32]) {
        let _ = row;
    }
}

/// One layer's KV store, owned by the caller.
pub trait LayerCache: Send {
    /// Records the K/V of positions `start..start + T` (the chunk being computed) and returns
    /// the segments attention over those queries reads: whatever tiers the cache holds for
    /// earlier positions, and the chunk's own keys (read by every query of the chunk that the
    /// layer's rule allows, unless the cache degrades them too).
    ///
    /// # Shapes
    /// - `k`, `v`: `[kv_heads, T, head_dim]` (keys after k_norm and RoPE)
    fn update(&mut self, k: Tensor<3>, v: Tensor<3>, start: usize) -> Result<Vec<KvSegment>>;

    /// Positions recorded so far (the next position to write).
    fn len(&self) -> usize;

    /// True when nothing has been recorded.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every position `>= len`, exactly: afterwards the cache behaves as if it had
    /// only ever seen positions `< len`. A cache that can no longer do that (it already
    /// demoted a position the rollback would need exactly) refuses with an error.
    fn truncate(&mut self, len: usize) -> Result<()>;

    /// Bytes the cache holds (allocated buffers, every tier; not a formula of positions).
    fn nbytes(&self) -> usize;

    /// Instead of [`LayerCache::update`], where the cache allows it: records positions
    /// `start..start + T` as written and returns its buffers, which the caller's kernel then
    /// writes the chunk into and reads every position the chunk's queries see from, before
    /// anything else reads the cache. `like` (`[kv_heads, T, head_dim]`) gives the shape and
    /// device. `None` (the default) where the cache cannot (not its next position, tiers that
    /// are not plain buffers, a ring write that would overwrite a slot the chunk still reads):
    /// the caller then goes through `update`.
    fn in_place(&mut self, start: usize, like: &Tensor<3>) -> Option<InPlace> {
        let _ = (start, like);
        None
    }

    /// A tile of the [`SegmentKv::Deferred`] segment the last [`LayerCache::update`] returned:
    /// `part` of absolute `positions` (inside that segment).
    fn deferred(&mut self, positions: Range<usize>, part: KvPart) -> Result<DeferredKv> {
        let _ = part;
        Err(crate::error::ModelError::Cache(format!(
            "this cache has no deferred K/V (asked for positions {positions:?})"
        )))
    }

    /// The [`SegmentKv::Deferred`] segment the last [`LayerCache::update`] returned, as a
    /// [`HostTier`] when the cache can hand its storage to the CPU row loops (`None`, the
    /// default: attention reads it through [`LayerCache::deferred`]).
    fn host_tier(&mut self) -> Option<&dyn HostTier> {
        None
    }
}

/// The caches of every layer of a model, as one forward sees them.
pub trait KvLayers: Send {
    /// Number of layer caches.
    fn layer_count(&self) -> usize;

    /// [`LayerCache::update`] of layer `layer`.
    fn update(
        &mut self,
        layer: usize,
        k: Tensor<3>,
        v: Tensor<3>,
        start: usize,
    ) -> Result<Vec<KvSegment>>;

    /// [`LayerCache::deferred`] of layer `layer`.
    fn deferred(
        &mut self,
        layer: usize,
        positions: Range<usize>,
        part: KvPart,
    ) -> Result<DeferredKv>;

    /// Whether layer `layer` keeps something of the raw K/V (k_proj / v_proj outputs, before
    /// k_norm and RoPE): then each forward hands them to [`Self::record_raw`] before its
    /// [`Self::update`].
    fn wants_raw(&self, layer: usize) -> bool {
        let _ = layer;
        false
    }

    /// The raw K/V of the positions `start..start + n` the next [`Self::update`] of layer
    /// `layer` writes.
    ///
    /// # Shapes
    /// - `k_raw`, `v_raw`: `[n, kv_heads · head_dim]`
    fn record_raw(
        &mut self,
        layer: usize,
        k_raw: Tensor<2>,
        v_raw: Tensor<2>,
        start: usize,
    ) -> Result<()> {
        let _ = (layer, k_raw, v_raw, start);
        Ok(())
    }

    /// [`LayerCache::in_place`] of layer `layer` (`None`: no such layer, or it cannot).
    fn in_place(&mut self, layer: usize, start: usize, like: &Tensor<3>) -> Option<InPlace> {
        let _ = (layer, start, like);
        None
    }

    /// [`LayerCache::host_tier`] of layer `layer`.
    fn host_tier(&mut self, layer: usize) -> Option<&dyn HostTier> {
        let _ = layer;
        None
    }

    /// Every layer's [`LayerCache::truncate`]: positions `>= len` forgotten (a recorded
    /// forward puts its caches back before each run: `crate::gemma::replay`).
    fn truncate(&mut self, len: usize) -> Result<()>;
}

impl<C: LayerCache> KvLayers for [C] {
    fn layer_count(&self) -> usize {
        self.len()
    }

    fn update(
        &mut self,
        layer: usize,
        k: Tensor<3>,
        v: Tensor<3>,
        start: usize,
    ) -> Result<Vec<KvSegment>> {
        self[layer].update(k, v, start)
    }

    fn deferred(&mut self, layer: usize, at: Range<usize>, part: KvPart) -> Result<DeferredKv> {
        self[layer].deferred(at, part)
    }

    fn in_place(&mut self, layer: usize, start: usize, like: &Tensor<3>) -> Option<InPlace> {
        self.get_mut(layer)?.in_place(start, like)
    }

    fn host_tier(&mut self, layer: usize) -> Option<&dyn HostTier> {
        self.get_mut(layer)?.host_tier()
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        self.iter_mut().try_for_each(|c| c.truncate(len))
    }
}

impl<C: LayerCache> KvLayers for Vec<C> {
    fn layer_count(&self) -> usize {
        self.as_slice().layer_count()
    }

    fn update(
        &mut self,
        l: usize,
        k: Tensor<3>,
        v: Tensor<3>,
        at: usize,
    ) -> Result<Vec<KvSegment>> {
        self.as_mut_slice().update(l, k, v, at)
    }

    fn deferred(&mut self, layer: usize, at: Range<usize>, part: KvPart) -> Result<DeferredKv> {
        self.as_mut_slice().deferred(layer, at, part)
    }

    fn in_place(&mut self, layer: usize, start: usize, like: &Tensor<3>) -> Option<InPlace> {
        self.as_mut_slice().in_place(layer, start, like)
    }

    fn host_tier(&mut self, layer: usize) -> Option<&dyn HostTier> {
        self.as_mut_slice().host_tier(layer)
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        self.as_mut_slice().truncate(len)
    }
}

/// The drafter's per-position context store: for every drafter layer, the context keys after
/// k_norm and before RoPE and the values, one row per position, concatenated over layers —
/// exactly f_θ's input. The drafter applies RoPE when it reads.
pub trait DraftContext {
    /// Positions held.
    fn len(&self) -> usize;

    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the rows of positions `len()..len() + n`.
    ///
    /// # Shapes
    /// - `k`, `v`: `[n, drafter_layers · kv_heads · head_dim]`
    fn append(&mut self, k: Tensor<2>, v: Tensor<2>) -> Result<()>;

    /// The rows of `positions` (as held: dequantised when the store is quantised).
    ///
    /// # Shapes
    /// - returns `k`, `v`: `[positions.len, drafter_layers · kv_heads · head_dim]`
    fn read(&self, positions: Range<usize>) -> Result<(Tensor<2>, Tensor<2>)>;

    /// The rows a draft attends to, with their positions in order: every position held (the
    /// default), or what a store that keeps only part of the context gives drafts.
    ///
    /// # Shapes
    /// - returns positions `P`, `k`, `v`: `[P, drafter_layers · kv_heads · head_dim]`
    fn read_reach(&self) -> Result<(Vec<usize>, Tensor<2>, Tensor<2>)> {
        let len = self.len();
        let (k, v) = self.read(0..len)?;
        Ok(((0..len).collect(), k, v))
    }

    /// The whole K and V buffers where the rows live on a GPU, positions in order from 0:
    /// rows `len()..` are spare (zeros or stale). A recorded draft reads these and masks
    /// what is past the length it is given. `None` (the default) where the rows are held
    /// otherwise (on the host, quantised).
    ///
    /// # Shapes
    /// - returns `k`, `v`: `[capacity ≥ len, drafter_layers · kv_heads · head_dim]`
    fn device_rows(&self) -> Option<(Tensor<2>, Tensor<2>)> {
        None
    }

    /// Makes room on the device for `n` more rows and returns the buffers (as
    /// [`Self::device_rows`], held by this store alone, so that a write into them changes no
    /// other store), for a step that writes rows `len()..len() + n` into them in place and
    /// then calls [`Self::written_in_place`]. `None` (the default) where the rows are held
    /// otherwise: append them.
    ///
    /// # Shapes
    /// - returns `k`, `v`: `[capacity ≥ len + n, drafter_layers · kv_heads · head_dim]`
    fn reserve_on_device(&mut self, n: usize) -> Option<(Tensor<2>, Tensor<2>)> {
        let _ = n;
        None
    }

    /// Counts `n` rows written in place after [`Self::reserve_on_device`] as held.
    fn written_in_place(&mut self, n: usize) -> Result<()> {
        Err(crate::ModelError::Cache(format!(
            "{n} rows written in place into a store that keeps none on the device"
        )))
    }
}
