//! A tree of drafts verified in one forward ([`Session::forward_tree`]), then the accepted path
//! kept ([`Session::keep_path`]): the caches take back the tree's rows and are written the
//! path's K/V at the next positions, as plain decoding of the path would have left them.

use std::ops::Range;

use burn::tensor::{Int, Tensor, TensorData};
use kakeya_models::{
    Choice, DeferredKv, ForwardOutput, HostTier, InPlace, KvLayers, KvPart, KvSegment, Logits,
    TreeRows,
};

use super::Session;
use crate::error::{Result, RuntimeError};

/// Each layer's K and V of a forward's rows, `[kv_heads, rows, head_dim]` each (`None`: a
/// layer that reads another's K/V and writes none).
pub(super) type LayerRows = Vec<Option<(Tensor<3>, Tensor<3>)>>;

/// A verified tree whose path is not chosen yet: where it starts, its shape, and the K/V its
/// forward wrote.
#[derive(Debug, Clone)]
pub(super) struct TreeBlock {
    /// The tree's first position (its root's).
    pub(super) start: usize,
    /// Its shape.
    pub(super) tree: TreeRows,
    /// Each layer's K/V of its rows.
    pub(super) kv: LayerRows,
}

/// A sequence's caches as a forward sees them, keeping each layer's written K/V on the side
/// when asked (a tree's rows, rewritten once its path is chosen). Nothing is written in place
/// while keeping: every write goes through [`KvLayers::update`].
pub(super) struct Recording<'a> {
    inner: &'a mut dyn KvLayers,
    kept: Option<LayerRows>,
}

impl<'a> Recording<'a> {
    /// `inner` as it is, keeping its layers' writes when `keep`.
    pub(super) fn new(inner: &'a mut dyn KvLayers, keep: bool) -> Self {
        let kept = keep.then(|| vec![None; inner.layer_count()]);
        Self { inner, kept }
    }

    /// What the forward wrote, when kept.
    pub(super) fn into_kept(self) -> Option<LayerRows> {
        self.kept
    }
}

impl KvLayers for Recording<'_> {
    fn layer_count(&self) -> usize {
        self.inner.layer_count()
    }

    fn update(
        &mut self,
        layer: usize,
        k: Tensor<3>,
        v: Tensor<3>,
        start: usize,
    ) -> kakeya_models::Result<Vec<KvSegment>> {
        if let Some(slot) = self.kept.as_mut().and_then(|kept| kept.get_mut(layer)) {
            *slot = Some((k.clone(), v.clone()));
        }
        self.inner.update(layer, k, v, start)
    }

    fn deferred(
        &mut self,
        layer: usize,
        positions: Range<usize>,
        part: KvPart,
    ) -> kakeya_models::Result<DeferredKv> {
        self.inner.deferred(layer, positions, part)
    }

    fn wants_raw(&self, layer: usize) -> bool {
        self.inner.wants_raw(layer)
    }

    fn record_raw(
        &mut self,
        layer: usize,
        k_raw: Tensor<2>,
        v_raw: Tensor<2>,
        start: usize,
    ) -> kakeya_models::Result<()> {
        self.inner.record_raw(layer, k_raw, v_raw, start)
    }

    fn in_place(&mut self, layer: usize, start: usize, like: &Tensor<3>) -> Option<InPlace> {
        match self.kept {
            Some(_) => None,
            None => self.inner.in_place(layer, start, like),
        }
    }

    fn host_tier(&mut self, layer: usize) -> Option<&dyn HostTier> {
        self.inner.host_tier(layer)
    }

    fn truncate(&mut self, len: usize) -> kakeya_models::Result<()> {
        self.inner.truncate(len)
    }
}

/// `rows` of `t` along its second dimension.
///
/// # Shapes
/// - `t`: `[a, n, b]` → `[a, rows.len(), b]`
fn select_rows<const D: usize>(t: Tensor<D>, dim: usize, rows: &[usize]) -> Tensor<D> {
    let ids: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [rows.len()]), &t.device());
    t.select(dim, ids)
}

impl Session<'_> {
    /// Runs `tokens` as the tree `tree` at the next positions in one forward (row `i` at the
    /// next position plus its depth, seeing the committed positions and its ancestors),
    /// returning what `logits` and `choice` ask for, row by row as a plain forward of the path to each
    /// row gives it. The caches hold the rows until [`Self::keep_path`] keeps one path (or
    /// [`Self::truncate`] drops them all); no other forward runs before. On the CPU, in a KV
    /// mode that does not rebuild K/V with f_θ.
    ///
    /// # Shapes
    /// - `tokens`: `T` ids, `tree`: `T` rows → logits `[1 or T, vocab]`
    pub fn forward_tree(
        &mut self,
        tokens: &[u32],
        tree: &TreeRows,
        logits: Logits,
        choice: Option<Choice>,
    ) -> Result<ForwardOutput> {
        let layers = self.kv.layer_count();
        if self.policy.mode.restores() || (0..layers).any(|l| self.kv.wants_raw(l)) {
            return Err(RuntimeError::Input(format!(
                "KV mode {} rebuilds evicted K/V with f_θ: verify chains, not trees",
                self.policy.mode
            )));
        }
        let mut out = Self::forward_many(
            &mut [self],
            &[tokens],
            &[(logits, choice)],
            &[],
            &[Some(tree)],
        )?;
        Ok(out.pop().expect("one output per session"))
    }

    /// Keeps the path `path` (row indices from the root, as [`TreeRows::path_to`] gives them)
    /// of the tree [`Self::forward_tree`] ran, and drops its other rows: the caches then hold
    /// the path's K/V at the positions after the tree's start, exactly as a forward of the
    /// path alone would have written them, and the path's positions are committed like a
    /// block's.
    pub fn keep_path(&mut self, path: &[usize]) -> Result<()> {
        let tree = &self
            .tree_block
            .as_ref()
            .ok_or_else(|| RuntimeError::Input("no verified tree to keep a path of".into()))?
            .tree;
        let last = *path
            .last()
            .ok_or_else(|| RuntimeError::Input("an empty path: the root is always kept".into()))?;
        if last >= tree.len() || tree.path_to(last) != path {
            return Err(RuntimeError::Input(format!(
                "rows {path:?} are not a path from the root of a tree of {} rows",
                tree.len()
            )));
        }
        let block = self.tree_block.take().expect("checked above");
        // The drafter's target-layer rows waiting for the store: the path's.
        let pending = self
            .feed
            .take_pending()
            .filter(|(from, _)| *from == block.start)
            .map(|(from, h)| (from, select_rows(h, 0, path)));
        self.kv.truncate(block.start)?;
        for (layer, kv) in block.kv.into_iter().enumerate() {
            if let Some((k, v)) = kv {
                let (k, v) = (select_rows(k, 1, path), select_rows(v, 1, path));
                self.kv.update(layer, k, v, block.start)?;
            }
        }
        if let Some((from, h)) = pending {
            self.feed.hold(from, h);
        }
        self.len = block.start + path.len();
        self.commit()
    }
}
