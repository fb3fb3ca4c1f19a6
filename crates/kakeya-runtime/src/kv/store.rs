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

/// Rows of drafter context K and V, f32 or quantised.
#[derive(Debug, Clone)]
pub struct CompactStore {
    k: Rows,
    v: Rows,
    /// The rows themselves where the store is f32 on a GPU (`k` and `v` then stay empty and
    /// only give the width).
    on_device: Option<DeviceRows>,
    device: Device,
    /// Largest read so far (bytes of f32 rows materialised by one read).
    read_peak: Cell<usize>,
}

impl CompactStore {
    /// An empty store of `width`-value rows (`drafter layers · kv_heads · head_dim`), quantised
    /// when `bits` is given.
    pub fn new(width: usize, bits: Option<Bits>, device: &Device) -> Self {
        Self {
            k: Rows::new(width, bits),
            v: Rows::new(width, bits),
            on_device: (bits.is_none() && kakeya_models::gpu::is_gpu(device))
                .then(|| DeviceRows::new(width, device)),
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
        self.k.truncate(len);
        self.v.truncate(len);
        if let Some(d) = &mut self.on_device {
            d.len = d.len.min(len);
        }
    }

    /// Bytes held (both row sets; on a GPU the buffers as allocated, grown by doubling).
    pub fn nbytes(&self) -> usize {
        self.k.nbytes() + self.v.nbytes() + self.on_device.as_ref().map_or(0, DeviceRows::nbytes)
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
        let rows = match part {
            KvPart::K => &self.k,
            KvPart::V => &self.v,
        };
        self.read_peak.set(self.read_peak.get().max(n * w * 4));
        Ok(Tensor::from_data(
            TensorData::new(rows.read(positions.start, positions.end), [n, w]),
            &self.device,
        ))
    }

    fn check(&self, positions: &Range<usize>) -> kakeya_models::Result<()> {
        if positions.end > self.len() || positions.start > positions.end {
            return Err(ModelError::Cache(format!(
                "store read of positions {positions:?}, but it holds {}",
                self.len()
            )));
        }
        Ok(())
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
        self.on_device
            .as_ref()
            .map_or_else(|| self.k.len(), |d| d.len)
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
        self.k.push(&host_rows(k)?);
        self.v.push(&host_rows(v)?);
        Ok(())
    }

    fn read(&self, positions: Range<usize>) -> kakeya_models::Result<(Tensor<2>, Tensor<2>)> {
        self.check(&positions)?;
        if let Some(d) = &self.on_device {
            return Ok(d.read(positions));
        }
        let n = positions.len();
        let w = self.width();
        let make = |rows: &Rows| {
            Tensor::from_data(
                TensorData::new(rows.read(positions.start, positions.end), [n, w]),
                &self.device,
            )
        };
        self.read_peak.set(self.read_peak.get().max(2 * n * w * 4));
        Ok((make(&self.k), make(&self.v)))
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
