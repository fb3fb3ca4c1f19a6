//! The KV state of one sequence: per layer what the policy keeps (native cache, bounded tiers,
//! or everything quantised), the compact store shared by the drafter and restoration, and the
//! byte accounting.

pub mod channels;
pub mod native;
pub mod policy;
mod quant_tier;
mod residual;
pub mod restore;
pub mod rotation;
pub mod rows;
pub mod store;
pub mod tiered;

use std::ops::Range;

use burn::tensor::{Device, Tensor};
use kakeya_models::host_attention::KEY_TILE;
use kakeya_models::{
    CacheSpec, DeferredKv, HostTier, InPlace, KvLayers, KvPart, KvSegment, LayerCache, ModelError,
};
use serde::{Deserialize, Serialize};

pub use native::{FullCache, HeldKv, KV_BLOCK, KvCache, KvDtype, RingCache};
pub use policy::{
    BOUNDED_PRESETS, Evicted, GLOBAL_WINDOW, Keep, KvMode, KvPolicy, LayerPlan, LayerRule,
    MIXED_PRESETS, QuantFormat, RESIDUAL_PRESETS, Ranges,
};
pub use quant_tier::SharedUndo;
pub use restore::{FThetaRestorer, OracleRestorer, Restorer};
pub use rows::{Bits, QuantRows, Rows};
pub use store::{CompactStore, DraftReach, StoreFormat};
pub use tiered::{QuantAllCache, Shared, TieredCache};

/// One layer's cache under a policy.
// One value per layer, held in a Vec: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum LayerKv {
    /// The model's native cache.
    Native(KvCache),
    /// Sink + window exact, evicted tier per the policy.
    Tiered(TieredCache),
    /// Every position quantised.
    QuantAll(QuantAllCache),
}

impl LayerKv {
    fn len(&self) -> usize {
        match self {
            LayerKv::Native(c) => c.len(),
            LayerKv::Tiered(c) => c.len(),
            LayerKv::QuantAll(c) => c.len(),
        }
    }

    fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
        match self {
            LayerKv::Native(c) => c.truncate(len),
            LayerKv::Tiered(c) => c.truncate(len),
            LayerKv::QuantAll(c) => c.truncate(len),
        }
    }

    /// (exact bytes, quantised bytes).
    fn bytes(&self) -> (usize, usize) {
        match self {
            LayerKv::Native(c) => (c.nbytes(), 0),
            LayerKv::Tiered(c) => (c.exact_bytes(), c.quantised_bytes()),
            LayerKv::QuantAll(c) => (0, c.nbytes()),
        }
    }
}

/// Bytes one sequence's KV state holds, measured from its buffers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvBytes {
    /// Exact K/V of every layer: native caches, sinks and windows.
    pub exact: usize,
    /// Quantised K/V tiers.
    pub quantised: usize,
    /// The compact store (the drafter's per-position context K/V, and the hidden states
    /// waiting for their rows).
    pub store: usize,
    /// The most bytes of evicted K/V materialised at once: one tile (up to 64 positions on the
    /// CPU, 256 on a GPU) of a layer's dequantised K or V, or of its restored K or V with its
    /// attention form (f32); or the most store rows read at once as f32 (restoration reads a
    /// tile; a draft reads the store's sink and window).
    pub transient_peak: usize,
    /// `exact + quantised + store + transient_peak`.
    pub total: usize,
    /// Reference: the model's native cache layout (global layers every position, sliding
    /// layers their window) at this length in 16-bit floats, as llama.cpp and vLLM hold it.
    pub full_f16: usize,
    /// `full_f16 / total`.
    pub ratio_to_full_f16: f64,
}

/// The KV state of one sequence.
#[derive(Debug, Clone)]
pub struct SequenceKv<'r> {
    specs: Vec<CacheSpec>,
    kv_widths: Vec<usize>,
    /// The inverse rotations the layers' quantised tiers share (one per head width).
    undo: Vec<SharedUndo>,
    layers: Vec<LayerKv>,
    store: Option<CompactStore>,
    restorer: Option<&'r dyn Restorer>,
    transient_peak: usize,
    device: Option<Device>,
}

impl<'r> SequenceKv<'r> {
    /// Caches for layers declared `specs` (layer `i`'s K/V rows `kv_widths[i]` wide, heads
    /// `head_dims[i]` wide: Gemma 4's full and sliding layers differ) under `policy`; every
    /// cache can roll back `slack` positions exactly. `store` is the compact store (needed by
    /// a drafter or restoration), `restorer` the restorer of the restored modes.
    pub fn new(
        specs: &[CacheSpec],
        (kv_widths, head_dims): (&[usize], &[usize]),
        policy: &KvPolicy,
        slack: usize,
        store: Option<CompactStore>,
        restorer: Option<&'r dyn Restorer>,
    ) -> Self {
        let mut undo: std::collections::BTreeMap<usize, SharedUndo> = Default::default();
        let layers = specs
            .iter()
            .enumerate()
            .map(|(i, &spec)| match policy.plan(spec) {
                _ if matches!(spec, CacheSpec::Shared { .. }) => LayerKv::Native(KvCache::Shared),
                LayerPlan::Native => LayerKv::Native(KvCache::native(spec, slack, policy.dtype)),
                LayerPlan::Bounded {
                    evicted,
                    sink,
                    window,
                } => LayerKv::Tiered(TieredCache::new(
                    i,
                    spec,
                    (sink, window, slack),
                    (
                        evicted,
                        policy.dtype,
                        undo.entry(head_dims[i]).or_default().clone(),
                    ),
                    (kv_widths[i], head_dims[i]),
                )),
                LayerPlan::QuantAll(bits) => {
                    LayerKv::QuantAll(QuantAllCache::new(spec, bits, kv_widths[i]))
                }
            })
            .collect();
        Self {
            specs: specs.to_vec(),
            kv_widths: kv_widths.to_vec(),
            undo: undo.into_values().collect(),
            layers,
            store,
            restorer,
            transient_peak: 0,
            device: None,
        }
    }

    fn layer_mut(&mut self, layer: usize) -> kakeya_models::Result<&mut LayerKv> {
        self.layers
            .get_mut(layer)
            .ok_or_else(|| ModelError::Cache(format!("no cache for layer {layer}")))
    }

    /// Positions held (the next position to write).
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerKv::len)
    }

    /// True before any position.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The per-layer caches (inspection and tests).
    pub fn layers(&self) -> &[LayerKv] {
        &self.layers
    }

    /// Layer `layer`'s native cache, when the policy keeps it natively.
    pub fn native(&self, layer: usize) -> Option<&KvCache> {
        match self.layers.get(layer)? {
            LayerKv::Native(c) => Some(c),
            _ => None,
        }
    }

    /// The compact store, when there is one.
    pub fn store(&self) -> Option<&CompactStore> {
        self.store.as_ref()
    }

    /// The compact store, mutably (the session appends committed rows).
    pub fn store_mut(&mut self) -> Option<&mut CompactStore> {
        self.store.as_mut()
    }

    /// Frees the compact store, if there is one; the caches stay as they are.
    pub fn drop_store(&mut self) {
        self.store = None;
    }

    /// Whether every layer keeps its cache natively and can be cut back to `len` exactly (what
    /// a prefix-cache fork needs; the bounded tiers answer no).
    pub fn natively_reaches(&self, len: usize) -> bool {
        self.layers.iter().all(|l| match l {
            LayerKv::Native(c) => c.reaches(len),
            LayerKv::Tiered(_) | LayerKv::QuantAll(_) => false,
        })
    }

    /// Forgets positions `>= len` in every layer (the store only ever holds committed
    /// positions and is not touched).
    pub fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
        for l in &mut self.layers {
            l.truncate(len)?;
        }
        Ok(())
    }

    /// Bytes held now, every part measured.
    pub fn bytes(&self) -> KvBytes {
        let (exact, quantised) = self
            .layers
            .iter()
            .map(LayerKv::bytes)
            .fold((0, 0), |(a, b), (x, y)| (a + x, b + y));
        let quantised = quantised
            + self
                .undo
                .iter()
                .filter_map(|u| u.get())
                .map(|m| m.shape().num_elements() * 4)
                .sum::<usize>();
        let store = self.store.as_ref().map_or(0, CompactStore::nbytes);
        let transient_peak = self
            .transient_peak
            .max(self.store.as_ref().map_or(0, CompactStore::read_peak));
        let total = exact + quantised + store + transient_peak;
        let len = self.len();
        let full_f16 = self
            .specs
            .iter()
            .zip(&self.kv_widths)
            .map(|(s, &width)| {
                let held = match *s {
                    CacheSpec::Full => len,
                    CacheSpec::Sliding { window } => len.min(window),
                    CacheSpec::Shared { .. } => 0,
                };
                held * width
            })
            .sum::<usize>()
            * 2
            * 2;
        KvBytes {
            exact,
            quantised,
            store,
            transient_peak,
            total,
            full_f16,
            ratio_to_full_f16: if total > 0 {
                full_f16 as f64 / total as f64
            } else {
                0.0
            },
        }
    }
}

impl KvLayers for SequenceKv<'_> {
    fn layer_count(&self) -> usize {
        self.layers.len()
    }

    fn update(
        &mut self,
        layer: usize,
        k: Tensor<3>,
        v: Tensor<3>,
        start: usize,
    ) -> kakeya_models::Result<Vec<KvSegment>> {
        self.device = Some(k.device());
        let shared = Shared {
            store: self.store.as_ref(),
            restorer: self.restorer,
        };
        let cache = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| ModelError::Cache(format!("no cache for layer {layer}")))?;
        match cache {
            LayerKv::Native(c) => c.update(k, v, start),
            LayerKv::Tiered(c) => c.update((k, v), start, shared),
            LayerKv::QuantAll(c) => c.update(k, v, start),
        }
    }

    fn wants_raw(&self, layer: usize) -> bool {
        matches!(self.layers.get(layer), Some(LayerKv::Tiered(c)) if c.wants_raw())
    }

    fn record_raw(
        &mut self,
        layer: usize,
        k_raw: Tensor<2>,
        v_raw: Tensor<2>,
        start: usize,
    ) -> kakeya_models::Result<()> {
        match self.layer_mut(layer)? {
            LayerKv::Tiered(c) => c.record_raw(k_raw, v_raw, start),
            _ => Ok(()),
        }
    }

    fn in_place(&mut self, layer: usize, start: usize, like: &Tensor<3>) -> Option<InPlace> {
        // Only the native caches are plain buffers; the bounded tiers go through `update`.
        match self.layers.get_mut(layer)? {
            LayerKv::Native(c) => {
                self.device = Some(like.device());
                c.in_place(start, like)
            }
            LayerKv::Tiered(_) | LayerKv::QuantAll(_) => None,
        }
    }

    fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
        SequenceKv::truncate(self, len)
    }

    fn host_tier(&mut self, layer: usize) -> Option<&dyn HostTier> {
        let tier = match self.layers.get(layer)? {
            LayerKv::Tiered(c) => c.host_tier()?,
            LayerKv::QuantAll(c) => c as &dyn HostTier,
            LayerKv::Native(_) => return None,
        };
        // The row loops hold one tile of K or V of a head, widened to f32, per row.
        let width = self.kv_widths.get(layer).copied().unwrap_or(0);
        self.transient_peak = self.transient_peak.max(KEY_TILE * width * 4);
        Some(tier)
    }

    fn deferred(
        &mut self,
        layer: usize,
        positions: Range<usize>,
        part: KvPart,
    ) -> kakeya_models::Result<DeferredKv> {
        let shared = Shared {
            store: self.store.as_ref(),
            restorer: self.restorer,
        };
        let device = self.device.clone().unwrap_or_else(Device::flex);
        let (tile, bytes) = match self.layers.get(layer) {
            Some(LayerKv::Tiered(c)) => c.deferred(positions, part, shared, &device)?,
            Some(LayerKv::QuantAll(c)) => c.deferred_counted(positions, part, &device)?,
            _ => {
                return Err(ModelError::Cache(format!(
                    "layer {layer} has no deferred K/V"
                )));
            }
        };
        self.transient_peak = self.transient_peak.max(bytes);
        Ok(tile)
    }
}
