//! Proposers: what drafts the tokens a verifier then checks.

use kakeya_models::{DFlashDrafter, DraftContext, DraftRequest};

use crate::error::{Result, RuntimeError};
use crate::kv::CompactStore;

/// Drafts continuations of the committed sequence.
pub trait Proposer {
    /// Drafts `n` tokens to follow `last`, the newest committed token, which sits at position
    /// `pos`. `store` is the sequence's compact store (the drafter's context of every committed
    /// position before `pos`), when the session keeps one.
    fn propose(
        &mut self,
        last: u32,
        pos: usize,
        n: usize,
        store: Option<&mut CompactStore>,
    ) -> Result<Vec<u32>>;

    /// The drafter whose context the session's compact store must hold, if any.
    fn drafter(&self) -> Option<&DFlashDrafter> {
        None
    }
}

/// The DFlash drafter as a proposer: it drafts a block in one forward over the session's
/// compact store (which the session fills as positions are committed).
#[derive(Debug, Clone, Copy)]
pub struct DFlashProposer<'d> {
    drafter: &'d DFlashDrafter,
}

impl<'d> DFlashProposer<'d> {
    /// A proposer drafting with `drafter`.
    pub fn new(drafter: &'d DFlashDrafter) -> Self {
        Self { drafter }
    }
}

impl Proposer for DFlashProposer<'_> {
    fn propose(
        &mut self,
        last: u32,
        pos: usize,
        n: usize,
        store: Option<&mut CompactStore>,
    ) -> Result<Vec<u32>> {
        let store = store.ok_or_else(|| {
            RuntimeError::Input(
                "the DFlash proposer drafts from the compact store: the session keeps none".into(),
            )
        })?;
        if pos != store.len() {
            return Err(RuntimeError::Input(format!(
                "draft at position {pos} but the store holds {} positions",
                store.len()
            )));
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut block = vec![self.drafter.config.mask_token_id; n + 1];
        block[0] = last;
        let out = self.drafter.forward(
            &DraftRequest {
                context: None,
                block: &block,
                capture_context: false,
            },
            store,
        )?;
        Ok(self.drafter.draft_tokens(out.hidden))
    }

    fn drafter(&self) -> Option<&DFlashDrafter> {
        Some(self.drafter)
    }
}

/// Proposes a known continuation (e.g. the AR output of the same prompt): drafts are always
/// right while the sequence follows it. Measures the engine's ceiling and overhead.
#[derive(Debug, Clone)]
pub struct ReplayProposer {
    /// The whole expected sequence, prompt included, by position.
    sequence: Vec<u32>,
}

impl ReplayProposer {
    /// Replays `prompt` followed by `continuation`.
    pub fn new(prompt: &[u32], continuation: &[u32]) -> Self {
        Self {
            sequence: prompt.iter().chain(continuation).copied().collect(),
        }
    }
}

impl Proposer for ReplayProposer {
    fn propose(
        &mut self,
        _last: u32,
        pos: usize,
        n: usize,
        _store: Option<&mut CompactStore>,
    ) -> Result<Vec<u32>> {
        let from = (pos + 1).min(self.sequence.len());
        let to = (pos + 1 + n).min(self.sequence.len());
        let mut out = self.sequence[from..to].to_vec();
        // Past the known continuation: pad with its last token (rejected unless right).
        out.resize(n, self.sequence.last().copied().unwrap_or(0));
        Ok(out)
    }
}
