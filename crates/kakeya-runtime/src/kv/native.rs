//! The native KV caches (what `full` mode keeps): a growable full cache and a sliding ring,
//! both with an exact `truncate`.
//!
//! Keys/values are stored `[kv_heads, capacity, head_dim]` on the model's device, in 16-bit
//! floats on the CPU by default ([`KvDtype`]; attention widens them to f32 and computes in f32)
//! and in f32 on a GPU, whose kernels read f32. Capacity grows in blocks of [`KV_BLOCK`]
//! positions (by a sixteenth of what is held at least), so the bytes held stay within a block
//! and 1/16 of what the positions need. A ring
//! keeps `window - 1 + slack` positions: `window - 1` are what the next query needs, and the
//! `slack` extra let `truncate` roll back that many positions exactly even after wrapping
//! (speculative decoding rolls back at most `block - 1`). A model's native ring has one more,
//! spare slot ([`RingCache::native`]): a decode step or a verified block is then written
//! first and attention reads the ring's slots in place, instead of the ring being copied
//! because the write would clobber a slot a held view still shows.

use burn::tensor::{DType, Tensor};
use kakeya_models::{CacheSpec, InPlace, KvSegment, LayerCache, ModelError, Reach};
use serde::{Deserialize, Serialize};

mod ring;

pub use ring::RingCache;

/// Positions a cache's buffers grow by, at least.
pub const KV_BLOCK: usize = 64;

/// How exact K/V are stored: 16-bit (f16, as llama.cpp and vLLM keep their caches by default)
/// or f32 (reference tests). 16-bit applies to caches in CPU memory; on a GPU, and under
/// autodiff, K/V stay f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// IEEE half precision.
    #[default]
    F16,
    /// Single precision.
    F32,
}

impl KvDtype {
    /// The name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        }
    }

    /// The dtype buffers shaped like `like` are stored in.
    fn storage(self, like: &Tensor<3>) -> DType {
        match self {
            KvDtype::F16 if kakeya_models::host_attention::on_host(like) => DType::F16,
            _ => DType::F32,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f16" => Ok(KvDtype::F16),
            "f32" => Ok(KvDtype::F32),
            _ => Err(format!("unknown KV dtype {s:?}; the dtypes are f16, f32")),
        }
    }
}

/// `t` in `dtype` (a no-op when it already is).
pub(crate) fn in_dtype(t: Tensor<3>, dtype: DType) -> Tensor<3> {
    if t.dtype() == dtype { t } else { t.cast(dtype) }
}

/// Positions `from..to` of a `[kv_heads, S, head_dim]` tensor.
pub(crate) fn seq_slice(t: &Tensor<3>, from: usize, to: usize) -> Tensor<3> {
    let [h, _, d] = t.dims();
    t.clone().slice([0..h, from..to, 0..d])
}

fn assign(buf: Tensor<3>, at: usize, values: Tensor<3>) -> Tensor<3> {
    let [h, n, d] = values.dims();
    buf.slice_assign([0..h, at..at + n, 0..d], values)
}

/// K/V a cache holds, oldest first (inspection and tests).
#[derive(Debug, Clone)]
pub struct HeldKv {
    /// Keys, `[kv_heads, n, head_dim]`.
    pub k: Tensor<3>,
    /// Values, `[kv_heads, n, head_dim]`.
    pub v: Tensor<3>,
    /// Absolute positions.
    pub positions: Vec<usize>,
}

impl HeldKv {
    /// The same positions with K/V as f32.
    fn widened(self) -> Self {
        Self {
            k: in_dtype(self.k, DType::F32),
            v: in_dtype(self.v, DType::F32),
            positions: self.positions,
        }
    }
}

/// Refuses a truncation to more positions than are held.
pub(crate) fn check_truncate(len: usize, held: usize) -> kakeya_models::Result<()> {
    if len > held {
        return Err(ModelError::Cache(format!(
            "cannot truncate to {len}: only {held} positions held"
        )));
    }
    Ok(())
}

/// Allocated bytes of an optional K/V buffer pair.
fn pair_bytes(kv: &Option<(Tensor<3>, Tensor<3>)>) -> usize {
    kv.as_ref().map_or(0, |(k, v)| {
        k.shape().num_elements() * k.dtype().size() + v.shape().num_elements() * v.dtype().size()
    })
}

/// The dtype a buffer pair stores (or, before the first write, will store) values like `like`.
fn stored_dtype(kv: &Option<(Tensor<3>, Tensor<3>)>, dtype: KvDtype, like: &Tensor<3>) -> DType {
    kv.as_ref()
        .map_or_else(|| dtype.storage(like), |(k, _)| k.dtype())
}

/// The buffers of `kv` made writable in place ([`kakeya_models::gpu::unique_dense`]), kept by
/// the cache and handed to the caller's kernel.
fn writable(kv: &mut Option<(Tensor<3>, Tensor<3>)>, origin: usize, modulus: usize) -> InPlace {
    let (k, v) = kv.take().expect("allocated before the write");
    let (k, v) = (
        kakeya_models::gpu::unique_dense(k),
        kakeya_models::gpu::unique_dense(v),
    );
    *kv = Some((k.clone(), v.clone()));
    InPlace {
        k,
        v,
        origin,
        modulus,
    }
}

/// Keeps every position; capacity grows in blocks.
#[derive(Debug, Default, Clone)]
pub struct FullCache {
    kv: Option<(Tensor<3>, Tensor<3>)>,
    len: usize,
    dtype: KvDtype,
}

impl FullCache {
    /// An empty cache storing K/V as `dtype`.
    pub fn new(dtype: KvDtype) -> Self {
        Self {
            kv: None,
            len: 0,
            dtype,
        }
    }

    fn ensure(&mut self, k: &Tensor<3>, need: usize) {
        grow(&mut self.kv, (k, self.dtype), self.len, need, usize::MAX);
    }
}

/// Grows a K/V buffer pair to at least `need` positions (rounded up to [`KV_BLOCK`], and by a
/// sixteenth of what it holds at least, at most `limit`), keeping its first `used` positions;
/// `like` gives the heads, width and device, `dtype` the storage of a first allocation.
fn grow(
    kv: &mut Option<(Tensor<3>, Tensor<3>)>,
    (like, dtype): (&Tensor<3>, KvDtype),
    used: usize,
    need: usize,
    limit: usize,
) {
    let have = kv.as_ref().map_or(0, |(k, _)| k.dims()[1]);
    if need <= have {
        return;
    }
    let [h, _, d] = like.dims();
    let new = need
        .max(have + have / 16)
        .next_multiple_of(KV_BLOCK)
        .min(limit);
    let dtype = stored_dtype(kv, dtype, like);
    let device = like.device();
    let mut nk = Tensor::zeros([h, new, d], (&device, dtype));
    let mut nv = Tensor::zeros([h, new, d], (&device, dtype));
    if let Some((ok, ov)) = kv.take()
        && used > 0
    {
        nk = assign(nk, 0, seq_slice(&ok, 0, used));
        nv = assign(nv, 0, seq_slice(&ov, 0, used));
    }
    *kv = Some((nk, nv));
}

impl FullCache {
    /// Appends positions `start..start + T` (`start` must be the next position).
    ///
    /// # Shapes
    /// - `k`, `v`: `[kv_heads, T, head_dim]`
    pub fn push(&mut self, k: Tensor<3>, v: Tensor<3>, start: usize) -> kakeya_models::Result<()> {
        if start != self.len {
            return Err(ModelError::Cache(format!(
                "write at position {start} but the cache holds {}",
                self.len
            )));
        }
        let t = k.dims()[1];
        self.ensure(&k, self.len + t);
        let (bk, bv) = self.kv.take().expect("ensured");
        let dt = bk.dtype();
        let (bk, bv) = (
            assign(bk, start, in_dtype(k, dt)),
            assign(bv, start, in_dtype(v, dt)),
        );
        self.len += t;
        self.kv = Some((bk, bv));
        Ok(())
    }

    /// Every held position, oldest first, as f32 (inspection and tests).
    pub fn held(&self) -> Option<HeldKv> {
        self.held_stored().map(HeldKv::widened)
    }

    /// Every held position, oldest first, as stored (views of the buffers).
    pub(crate) fn held_stored(&self) -> Option<HeldKv> {
        self.kv
            .as_ref()
            .filter(|_| self.len > 0)
            .map(|(k, v)| HeldKv {
                k: seq_slice(k, 0, self.len),
                v: seq_slice(v, 0, self.len),
                positions: (0..self.len).collect(),
            })
    }
}

impl LayerCache for FullCache {
    fn update(
        &mut self,
        k: Tensor<3>,
        v: Tensor<3>,
        start: usize,
    ) -> kakeya_models::Result<Vec<KvSegment>> {
        self.push(k, v, start)?;
        let held = self.held_stored().expect("just written");
        Ok(vec![KvSegment::ready(
            held.k,
            held.v,
            held.positions,
            Reach::Always,
        )])
    }

    fn in_place(&mut self, start: usize, like: &Tensor<3>) -> Option<InPlace> {
        // The in-place kernels write and read f32 buffers.
        if start != self.len || stored_dtype(&self.kv, self.dtype, like) != DType::F32 {
            return None;
        }
        let t = like.dims()[1];
        self.ensure(like, self.len + t);
        self.len += t;
        let slots = self.kv.as_ref().map_or(0, |(k, _)| k.dims()[1]);
        // Every position has its own slot: `p % slots == p`.
        Some(writable(&mut self.kv, 0, slots))
    }

    fn len(&self) -> usize {
        self.len
    }

    fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
        check_truncate(len, self.len)?;
        self.len = len;
        Ok(())
    }

    fn nbytes(&self) -> usize {
        pair_bytes(&self.kv)
    }
}

/// One layer's cache, as the model's [`CacheSpec`] asks.
#[derive(Debug, Clone)]
pub enum KvCache {
    /// Growable full cache.
    Full(FullCache),
    /// Sliding ring.
    Ring(RingCache),
    /// A layer that reads another layer's K/V ([`CacheSpec::Shared`]): holds nothing.
    Shared,
}

impl KvCache {
    /// Builds one cache per layer from the model's specs, storing K/V as `dtype`; rings get
    /// `slack` positions of exact rollback.
    pub fn for_specs(specs: &[CacheSpec], slack: usize, dtype: KvDtype) -> Vec<KvCache> {
        specs
            .iter()
            .map(|&s| Self::native(s, slack, dtype))
            .collect()
    }

    /// The native cache of a layer declared `spec`.
    pub fn native(spec: CacheSpec, slack: usize, dtype: KvDtype) -> KvCache {
        match spec {
            CacheSpec::Full => KvCache::Full(FullCache::new(dtype)),
            CacheSpec::Sliding { window } => {
                KvCache::Ring(RingCache::native(window, slack).with_dtype(dtype))
            }
            CacheSpec::Shared { .. } => KvCache::Shared,
        }
    }

    /// The positions this cache holds, oldest first, with their K/V (inspection and tests).
    pub fn held(&self) -> Option<HeldKv> {
        match self {
            KvCache::Full(c) => c.held(),
            KvCache::Ring(r) => r.held(),
            KvCache::Shared => None,
        }
    }

    /// Whether a truncation to `len` would succeed.
    pub fn reaches(&self, len: usize) -> bool {
        match self {
            KvCache::Full(c) => len <= c.len,
            KvCache::Ring(r) => r.reaches(len),
            KvCache::Shared => true,
        }
    }
}

impl LayerCache for KvCache {
    fn update(
        &mut self,
        k: Tensor<3>,
        v: Tensor<3>,
        start: usize,
    ) -> kakeya_models::Result<Vec<KvSegment>> {
        match self {
            KvCache::Full(c) => c.update(k, v, start),
            KvCache::Ring(r) => r.update(k, v, start),
            KvCache::Shared => Err(ModelError::Cache(format!(
                "a layer sharing another's K/V holds none (asked to write positions {start}..)"
            ))),
        }
    }

    fn in_place(&mut self, start: usize, like: &Tensor<3>) -> Option<InPlace> {
        match self {
            KvCache::Full(c) => c.in_place(start, like),
            KvCache::Ring(r) => r.in_place(start, like),
            KvCache::Shared => None,
        }
    }

    fn len(&self) -> usize {
        // A sharing layer counts nothing of its own; the sequence's length is layer 0's.
        match self {
            KvCache::Full(c) => c.len,
            KvCache::Ring(r) => LayerCache::len(r),
            KvCache::Shared => 0,
        }
    }

    fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
        match self {
            KvCache::Full(c) => c.truncate(len),
            KvCache::Ring(r) => r.truncate(len),
            KvCache::Shared => Ok(()),
        }
    }

    fn nbytes(&self) -> usize {
        match self {
            KvCache::Full(c) => c.nbytes(),
            KvCache::Ring(r) => r.nbytes(),
            KvCache::Shared => 0,
        }
    }
}

#[cfg(test)]
mod tests;
