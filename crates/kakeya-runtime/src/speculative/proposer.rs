//! Proposers: what drafts the tokens a verifier then checks.

use std::sync::Arc;

use kakeya_models::{DFlashDrafter, DraftContext};

use serde::{Deserialize, Serialize};

use super::adaptive::DraftSource;
use super::ngram::{CombinedProposer, NgramProposer};
use super::table::NgramTable;
use crate::error::{Result, RuntimeError};
use crate::kv::CompactStore;

/// Drafts continuations of the committed sequence.
pub trait Proposer: Send {
    /// Drafts up to `n` tokens to follow `tokens`, the committed sequence (prompt included; its
    /// last token, at position `tokens.len() - 1`, is not yet in the caches). `store` is the
    /// sequence's compact store (the drafter's context of every committed position before the
    /// last), when the session keeps one. Fewer than `n` drafts (none included) is allowed:
    /// the block is then shorter.
    fn propose(
        &mut self,
        tokens: &[u32],
        n: usize,
        store: Option<&mut CompactStore>,
    ) -> Result<Vec<u32>>;

    /// Where the next [`Self::propose`] on `tokens` would draft from, found without a forward:
    /// the adaptive schedule keeps its evidence per source. Default: a model.
    fn source(&mut self, tokens: &[u32]) -> DraftSource {
        let _ = tokens;
        DraftSource::Model
    }

    /// The drafter whose context the session's compact store must hold, if any.
    fn drafter(&self) -> Option<&DFlashDrafter> {
        None
    }

    /// The part of this proposer that drafts by lookups alone (no drafter, so no compact
    /// store needed), if it has one: what a sequence whose store was released drafts with.
    fn lookups(&self) -> Option<Box<dyn Proposer>> {
        None
    }
}

/// The position and id of the newest committed token.
pub(crate) fn last_token(tokens: &[u32]) -> Result<(usize, u32)> {
    match tokens.last() {
        Some(&t) => Ok((tokens.len() - 1, t)),
        None => Err(RuntimeError::Input(
            "nothing to draft from: the sequence is empty".into(),
        )),
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
        tokens: &[u32],
        n: usize,
        store: Option<&mut CompactStore>,
    ) -> Result<Vec<u32>> {
        let (pos, last) = last_token(tokens)?;
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
        Ok(self.drafter.draft(&block, store)?)
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
        tokens: &[u32],
        n: usize,
        _store: Option<&mut CompactStore>,
    ) -> Result<Vec<u32>> {
        let (pos, _) = last_token(tokens)?;
        let from = (pos + 1).min(self.sequence.len());
        let to = (pos + 1 + n).min(self.sequence.len());
        let mut out = self.sequence[from..to].to_vec();
        // Past the known continuation: pad with its last token (rejected unless right).
        out.resize(n, self.sequence.last().copied().unwrap_or(0));
        Ok(out)
    }
}

/// What drafts the tokens of speculative decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DraftKind {
    /// The DFlash drafter.
    Dflash,
    /// Prompt lookup: the tokens that followed the latest earlier match of the last 6 … 1
    /// tokens, else the static n-gram table's (if one is loaded); no drafter needed.
    Ngram,
    /// Prompt lookup when the last 6 … 1 tokens match earlier text, the static n-gram
    /// table next (if one is loaded), the DFlash drafter otherwise.
    Combined,
}

impl DraftKind {
    /// Every kind, in the order `--draft` lists them.
    pub const ALL: [DraftKind; 3] = [DraftKind::Dflash, DraftKind::Ngram, DraftKind::Combined];

    /// Whether it drafts with the DFlash drafter.
    pub fn needs_drafter(self) -> bool {
        self != DraftKind::Ngram
    }

    /// Whether it drafts by lookups (the kinds a static n-gram table backs).
    pub fn looks_up(self) -> bool {
        self != DraftKind::Dflash
    }

    /// Its name (`--draft`, stats).
    pub fn name(self) -> &'static str {
        match self {
            DraftKind::Dflash => "dflash",
            DraftKind::Ngram => "ngram",
            DraftKind::Combined => "combined",
        }
    }

    /// A proposer of this kind (`drafter` must be given for the kinds that need one; `table`
    /// backs the lookups of `ngram` and `combined`).
    pub fn proposer<'d>(
        self,
        drafter: Option<&'d DFlashDrafter>,
        table: Option<Arc<NgramTable>>,
    ) -> Result<Box<dyn Proposer + 'd>> {
        Ok(match (self, drafter) {
            (DraftKind::Ngram, _) => Box::new(NgramProposer::with_table(table)),
            (DraftKind::Dflash, Some(d)) => Box::new(DFlashProposer::new(d)),
            (DraftKind::Combined, Some(d)) => Box::new(CombinedProposer::new(
                Box::new(DFlashProposer::new(d)),
                table,
            )),
            (k, None) => {
                return Err(RuntimeError::Input(format!(
                    "--draft {} drafts with a DFlash drafter: pass --drafter DIR (or use --draft ngram)",
                    k.name()
                )));
            }
        })
    }
}

impl std::fmt::Display for DraftKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DraftKind {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("unknown draft kind `{s}` (use dflash, ngram or combined)"))
    }
}
