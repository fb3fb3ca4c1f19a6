//! The quantised tier of a bounded layer: K/V rows of a run of positions, keys per token or
//! per channel, what is grouped per token optionally rotated.

use std::ops::Range;

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::{DeferredKv, KvPart, ModelError};

use super::channels::ChannelRows;
use super::policy::{QuantFormat, Ranges};
use super::rotation::Rotation;
use super::rows::{MAX_GROUP, QuantRows, Rows};

/// Seed of the rotation's signs: fixed, so a cache's contents never depend on the run.
const ROTATION_SEED: u64 = 0x6b61_6b65_7961;

/// `[kv_heads, T, head_dim]` → host rows `[T, kv_heads · head_dim]`.
pub(super) fn to_rows(t: &Tensor<3>) -> kakeya_models::Result<Vec<f32>> {
    let [h, n, d] = t.dims();
    t.clone()
        .swap_dims(0, 1)
        .reshape([n, h * d])
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| ModelError::Cache(format!("K/V rows: {e:?}")))
}

/// Host rows `[n, kv_heads · head_dim]` → `[kv_heads, n, head_dim]`.
pub(super) fn from_rows(rows: Vec<f32>, heads: usize, dim: usize, device: &Device) -> Tensor<3> {
    let n = rows.len() / (heads * dim);
    Tensor::<3>::from_data(TensorData::new(rows, [n, heads, dim]), device).swap_dims(0, 1)
}

/// The inverse rotation of a head width, made once and shared by a sequence's layers.
pub type SharedUndo = std::sync::Arc<std::sync::OnceLock<Tensor<2>>>;

/// Quantised keys: per token (groups of 64 values) or per channel over blocks of positions.
#[derive(Debug, Clone)]
pub(super) enum KeyRows {
    Tokens(Rows),
    Channels(ChannelRows),
}

/// Quantised K/V rows of positions `first..first + rows` (keys per channel: from the first
/// complete block on). With a rotation, what is grouped per token is rotated: values, and keys
/// when they are grouped per token (per-channel groups already give each channel its own step:
/// on the default model's global layers a rotation changes their error by under 1 %).
#[derive(Debug, Clone)]
pub(super) struct QuantTier {
    pub(super) k: KeyRows,
    pub(super) v: Rows,
    pub(super) first: usize,
    pub(super) rotation: Option<Rotation>,
    /// The rotation's inverse as a `[head_dim, head_dim]` matrix, made at the first read off
    /// the CPU (a GPU's tensor path) and shared by the sequence's layers of this head width
    /// (counted once, by the sequence).
    undo: SharedUndo,
}

impl QuantTier {
    /// A tier in `format` for rows `width` wide (heads `head_dim` wide, for the rotation)
    /// whose first position is `first`.
    pub(super) fn new(
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
                let mut rows = ChannelRows::new(format.k_bits, width, first);
                if fitted {
                    rows = rows.fitted();
                }
                if format.k_mixed {
                    rows = rows.mixed();
                }
                KeyRows::Channels(rows)
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
    pub(super) fn push(&mut self, k: &Tensor<3>, v: &Tensor<3>) -> kakeya_models::Result<()> {
        self.push_rows(to_rows(k)?, to_rows(v)?);
        Ok(())
    }

    /// Quantises and appends host rows `[T, kv_heads · head_dim]` of K and V.
    pub(super) fn push_rows(&mut self, mut k: Vec<f32>, mut v: Vec<f32>) {
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
    }

    /// Forgets rows of positions before `pos` (never read again).
    pub(super) fn drop_before(&mut self, pos: usize) {
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

    pub(super) fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
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
    pub(super) fn read_rows_into(
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
    pub(super) fn read(
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
    pub(super) fn read_head(
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

    pub(super) fn nbytes(&self) -> usize {
        let k = match &self.k {
            KeyRows::Tokens(rows) => rows.nbytes(),
            KeyRows::Channels(rows) => rows.nbytes(),
        };
        k + self.v.nbytes()
    }
}
