//! Draft trees from every source the chain engine reads, for one verify: the chain it would
//! draft (a lookup, else the static table, else the drafter's top-1), every earlier
//! occurrence of the sequence's tail, the table's chain, and — on blocks where the chain
//! would run the drafter — the drafter's top-k per position; merged and cut best-first to a
//! row budget ([`DraftTree::best_first`]), each source's chances calibrated by what it earned
//! ([`EdgeCalibration`]).

use std::sync::Arc;

use kakeya_models::{DFlashDrafter, DraftContext, DraftRequest};

use super::adaptive::DraftSource;
use super::ngram::NgramProposer;
use super::proposer::{Proposer, last_token};
use super::table::NgramTable;
use super::tree::{DraftTree, EdgeCalibration, EdgeSource, LOOKUP_OCCURRENCES};
use crate::error::{Result, RuntimeError};
use crate::kv::CompactStore;

/// Candidates per drafted position taken from the drafter's distribution, by default.
pub const DEFAULT_TOP_K: usize = 4;

/// What one block's tree is built from.
#[derive(Debug, Clone)]
pub struct TreeEvidence {
    /// The newest committed token (the root).
    pub last: u32,
    /// The chain the engine would draft, and where it came from.
    pub chain: (Vec<u32>, DraftSource),
    /// Where the tokens after each earlier occurrence of the tail start, latest first.
    pub lookup_nexts: Vec<usize>,
    /// The static table's chain (empty without a table or a context it holds).
    pub table_chain: Vec<u32>,
    /// The drafter's top-k tokens and probabilities per drafted position (empty when the
    /// drafter did not run).
    pub candidates: Vec<Vec<(u32, f32)>>,
}

impl TreeEvidence {
    /// The tree of at most `rows` rows (root included) from this evidence after `tokens`,
    /// chances scaled by `calib`: the best-scored nodes of [`Self::candidates`].
    pub fn tree(&self, tokens: &[u32], rows: usize, calib: &EdgeCalibration) -> DraftTree {
        self.candidates(tokens, rows, calib).best_first(rows)
    }

    /// Every source's candidates for a tree of `rows` rows after `tokens`, merged (up to
    /// `rows − 1` deep; the drafter's expanded best-first to `4 · rows` nodes), before the cut.
    pub fn candidates(&self, tokens: &[u32], rows: usize, calib: &EdgeCalibration) -> DraftTree {
        let depth = rows.saturating_sub(1);
        let mut all = DraftTree::new(self.last);
        let (chain, source) = &self.chain;
        all.add_path(
            &chain[..chain.len().min(depth)],
            EdgeSource::Chain(*source),
            1.0,
            calib,
        );
        all.add_lookups(tokens, &self.lookup_nexts, depth, calib);
        if !self.table_chain.is_empty() {
            let t = &self.table_chain[..self.table_chain.len().min(depth)];
            all.add_path(t, EdgeSource::Table, 1.0, calib);
        }
        all.grow(&self.candidates, EdgeSource::Drafter, 4 * rows, calib);
        all
    }
}

/// The sources of a sequence's trees and their calibration.
pub struct TreeDrafts<'d> {
    drafter: Option<&'d DFlashDrafter>,
    lookups: NgramProposer,
    table: Option<Arc<NgramTable>>,
    top_k: usize,
    calib: EdgeCalibration,
}

impl<'d> TreeDrafts<'d> {
    /// Trees from `drafter` (its top `top_k` per position), lookups and `table`.
    pub fn new(
        drafter: Option<&'d DFlashDrafter>,
        table: Option<Arc<NgramTable>>,
        top_k: usize,
    ) -> Self {
        Self {
            drafter,
            lookups: NgramProposer::with_table(table.clone()),
            table,
            top_k: top_k.max(1),
            calib: EdgeCalibration::default(),
        }
    }

    /// The drafter, when there is one.
    pub fn drafter(&self) -> Option<&'d DFlashDrafter> {
        self.drafter
    }

    /// Where the engine's chain would come from after `tokens` (the combined proposer's
    /// order: a lookup, else the table, else the drafter, else nothing).
    pub fn source(&mut self, tokens: &[u32]) -> DraftSource {
        match self.lookups.source(tokens) {
            DraftSource::Nothing if self.drafter.is_some() => DraftSource::Model,
            s => s,
        }
    }

    /// The evidence of a tree `depth` drafts deep after `tokens`; the drafter runs when
    /// given `store` (which must hold every position before the newest token).
    pub fn evidence(
        &mut self,
        tokens: &[u32],
        depth: usize,
        store: Option<&mut CompactStore>,
    ) -> Result<TreeEvidence> {
        let (pos, last) = last_token(tokens)?;
        let source = self.source(tokens);
        let candidates = match (store, self.drafter) {
            (Some(store), Some(d)) => {
                if pos != store.len() {
                    return Err(RuntimeError::Input(format!(
                        "a tree drafted at position {pos} but the store holds {} positions",
                        store.len()
                    )));
                }
                drafter_candidates(d, last, store, self.top_k)?
            }
            _ => Vec::new(),
        };
        let lookup_nexts = self
            .lookups
            .all_matches(tokens, LOOKUP_OCCURRENCES)
            .map_or_else(Vec::new, |m| m.1);
        let lookup_chain = self
            .lookups
            .find(tokens)
            .map(|m| NgramProposer::following_from(tokens, m.next, depth));
        let table_chain = self
            .table
            .as_ref()
            .map(|t| t.draft(tokens, depth).1)
            .unwrap_or_default();
        let chain = match (lookup_chain, table_chain.is_empty()) {
            (Some(l), _) => l,
            (None, false) => table_chain.clone(),
            (None, true) => candidates
                .iter()
                .filter_map(|c| Some(c.first()?.0))
                .take(depth)
                .collect(),
        };
        Ok(TreeEvidence {
            last,
            chain: (chain, source),
            lookup_nexts,
            table_chain,
            candidates,
        })
    }

    /// The tree of at most `rows` rows from `evidence`, under this sequence's calibration.
    pub fn tree(&self, evidence: &TreeEvidence, tokens: &[u32], rows: usize) -> DraftTree {
        evidence.tree(tokens, rows, &self.calib)
    }

    /// Teaches the calibration what a verify of `tree` showed: `truth` is what it committed
    /// after the root.
    pub fn observe(&mut self, tree: &DraftTree, truth: &[u32]) {
        self.calib.observe(tree, truth);
    }
}

/// The drafter's top-`k` tokens (the verifier's ids) and probabilities at each drafted
/// position of one block after `last`, over `store`.
pub fn drafter_candidates(
    d: &DFlashDrafter,
    last: u32,
    store: &mut CompactStore,
    k: usize,
) -> Result<Vec<Vec<(u32, f32)>>> {
    let mut block = vec![d.config.mask_token_id; d.block_size()];
    block[0] = last;
    let out = d.forward(
        &DraftRequest {
            context: None,
            block: &block,
            capture_context: false,
        },
        store,
    )?;
    let [b, h] = out.hidden.dims();
    let logits = d.logits(out.hidden.slice([1..b, 0..h]));
    let [rows, vocab] = logits.dims();
    let data = logits
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| RuntimeError::Input(format!("drafter logits: {e:?}")))?;
    Ok((0..rows)
        .map(|r| top_k_probs(&data[r * vocab..(r + 1) * vocab], k))
        .map(|c| c.into_iter().map(|(id, p)| (d.to_target(id), p)).collect())
        .collect())
}

/// The `k` largest softmax probabilities of `logits` with their indices, largest first (ties:
/// the lower index).
pub fn top_k_probs(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(k - 1, |&a, &b| {
        logits[b].total_cmp(&logits[a]).then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    idx.into_iter()
        .map(|i| (i, (logits[i] - max).exp() / sum))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::top_k_probs;

    #[test]
    fn top_k_probs_are_the_softmax_of_the_largest_logits_in_order() {
        let p = top_k_probs(&[0.0, 2.0, 1.0, 2.0], 3);
        let ids: Vec<usize> = p.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        let z = 1.0 + 2.0 * 2f32.exp() + 1f32.exp();
        assert!((p[0].1 - 2f32.exp() / z).abs() < 1e-6);
        assert!((p[2].1 - 1f32.exp() / z).abs() < 1e-6);
    }
}
