//! What the drafter's compact store waits for: the hidden states at the drafter's target layers
//! that forwards produced, until their positions are committed and their rows computed.

use burn::tensor::Tensor;
use kakeya_models::{DFlashDrafter, DraftContext};

use crate::error::{Result, RuntimeError};
use crate::kv::CompactStore;

/// Most committed positions that wait for their store rows.
const BACKLOG_MAX: usize = 64;

/// The store's feed: the last forward's hidden states (not committed yet), then committed
/// positions whose rows are not computed yet. The rows are computed in one batch when the
/// store is read (a draft), when [`BACKLOG_MAX`] positions wait, or at once where forwards
/// read the store (the restored modes), so plain decode steps between drafts pay no drafter
/// projections.
#[derive(Debug, Clone, Default)]
pub(super) struct StoreFeed {
    /// Hidden states `[T, Σ target widths]` of positions `from..`, not yet committed.
    pending: Option<(usize, Tensor<2>)>,
    /// Committed positions waiting for their rows, as (first position, hidden states) chunks
    /// in order.
    backlog: Vec<(usize, Tensor<2>)>,
}

impl StoreFeed {
    /// Holds the hidden states of a forward whose first position is `from`, replacing what
    /// an earlier forward left uncommitted.
    pub(super) fn hold(&mut self, from: usize, hidden: Tensor<2>) {
        self.pending = Some((from, hidden));
    }

    /// The uncommitted hidden states, taken.
    pub(super) fn take_pending(&mut self) -> Option<(usize, Tensor<2>)> {
        self.pending.take()
    }

    /// Forgets everything waiting (the store was released).
    pub(super) fn clear(&mut self) {
        self.pending = None;
        self.backlog.clear();
    }

    /// Bytes of the hidden states waiting for their rows in the backlog.
    pub(super) fn waiting_bytes(&self) -> usize {
        self.backlog
            .iter()
            .map(|(_, h)| h.dims().iter().product::<usize>() * 4)
            .sum()
    }

    /// Commits the positions below `len`: the pending hidden states of those positions join
    /// the backlog. Returns whether the backlog should be computed now (`eager`, or
    /// [`BACKLOG_MAX`] positions wait).
    pub(super) fn commit(&mut self, len: usize, eager: bool) -> bool {
        let Some((from, aux)) = self.pending.take() else {
            return false;
        };
        let n = len.saturating_sub(from);
        if n == 0 {
            return false;
        }
        let w = aux.dims()[1];
        self.backlog.push((from, aux.slice([0..n, 0..w])));
        eager || len - self.backlog[0].0 >= BACKLOG_MAX
    }

    /// Computes the backlog's store rows in one batch and appends them to `store`.
    pub(super) fn flush(
        &mut self,
        drafter: &DFlashDrafter,
        store: &mut CompactStore,
    ) -> Result<()> {
        if self.backlog.is_empty() {
            return Ok(());
        }
        let from = self.backlog[0].0;
        let aux = Tensor::cat(self.backlog.drain(..).map(|(_, h)| h).collect(), 0);
        if store.len() != from {
            return Err(RuntimeError::Input(format!(
                "store holds {} positions, committing rows from {from}",
                store.len()
            )));
        }
        drafter.append_context(aux, store)?;
        Ok(())
    }

    /// Forgets what waits for positions `>= len`.
    pub(super) fn truncate(&mut self, len: usize) {
        self.backlog.retain(|(from, _)| *from < len);
        if let Some((from, h)) = self.backlog.last_mut()
            && *from + h.dims()[0] > len
        {
            let w = h.dims()[1];
            *h = h.clone().slice([0..len - *from, 0..w]);
        }
        if self.pending.as_ref().is_some_and(|(from, _)| *from > len) {
            self.pending = None;
        }
    }
}
