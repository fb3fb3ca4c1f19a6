//! The verifier side of speculation: the target model and its caches, checking a block of
//! tokens in one forward and returning the hidden states the drafter conditions on.

use burn::tensor::Tensor;
use kakeya_models::{Gemma3Model, Logits};

use crate::error::{Result, RuntimeError};
use crate::generate::{Session, logits_row};
use crate::kv::KvCache;
use crate::sampler::argmax;

/// The target model of one sequence, with rollback-capable caches.
#[derive(Debug)]
pub struct Verifier<'m> {
    session: Session<'m>,
    aux_layers: Vec<usize>,
}

/// Concatenates per-layer hidden states `[T, hidden]` along features → `[T, K · hidden]`.
fn concat_aux(hidden: Vec<Tensor<2>>) -> Option<Tensor<2>> {
    (!hidden.is_empty()).then(|| Tensor::cat(hidden, 1))
}

impl<'m> Verifier<'m> {
    /// A verifier returning hidden states after `aux_layers`; sliding rings keep enough slack
    /// to roll back `block_size - 1` positions exactly.
    pub fn new(model: &'m Gemma3Model, aux_layers: Vec<usize>, block_size: usize) -> Self {
        Self {
            session: Session::new(model, block_size.max(1)),
            aux_layers,
        }
    }

    /// Positions in the caches.
    pub fn len(&self) -> usize {
        self.session.len()
    }

    /// True before the prompt.
    pub fn is_empty(&self) -> bool {
        self.session.is_empty()
    }

    /// The target model.
    pub fn model(&self) -> &'m Gemma3Model {
        self.session.model()
    }

    /// Bytes of K/V the verifier's caches hold.
    pub fn kv_bytes(&self) -> usize {
        self.session.kv_bytes()
    }

    /// The caches (for inspection and tests).
    pub fn caches(&self) -> &[KvCache] {
        self.session.caches()
    }

    /// Prefills the prompt in chunks; returns the last position's logits and the prompt's aux
    /// hidden states.
    ///
    /// # Shapes
    /// - returns logits `vocab`; aux `[P, K · hidden]` (`None` without aux layers)
    pub fn prefill(
        &mut self,
        prompt: &[u32],
        chunk: usize,
    ) -> Result<(Vec<f32>, Option<Tensor<2>>)> {
        if prompt.is_empty() {
            return Err(RuntimeError::Input("empty prompt: nothing to run".into()));
        }
        let ctx = self.model().config.max_position_embeddings;
        if self.len() + prompt.len() > ctx {
            return Err(RuntimeError::Input(format!(
                "prompt of {} tokens is longer than the model's context of {ctx}",
                prompt.len()
            )));
        }
        let parts: Vec<&[u32]> = prompt.chunks(chunk.max(1)).collect();
        let mut aux = Vec::new();
        let mut last = None;
        for (i, part) in parts.iter().enumerate() {
            let logits = if i + 1 == parts.len() {
                Logits::Last
            } else {
                Logits::None
            };
            let out = self.session.forward(part, logits, &self.aux_layers)?;
            aux.extend(concat_aux(out.hidden));
            last = out.logits;
        }
        let aux = (!aux.is_empty()).then(|| Tensor::cat(aux, 0));
        Ok((logits_row(last.expect("last chunk returns logits")), aux))
    }

    /// Runs a block `[last committed, drafts...]` at the next positions in one forward.
    /// Returns the greedy choice after each row and the rows' aux hidden states. The block's
    /// K/V stay in the caches until [`Self::rollback`].
    ///
    /// # Shapes
    /// - `block`: `B` ids → posterior `B` ids; aux `[B, K · hidden]`
    pub fn verify(&mut self, block: &[u32]) -> Result<(Vec<u32>, Option<Tensor<2>>)> {
        let out = self.session.forward(block, Logits::All, &self.aux_layers)?;
        let logits = logits_row(out.logits.expect("asked for logits"));
        let vocab = logits.len() / block.len();
        let posterior = logits
            .chunks_exact(vocab)
            .map(|row| argmax(row).unwrap_or(0) as u32)
            .collect();
        Ok((posterior, concat_aux(out.hidden)))
    }

    /// Forgets positions `>= len` (the rejected tail of a block), exactly.
    pub fn rollback(&mut self, len: usize) -> Result<()> {
        self.session.truncate(len)
    }
}
