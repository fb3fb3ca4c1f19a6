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

/// Keeps the most recent `window - 1 + slack` positions in a ring. Position `p` lives in slot
/// `(p − origin) % capacity`; the slots are allocated as the ring fills (doubling from 64,
/// like [`FullCache`]), so a sequence shorter than the window holds only what it uses.
#[derive(Debug, Clone)]
pub struct RingCache {
    window: usize,
    cap: usize,
    dtype: KvDtype,
    kv: Option<(Tensor<3>, Tensor<3>)>,
    /// First position this ring ever holds.
    origin: usize,
    /// Oldest position still held.
    first: usize,
    /// Next position to write.
    len: usize,
}

impl RingCache {
    /// A ring for a layer with attention `window`, able to roll back `slack` positions.
    pub fn new(window: usize, slack: usize) -> Self {
        Self::starting_at(0, window, slack)
    }

    /// The ring storing K/V as `dtype` (the default: [`KvDtype::F16`]).
    pub fn with_dtype(self, dtype: KvDtype) -> Self {
        Self { dtype, ..self }
    }

    /// A model's native sliding cache: [`Self::new`] plus one spare slot, so that a chunk of
    /// up to `slack + 1` positions (a decode step, a verified block) is written before
    /// attention reads the ring in place — without the spare, the write would overwrite a
    /// position the chunk's first query still needs, and the ring would have to be copied for
    /// every step.
    pub fn native(window: usize, slack: usize) -> Self {
        let mut ring = Self::new(window, slack);
        ring.cap += 1;
        ring
    }

    /// A ring whose first position is `origin` (positions before it are kept elsewhere).
    pub fn starting_at(origin: usize, window: usize, slack: usize) -> Self {
        Self {
            window,
            cap: (window.max(1) - 1 + slack).max(1),
            dtype: KvDtype::default(),
            kv: None,
            origin,
            first: origin,
            len: origin,
        }
    }

    /// Ring slots.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The slot of position `p`.
    fn slot(&self, p: usize) -> usize {
        (p - self.origin) % self.cap
    }

    /// Allocates slots `0..need` (`need <= cap`), keeping what the ring holds. Below the
    /// capacity the ring has never wrapped: it holds positions `origin..len` in slots
    /// `0..len − origin`.
    fn ensure(&mut self, k: &Tensor<3>, need: usize) {
        grow(
            &mut self.kv,
            (k, self.dtype),
            self.len - self.origin,
            need,
            self.cap,
        );
    }

    /// Held positions `first..len` in chronological order.
    fn chronological(&self, buf: &Tensor<3>) -> Option<Tensor<3>> {
        let n = self.len - self.first;
        if n == 0 {
            return None;
        }
        let s = self.slot(self.first);
        Some(if s + n <= self.cap {
            seq_slice(buf, s, s + n)
        } else {
            Tensor::cat(
                vec![
                    seq_slice(buf, s, self.cap),
                    seq_slice(buf, 0, s + n - self.cap),
                ],
                1,
            )
        })
    }

    /// Writes `vals` (positions `p0..p0+n`, `n <= cap`) at their slots.
    fn write(&self, buf: Tensor<3>, p0: usize, vals: Tensor<3>) -> Tensor<3> {
        let n = vals.dims()[1];
        let s = self.slot(p0);
        if s + n <= self.cap {
            assign(buf, s, vals)
        } else {
            let first = self.cap - s;
            let buf = assign(buf, s, seq_slice(&vals, 0, first));
            assign(buf, 0, seq_slice(&vals, first, n))
        }
    }
}

impl RingCache {
    /// Held positions, oldest first, with their K/V as f32 (inspection and tests).
    pub fn held(&self) -> Option<HeldKv> {
        self.held_stored().map(HeldKv::widened)
    }

    /// Held positions, oldest first, with their K/V as stored.
    pub(crate) fn held_stored(&self) -> Option<HeldKv> {
        let (k, v) = self.kv.as_ref()?;
        Some(HeldKv {
            k: self.chronological(k)?,
            v: self.chronological(v)?,
            positions: (self.first..self.len).collect(),
        })
    }

    /// Writes positions `start..start + T` (`start` must be the next position); only the
    /// newest `capacity` of them stay.
    ///
    /// # Shapes
    /// - `k`, `v`: `[kv_heads, T, head_dim]`
    pub fn push(&mut self, k: Tensor<3>, v: Tensor<3>, start: usize) -> kakeya_models::Result<()> {
        if start != self.len {
            return Err(ModelError::Cache(format!(
                "write at position {start} but the ring is at {}",
                self.len
            )));
        }
        let t = k.dims()[1];
        self.ensure(&k, (start + t - self.origin).min(self.cap));
        let (bk, bv) = self.kv.take().expect("ensured");
        let keep = t.min(self.cap);
        let p0 = start + t - keep;
        let dt = bk.dtype();
        let bk = self.write(bk, p0, in_dtype(seq_slice(&k, t - keep, t), dt));
        let bv = self.write(bv, p0, in_dtype(seq_slice(&v, t - keep, t), dt));
        self.kv = Some((bk, bv));
        self.len = start + t;
        self.first = self.first.max(self.len.saturating_sub(self.cap));
        Ok(())
    }

    /// The oldest position still held.
    pub fn first(&self) -> usize {
        self.first
    }

    /// The dtype the ring stores values like `like` in.
    pub(crate) fn stored_dtype(&self, like: &Tensor<3>) -> DType {
        stored_dtype(&self.kv, self.dtype, like)
    }

    /// The oldest position the next query needs once the ring is cut back to `len`.
    fn needs_from(&self, len: usize) -> usize {
        (len + 1).saturating_sub(self.window).max(self.origin)
    }

    /// Whether [`LayerCache::truncate`] to `len` would succeed: every position the next query
    /// then needs is still held.
    pub fn reaches(&self, len: usize) -> bool {
        (self.origin..=self.len).contains(&len) && self.first <= self.needs_from(len)
    }

    /// Held positions, oldest first, as views of the ring's slots: one segment, or two when
    /// the held range wraps (no copy).
    fn held_views(&self) -> Vec<KvSegment> {
        let Some((bk, bv)) = self.kv.as_ref() else {
            return Vec::new();
        };
        let n = self.len - self.first;
        let s = self.slot(self.first);
        let head = n.min(self.cap - s);
        let mut out = vec![KvSegment::ready(
            seq_slice(bk, s, s + head),
            seq_slice(bv, s, s + head),
            (self.first..self.first + head).collect(),
            Reach::Always,
        )];
        if head < n {
            out.push(KvSegment::ready(
                seq_slice(bk, 0, n - head),
                seq_slice(bv, 0, n - head),
                (self.first + head..self.len).collect(),
                Reach::Always,
            ));
        }
        out
    }
}

impl LayerCache for RingCache {
    fn update(
        &mut self,
        k: Tensor<3>,
        v: Tensor<3>,
        start: usize,
    ) -> kakeya_models::Result<Vec<KvSegment>> {
        let t = k.dims()[1];
        // The first position the chunk's queries can reach: when the write keeps it, write
        // first and let attention read the ring's slots in place.
        let reach = (start + 1).saturating_sub(self.window).max(self.origin);
        if start == self.len && start + t <= reach + self.cap {
            self.push(k, v, start)?;
            return Ok(self.held_views());
        }
        let mut out = Vec::with_capacity(2);
        if let Some(h) = self.held_stored() {
            out.push(KvSegment::ready(h.k, h.v, h.positions, Reach::Always));
        }
        // The chunk's own keys as the ring stores them: a query reads a position's K/V at the
        // same precision whether it was written by this chunk or an earlier one.
        let dt = self.stored_dtype(&k);
        let (k, v) = (in_dtype(k, dt), in_dtype(v, dt));
        self.push(k.clone(), v.clone(), start)?;
        out.push(KvSegment::ready(
            k,
            v,
            (start..start + t).collect(),
            Reach::Always,
        ));
        Ok(out)
    }

    fn in_place(&mut self, start: usize, like: &Tensor<3>) -> Option<InPlace> {
        let t = like.dims()[1];
        // As `update`'s write-first case: the chunk's slots hold nothing its queries read.
        let reach = (start + 1).saturating_sub(self.window).max(self.origin);
        if start != self.len
            || t == 0
            || start + t > reach + self.cap
            || self.stored_dtype(like) != DType::F32
        {
            return None;
        }
        self.ensure(like, (start + t - self.origin).min(self.cap));
        self.len = start + t;
        self.first = self.first.max(self.len.saturating_sub(self.cap));
        Some(writable(&mut self.kv, self.origin, self.cap))
    }

    fn len(&self) -> usize {
        self.len
    }

    fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
        if len > self.len || len < self.origin {
            return Err(ModelError::Cache(format!(
                "cannot truncate the ring of positions {}..{} to {len}",
                self.origin, self.len
            )));
        }
        let need_from = self.needs_from(len);
        if self.first > need_from {
            return Err(ModelError::Cache(format!(
                "cannot roll back to {len}: the ring already evicted position {need_from} (slack too small)"
            )));
        }
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
            KvCache::Ring(r) => r.len,
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
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;

    /// Positions `from..to` as K (value `p`) and V (value `−p`), one head of width 2.
    fn rows(from: usize, to: usize) -> (Tensor<3>, Tensor<3>) {
        let device = Device::flex();
        let k: Vec<f32> = (from..to).flat_map(|p| [p as f32; 2]).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        let n = to - from;
        (
            Tensor::from_data(TensorData::new(k, [1, n, 2]), &device),
            Tensor::from_data(TensorData::new(v, [1, n, 2]), &device),
        )
    }

    fn held_positions(r: &RingCache) -> Vec<usize> {
        let h = r.held().expect("holds positions");
        let k = h.k.into_data().try_to_vec::<f32>().unwrap();
        let v = h.v.into_data().try_to_vec::<f32>().unwrap();
        for (i, &p) in h.positions.iter().enumerate() {
            assert_eq!(
                (k[2 * i], v[2 * i]),
                (p as f32, -(p as f32)),
                "{:?}",
                h.positions
            );
        }
        h.positions
    }

    #[test]
    fn a_ring_allocates_as_it_fills_and_keeps_its_window_through_rollbacks() {
        // Window 200, slack 2, from position 5: 201 slots.
        let mut r = RingCache::starting_at(5, 200, 2);
        let slot_bytes = 2 * 2 * 2; // K and V, width 2, f16
        let (mut len, mut first) = (5, 5);
        let mut sizes = Vec::new();
        for step in 0..400 {
            // Chunks of 1–9 positions; every fourth one is rolled back by 2.
            let t = 1 + step % 9;
            let (k, v) = rows(len, len + t);
            r.push(k, v, len).unwrap();
            len += t;
            // A write evicts what falls out of the ring; a rollback brings nothing back.
            first = first.max(len.saturating_sub(r.capacity()));
            if step % 4 == 3 {
                len -= 2;
                r.truncate(len).unwrap();
            }
            let held = held_positions(&r);
            let want: Vec<usize> = (first..len).collect();
            assert_eq!(held, want, "step {step}");
            let bytes = r.nbytes();
            assert!(bytes >= held.len().min(64) * slot_bytes, "step {step}");
            sizes.push(bytes / slot_bytes);
        }
        // Blocks of 64 slots as the ring fills, then the capacity; never more.
        let mut distinct = sizes.clone();
        distinct.dedup();
        assert_eq!(distinct, vec![64, 128, 192, 201], "{sizes:?}");
    }
}
