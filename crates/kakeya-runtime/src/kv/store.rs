//! The compact per-position store: the drafter's context K (after k_norm, before RoPE) and V of
//! every drafter layer, one row per committed position. The DFlash proposer drafts from it and
//! restoration rebuilds evicted verifier K/V from it — one copy, its bytes counted. On a GPU an
//! f32 store lives on the device ([`DeviceRows`]): the rows the verifier's forwards project are
//! appended there and the drafter reads them there, with no copy through the host.

use std::cell::Cell;
use std::ops::Range;

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::{DraftContext, KvPart, ModelError};

use super::rows::{Bits, Rows};

/// How far back drafts read the store: its first `sink` positions and its `window` most recent
/// ones. Older rows are dropped as new ones arrive ([`DROP_STEP`] rows later, so that a
/// rollback of up to that many positions never needs one), so the store holds fewer than
/// `sink + window + 2 · DROP_STEP` rows however long the sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftReach {
    /// First positions always read.
    pub sink: usize,
    /// Most recent positions read.
    pub window: usize,
}

impl DraftReach {
    /// What drafts read by default: the first 4 positions and the 256 most recent. The default
    /// drafters were trained on sequences of at most 640 positions (most near 130); after a
    /// long prompt a short window drafts no worse than the whole context (docs/kv-modes.md).
    pub const DEFAULT: DraftReach = DraftReach {
        sink: 4,
        window: 256,
    };
}

/// Rows the store holds past its reach before it drops the oldest (one drop per this many
/// appended rows, and room for a rollback of up to this many positions).
const DROP_STEP: usize = 64;

/// How the store holds its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreFormat {
    /// f32 rows (what restoration reads by default, and a GPU store).
    F32,
    /// f16 rows, read back as f32.
    F16,
    /// Affine-quantised rows.
    Quant(Bits),
}

/// Rows of drafter context K and V, f32, f16 or quantised, every position or a sink and a
/// recent window of them ([`DraftReach`]).
#[derive(Debug, Clone)]
pub struct CompactStore {
    /// Rows of positions `0..sink` (empty when the store keeps every position).
    head: (Rows, Rows),
    /// Rows of positions `start..len`.
    k: Rows,
    v: Rows,
    /// First position `k`/`v` hold (`sink` until rows are dropped).
    start: usize,
    reach: Option<DraftReach>,
    /// The rows themselves where the store is f32 on a GPU (`k` and `v` then stay empty and
    /// only give the width).
    on_device: Option<DeviceRows>,
    device: Device,
    /// Largest read so far (bytes of f32 rows materialised by one read).
    read_peak: Cell<usize>,
}

impl CompactStore {
    /// An empty store of `width`-value rows (`drafter layers · kv_heads · head_dim`) holding
    /// every position, quantised when `bits` is given.
    pub fn new(width: usize, bits: Option<Bits>, device: &Device) -> Self {
        let format = bits.map_or(StoreFormat::F32, StoreFormat::Quant);
        Self::with_reach(width, format, None, device)
    }

    /// An empty store of `width`-value rows held as `format`, keeping only what drafts read
    /// when `reach` is given (a store on a GPU is f32 and keeps every position: `format` and
    /// `reach` then only apply on the host).
    pub fn with_reach(
        width: usize,
        format: StoreFormat,
        reach: Option<DraftReach>,
        device: &Device,
    ) -> Self {
        let rows = || match format {
            StoreFormat::F32 => Rows::new(width, None),
            StoreFormat::F16 => Rows::f16(width),
            StoreFormat::Quant(b) => Rows::new(width, Some(b)),
        };
        let on_device = (format == StoreFormat::F32 && kakeya_models::gpu::is_gpu(device))
            .then(|| DeviceRows::new(width, device));
        let reach = reach.filter(|_| on_device.is_none());
        Self {
            head: (rows(), rows()),
            k: rows(),
            v: rows(),
            start: reach.map_or(0, |r| r.sink),
            reach,
            on_device,
            device: device.clone(),
            read_peak: Cell::new(0),
        }
    }

    /// Row width.
    pub fn width(&self) -> usize {
        self.k.width()
    }

    /// Keeps the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        if let Some(d) = &mut self.on_device {
            d.len = d.len.min(len);
        }
        let sink = self.reach.map_or(0, |r| r.sink);
        self.head.0.truncate(len.min(sink));
        self.head.1.truncate(len.min(sink));
        if len <= self.start {
            // Nothing from `start` on: the tail starts again at `len` (or the sink's end).
            self.k.truncate(0);
            self.v.truncate(0);
            self.start = len.max(sink);
        } else {
            self.k.truncate(len - self.start);
            self.v.truncate(len - self.start);
        }
    }

    /// Bytes held (every row set; on a GPU the buffers as allocated, grown by doubling).
    pub fn nbytes(&self) -> usize {
        self.head.0.nbytes()
            + self.head.1.nbytes()
            + self.k.nbytes()
            + self.v.nbytes()
            + self.on_device.as_ref().map_or(0, DeviceRows::nbytes)
    }

    /// The most bytes one read materialised (dequantised / copied rows).
    pub fn read_peak(&self) -> usize {
        self.read_peak.get()
    }

    /// The K or V rows of `positions` (dequantised when quantised).
    ///
    /// # Shapes
    /// - returns `[positions.len, width]`
    pub fn read_part(
        &self,
        positions: Range<usize>,
        part: KvPart,
    ) -> kakeya_models::Result<Tensor<2>> {
        self.check(&positions)?;
        let (n, w) = (positions.len(), self.width());
        if let Some(d) = &self.on_device {
            let (k, v) = d.read(positions);
            return Ok(match part {
                KvPart::K => k,
                KvPart::V => v,
            });
        }
        self.read_peak.set(self.read_peak.get().max(n * w * 4));
        let mut out = vec![0.0; n * w];
        self.gather(&[positions], part, &mut out);
        Ok(Tensor::from_data(
            TensorData::new(out, [n, w]),
            &self.device,
        ))
    }

    /// Positions `0..sink` held in the head, `start..len` in the tail: the gap between them
    /// (rows dropped) is not held.
    fn gap(&self) -> Range<usize> {
        self.head.0.len()..self.start.max(self.head.0.len())
    }

    fn check(&self, positions: &Range<usize>) -> kakeya_models::Result<()> {
        let gap = self.gap();
        let in_gap = !gap.is_empty() && positions.start < gap.end && positions.end > gap.start;
        if positions.end > self.len() || positions.start > positions.end || in_gap {
            return Err(ModelError::Cache(format!(
                "store read of positions {positions:?}, but it holds {} (rows {gap:?} dropped)",
                self.len()
            )));
        }
        Ok(())
    }

    /// Host rows of `ranges` (each held, in order) into `out` (`Σ len · width`).
    fn gather(&self, ranges: &[Range<usize>], part: KvPart, out: &mut [f32]) {
        let (head, tail) = match part {
            KvPart::K => (&self.head.0, &self.k),
            KvPart::V => (&self.head.1, &self.v),
        };
        let w = self.width();
        let mut at = 0;
        for r in ranges {
            let head_end = r.end.min(head.len()).max(r.start);
            if r.start < head_end {
                let n = head_end - r.start;
                head.read_into(r.start, head_end, &mut out[at..at + n * w]);
                at += n * w;
            }
            if head_end < r.end {
                let n = r.end - head_end;
                let (from, to) = (head_end - self.start, r.end - self.start);
                tail.read_into(from, to, &mut out[at..at + n * w]);
                at += n * w;
            }
        }
    }

    /// The positions drafts read: the sink's, then the recent window's.
    fn reach_ranges(&self, reach: DraftReach) -> [Range<usize>; 2] {
        let len = self.len();
        let head = 0..self.head.0.len();
        let recent = len
            .saturating_sub(reach.window)
            .max(self.start)
            .max(head.end);
        [head, recent.min(len)..len]
    }

    /// Drops tail rows past the reach once [`DROP_STEP`] more than a rollback's room gathered.
    fn drop_unreachable(&mut self) {
        let Some(r) = self.reach else { return };
        let keep = r.window + DROP_STEP;
        if self.k.len() >= keep + DROP_STEP {
            let drop = self.k.len() - keep;
            self.k.drop_front(drop);
            self.v.drop_front(drop);
            self.start += drop;
        }
    }
}

fn host_rows(t: Tensor<2>) -> Result<Vec<f32>, ModelError> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| ModelError::Cache(format!("store rows: {e:?}")))
}

impl DraftContext for CompactStore {
    fn len(&self) -> usize {
        if let Some(d) = &self.on_device {
            return d.len;
        }
        let sink = self.reach.map_or(0, |r| r.sink);
        if self.head.0.len() < sink {
            self.head.0.len()
        } else {
            self.start + self.k.len()
        }
    }

    fn append(&mut self, k: Tensor<2>, v: Tensor<2>) -> kakeya_models::Result<()> {
        let w = self.width();
        if k.dims()[1] != w || v.dims() != k.dims() {
            return Err(ModelError::Cache(format!(
                "store rows are {w} wide, got K {:?} and V {:?}",
                k.dims(),
                v.dims()
            )));
        }
        if let Some(d) = &mut self.on_device {
            d.append(k, v);
            return Ok(());
        }
        let (k, v) = (host_rows(k)?, host_rows(v)?);
        // Rows of positions below the sink go to the head, the rest to the tail.
        let sink = self.reach.map_or(0, |r| r.sink);
        let to_head = sink.saturating_sub(self.len()).min(k.len() / w) * w;
        self.head.0.push(&k[..to_head]);
        self.head.1.push(&v[..to_head]);
        self.k.push(&k[to_head..]);
        self.v.push(&v[to_head..]);
        self.drop_unreachable();
        Ok(())
    }

    fn read(&self, positions: Range<usize>) -> kakeya_models::Result<(Tensor<2>, Tensor<2>)> {
        self.check(&positions)?;
        if let Some(d) = &self.on_device {
            return Ok(d.read(positions));
        }
        Ok(self.read_ranges(&[positions]))
    }

    fn read_reach(&self) -> kakeya_models::Result<(Vec<usize>, Tensor<2>, Tensor<2>)> {
        let Some(reach) = self.reach else {
            let len = self.len();
            let (k, v) = self.read(0..len)?;
            return Ok(((0..len).collect(), k, v));
        };
        let ranges = self.reach_ranges(reach);
        let (k, v) = self.read_ranges(&ranges);
        Ok((ranges.into_iter().flatten().collect(), k, v))
    }

    fn device_rows(&self) -> Option<(Tensor<2>, Tensor<2>)> {
        let d = self.on_device.as_ref()?;
        Some((d.k.clone()?, d.v.clone()?))
    }

    fn reserve_on_device(&mut self, n: usize) -> Option<(Tensor<2>, Tensor<2>)> {
        let d = self.on_device.as_mut()?;
        d.reserve(n);
        Some((d.k.clone()?, d.v.clone()?))
    }

    fn written_in_place(&mut self, n: usize) -> kakeya_models::Result<()> {
        match &mut self.on_device {
            Some(d) if d.len + n <= d.cap() => {
                d.len += n;
                Ok(())
            }
            _ => Err(ModelError::Cache(format!(
                "{n} rows written in place past the store's reserved rows"
            ))),
        }
    }
}

impl CompactStore {
    /// K and V host rows of `ranges` (held, in order), stacked; the read's bytes counted.
    ///
    /// # Shapes
    /// - returns `[Σ len, width]` each
    fn read_ranges(&self, ranges: &[Range<usize>]) -> (Tensor<2>, Tensor<2>) {
        let (n, w) = (ranges.iter().map(|r| r.len()).sum::<usize>(), self.width());
        self.read_peak.set(self.read_peak.get().max(2 * n * w * 4));
        let make = |part| {
            let mut out = vec![0.0; n * w];
            self.gather(ranges, part, &mut out);
            Tensor::from_data(TensorData::new(out, [n, w]), &self.device)
        };
        (make(KvPart::K), make(KvPart::V))
    }
}

/// An f32 store's rows on a GPU: K and V buffers of `cap` rows, grown by doubling, the first
/// `len` committed. Appends write into them (Burn's `slice_assign`: in place where nothing
/// else holds the buffer, a copy where a prefix-cache fork still shares it); reads are views.
///
/// # Shapes
/// - `k`, `v`: `[cap, width]`
#[derive(Debug, Clone)]
struct DeviceRows {
    k: Option<Tensor<2>>,
    v: Option<Tensor<2>>,
    len: usize,
    width: usize,
    device: Device,
}

impl DeviceRows {
    /// Rows a store's buffers start with.
    const MIN_ROWS: usize = 64;

    fn new(width: usize, device: &Device) -> Self {
        Self {
            k: None,
            v: None,
            len: 0,
            width,
            device: device.clone(),
        }
    }

    fn cap(&self) -> usize {
        self.k.as_ref().map_or(0, |k| k.dims()[0])
    }

    fn nbytes(&self) -> usize {
        2 * self.cap() * self.width * 4
    }

    /// # Shapes
    /// - `k`, `v`: `[n, width]`, on the store's device
    fn append(&mut self, k: Tensor<2>, v: Tensor<2>) {
        let (n, w) = (k.dims()[0], self.width);
        self.grow(self.len + n);
        let put = |buf: Option<Tensor<2>>, rows: Tensor<2>, at: usize| {
            buf.map(|b| b.slice_assign([at..at + n, 0..w], rows))
        };
        self.k = put(self.k.take(), k, self.len);
        self.v = put(self.v.take(), v, self.len);
        self.len += n;
    }

    /// Buffers of at least `end` rows (doubling; the held rows copied over).
    fn grow(&mut self, end: usize) {
        if end <= self.cap() {
            return;
        }
        let w = self.width;
        let cap = end.next_power_of_two().max(Self::MIN_ROWS);
        let grow = |old: Option<Tensor<2>>, len: usize| {
            let fresh = Tensor::<2>::zeros([cap, w], &self.device);
            match old {
                Some(old) if len > 0 => {
                    fresh.slice_assign([0..len, 0..w], old.slice([0..len, 0..w]))
                }
                _ => fresh,
            }
        };
        self.k = Some(grow(self.k.take(), self.len));
        self.v = Some(grow(self.v.take(), self.len));
    }

    /// Room for `n` more rows, in buffers this store alone holds (a prefix-cache fork that
    /// still shares them gets its own copies first, as `slice_assign` would make).
    fn reserve(&mut self, n: usize) {
        self.grow(self.len + n);
        self.k = self.k.take().map(kakeya_models::gpu::unique_dense);
        self.v = self.v.take().map(kakeya_models::gpu::unique_dense);
    }

    /// # Shapes
    /// - returns `[positions.len, width]` each
    fn read(&self, positions: Range<usize>) -> (Tensor<2>, Tensor<2>) {
        let w = self.width;
        let view = |buf: &Option<Tensor<2>>| match buf {
            Some(b) => b.clone().slice([positions.clone(), 0..w]),
            None => Tensor::<2>::zeros([0, w], &self.device),
        };
        (view(&self.k), view(&self.v))
    }
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
