//! The sliding ring of the native caches (a sliding-window layer's cache in `full` mode).

use burn::tensor::{DType, Tensor};
use kakeya_models::{InPlace, KvSegment, LayerCache, ModelError, Reach};

use super::*;

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
