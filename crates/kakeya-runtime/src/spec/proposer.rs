//! Proposers: what drafts the tokens a verifier then checks.

use burn::tensor::Tensor;
use kakeya_models::{DFlashDrafter, DraftRequest};

use crate::error::{Result, RuntimeError};
use crate::kv::KvCache;

/// Drafts continuations of the committed sequence.
///
/// The driver tells a proposer about every position the verifier commits, in order, with the
/// verifier's hidden states after [`Proposer::aux_layers`] for those positions; the proposer
/// never sees rejected positions.
pub trait Proposer {
    /// Verifier layers whose hidden states the proposer conditions on (may be empty).
    fn aux_layers(&self) -> Vec<usize>;

    /// Records committed positions: their tokens and, when [`Proposer::aux_layers`] is not
    /// empty, their aux hidden states `[n, K · hidden]`.
    fn observe(&mut self, tokens: &[u32], aux: Option<Tensor<2>>) -> Result<()>;

    /// Drafts `n` tokens to follow `last`, the newest committed token, which sits at position
    /// `pos` (not yet observed).
    fn propose(&mut self, last: u32, pos: usize, n: usize) -> Result<Vec<u32>>;

    /// Bytes of state the proposer holds (its context cache).
    fn nbytes(&self) -> usize {
        0
    }
}

/// The DFlash drafter as a proposer: its per-layer context cache grows by the observed
/// positions; a draft runs the pending context rows and the block in one forward.
#[derive(Debug)]
pub struct DFlashProposer<'d> {
    drafter: &'d DFlashDrafter,
    caches: Vec<KvCache>,
    /// Aux rows observed but not yet in the context cache, `[n, K · hidden]`.
    pending: Option<Tensor<2>>,
    /// Positions observed so far.
    observed: usize,
}

impl<'d> DFlashProposer<'d> {
    /// A proposer with an empty context.
    pub fn new(drafter: &'d DFlashDrafter) -> Self {
        Self {
            drafter,
            caches: KvCache::for_specs(&drafter.cache_specs(), 0),
            pending: None,
            observed: 0,
        }
    }

    /// The drafter's context caches (for inspection and tests).
    pub fn caches(&self) -> &[KvCache] {
        &self.caches
    }
}

impl Proposer for DFlashProposer<'_> {
    fn aux_layers(&self) -> Vec<usize> {
        self.drafter.config.target_layer_ids.clone()
    }

    fn observe(&mut self, tokens: &[u32], aux: Option<Tensor<2>>) -> Result<()> {
        let aux = aux.ok_or_else(|| {
            RuntimeError::Input("the DFlash proposer needs the verifier's aux hidden states".into())
        })?;
        if aux.dims()[0] != tokens.len() {
            return Err(RuntimeError::Input(format!(
                "{} aux rows for {} tokens",
                aux.dims()[0],
                tokens.len()
            )));
        }
        self.pending = Some(match self.pending.take() {
            Some(p) => Tensor::cat(vec![p, aux], 0),
            None => aux,
        });
        self.observed += tokens.len();
        Ok(())
    }

    fn propose(&mut self, last: u32, pos: usize, n: usize) -> Result<Vec<u32>> {
        if pos != self.observed {
            return Err(RuntimeError::Input(format!(
                "draft at position {pos} but {} positions were observed",
                self.observed
            )));
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        let context = self
            .pending
            .take()
            .ok_or_else(|| RuntimeError::Input("nothing observed since the last draft".into()))?;
        let mut block = vec![self.drafter.config.mask_token_id; n + 1];
        block[0] = last;
        let out = self.drafter.forward(
            &DraftRequest {
                context,
                block: &block,
                capture_context: false,
            },
            &mut self.caches,
        )?;
        Ok(self.drafter.draft_tokens(out.hidden))
    }

    fn nbytes(&self) -> usize {
        self.caches.iter().map(KvCache::nbytes).sum()
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
    fn aux_layers(&self) -> Vec<usize> {
        Vec::new()
    }

    fn observe(&mut self, _tokens: &[u32], _aux: Option<Tensor<2>>) -> Result<()> {
        Ok(())
    }

    fn propose(&mut self, _last: u32, pos: usize, n: usize) -> Result<Vec<u32>> {
        let from = (pos + 1).min(self.sequence.len());
        let to = (pos + 1 + n).min(self.sequence.len());
        let mut out = self.sequence[from..to].to_vec();
        // Past the known continuation: pad with its last token (rejected unless right).
        out.resize(n, self.sequence.last().copied().unwrap_or(0));
        Ok(out)
    }
}
