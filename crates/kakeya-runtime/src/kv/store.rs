//! The compact per-position store: the drafter's context K (after k_norm, before RoPE) and V of
//! every drafter layer, one row per committed position. The DFlash proposer drafts from it and
//! restoration rebuilds evicted verifier K/V from it — one copy, its bytes counted.

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
    }

    /// Bytes held (both row sets).
    pub fn nbytes(&self) -> usize {
        self.k.nbytes() + self.v.nbytes()
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
        self.k.len()
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
        self.k.push(&host_rows(k)?);
        self.v.push(&host_rows(v)?);
        Ok(())
    }

    fn read(&self, positions: Range<usize>) -> kakeya_models::Result<(Tensor<2>, Tensor<2>)> {
        self.check(&positions)?;
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
}
