//! The residual tier of the `residual-*` modes: evicted K/V held as the quantised difference
//! between the raw K/V (k_proj / v_proj outputs, before k_norm and RoPE) and a restorer's
//! prediction of them (f_θ on the drafter's compact store, as AQUA-KV uses its predictors),
//! read back as prediction + residual.
//!
//! A position's raw K/V wait, exactly (f32), until the restorer can predict the position — for
//! f_θ, until the store holds its row, which it gets once committed — and are then predicted,
//! subtracted and quantised, once. Attention reads a position from this tier only from queries
//! at least a window younger, when it has long been committed; a position read before it is
//! settled is refused rather than read differently.

use std::ops::Range;

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::{DeferredKv, DraftContext, KvPart, ModelError};

use super::policy::QuantFormat;
use super::quant_tier::{QuantTier, SharedUndo};
use super::tiered::Shared;

/// Host rows of a `[n, width]` tensor.
fn host_rows(t: Tensor<2>) -> kakeya_models::Result<Vec<f32>> {
    t.into_data()
        .try_into_vec::<f32>()
        .map_err(|e| ModelError::Cache(format!("predicted K/V rows: {e:?}")))
}

/// Residuals of positions `first..settled`, raw K/V of `settled..end` waiting for their
/// prediction.
#[derive(Debug, Clone)]
pub(super) struct ResidualTier {
    quant: QuantTier,
    /// Position of the first row the tier ever holds (the sink boundary).
    first: usize,
    /// First position whose raw K/V wait (every position before it is in `quant`).
    settled: usize,
    /// Raw K and V rows of `settled..`, `width` values each.
    waiting: (Vec<f32>, Vec<f32>),
    width: usize,
}

impl ResidualTier {
    /// A tier of residuals in `format` for rows `width` wide (heads `head_dim` wide) whose
    /// first position is `first`.
    pub(super) fn new(
        format: QuantFormat,
        (width, head_dim): (usize, usize),
        first: usize,
        undo: SharedUndo,
    ) -> Self {
        Self {
            quant: QuantTier::new(format, (width, head_dim), first, undo),
            first,
            settled: first,
            waiting: (Vec::new(), Vec::new()),
            width,
        }
    }

    /// One past the last position recorded.
    fn end(&self) -> usize {
        self.settled + self.waiting.0.len() / self.width
    }

    /// Records the raw K/V of positions `start..start + n` (those before the tier's first
    /// position are the sinks', not kept here).
    ///
    /// # Shapes
    /// - `k_raw`, `v_raw`: `[n, width]`
    pub(super) fn record(
        &mut self,
        k_raw: Tensor<2>,
        v_raw: Tensor<2>,
        start: usize,
    ) -> kakeya_models::Result<()> {
        let [n, w] = k_raw.dims();
        if w != self.width || v_raw.dims() != [n, w] {
            return Err(ModelError::Cache(format!(
                "raw K/V rows of width {w} (V {:?}) for a residual tier of width {}",
                v_raw.dims(),
                self.width
            )));
        }
        let skip = self.first.saturating_sub(start).min(n);
        if skip == n {
            return Ok(());
        }
        if start + skip != self.end() {
            return Err(ModelError::Cache(format!(
                "raw K/V recorded at position {} but the residual tier is at {}",
                start + skip,
                self.end()
            )));
        }
        let rows = |t: Tensor<2>| host_rows(t.slice([skip..n, 0..w]));
        self.waiting.0.extend(rows(k_raw)?);
        self.waiting.1.extend(rows(v_raw)?);
        Ok(())
    }

    /// Quantises the residuals of every waiting position the restorer can now predict (all of
    /// them when it does not read the store; those the store holds rows for when it does).
    pub(super) fn settle(&mut self, layer: usize, shared: Shared<'_>) -> kakeya_models::Result<()> {
        let restorer = shared.restorer.ok_or_else(|| {
            ModelError::Cache(format!("layer {layer}: a residual tier needs a restorer"))
        })?;
        let predictable = if restorer.reads_store() {
            shared.store.map_or(0, |s| s.len())
        } else {
            usize::MAX
        };
        let to = predictable.min(self.end());
        if to <= self.settled {
            return Ok(());
        }
        let positions = self.settled..to;
        let n = positions.len() * self.width;
        let mut parts = Vec::with_capacity(2);
        for (part, raw) in [
            (KvPart::K, &mut self.waiting.0),
            (KvPart::V, &mut self.waiting.1),
        ] {
            let predicted =
                host_rows(restorer.restore(layer, positions.clone(), part, shared.store)?)?;
            let mut residual: Vec<f32> = raw.drain(..n).collect();
            raw.shrink_to_fit();
            for (r, p) in residual.iter_mut().zip(&predicted) {
                *r -= p;
            }
            parts.push(residual);
        }
        let v = parts.pop().expect("two parts");
        let k = parts.pop().expect("two parts");
        self.quant.push_rows(k, v);
        self.settled = to;
        Ok(())
    }

    /// Raw K or V of `positions` (`[n, width]`): the restorer's prediction plus the
    /// dequantised residual, and the bytes materialised.
    pub(super) fn read(
        &self,
        (layer, positions): (usize, Range<usize>),
        part: KvPart,
        shared: Shared<'_>,
        device: &Device,
    ) -> kakeya_models::Result<(DeferredKv, usize)> {
        if positions.end > self.settled {
            return Err(ModelError::Cache(format!(
                "layer {layer}: positions {positions:?} read from the residual tier, which has settled positions up to {} (the store lacks the rest's rows)",
                self.settled
            )));
        }
        let restorer = shared.restorer.ok_or_else(|| {
            ModelError::Cache(format!("layer {layer}: a residual tier needs a restorer"))
        })?;
        let n = positions.len();
        let mut residual = vec![0.0f32; n * self.width];
        self.quant
            .read_rows_into(positions.clone(), part, &mut residual)?;
        if let (Some(r), KvPart::V) = (&self.quant.rotation, part) {
            r.undo(&mut residual);
        }
        let predicted = restorer.restore(layer, positions, part, shared.store)?;
        let residual = Tensor::<2>::from_data(
            TensorData::new(residual, [n, self.width]),
            &predicted.device(),
        );
        let raw = (predicted + residual).to_device(device);
        // The residual, the prediction, their sum and its attention form exist together.
        Ok((DeferredKv::Raw(raw), 4 * n * self.width * 4))
    }

    /// Forgets residuals of positions before `pos` (never read again).
    pub(super) fn drop_before(&mut self, pos: usize) {
        self.quant.drop_before(pos.min(self.settled));
    }

    /// Forgets positions `>= len` (`len` at least the tier's first position).
    pub(super) fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
        if len >= self.settled {
            let keep = (len.min(self.end()) - self.settled) * self.width;
            self.waiting.0.truncate(keep);
            self.waiting.1.truncate(keep);
            return Ok(());
        }
        self.quant.truncate(len)?;
        self.waiting.0.clear();
        self.waiting.1.clear();
        self.settled = len;
        Ok(())
    }

    /// Bytes held: the quantised residuals and the raw rows waiting.
    pub(super) fn nbytes(&self) -> usize {
        self.quant.nbytes() + (self.waiting.0.capacity() + self.waiting.1.capacity()) * 4
    }
}
