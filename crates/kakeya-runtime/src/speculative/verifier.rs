//! The verifier side of speculation: the target model and the sequence's KV state, checking a
//! block of tokens in one forward and rolling back the rejected tail.

use kakeya_models::{Choice, GemmaModel, Logits};

use crate::error::{Result, RuntimeError};
use crate::kv::{CompactStore, KvBytes};
use crate::sampler::Sampler;
use crate::session::{KvSetup, Session, logits_row};
use crate::speculative::sampled::sampled_choices;
use crate::speculative::tree::DraftTree;

/// The target model of one sequence, with rollback-capable caches.
#[derive(Debug)]
pub struct Verifier<'m> {
    session: Session<'m>,
}

impl<'m> Verifier<'m> {
    /// A verifier checking blocks of up to `block_size` tokens: every cache keeps at least
    /// `block_size` positions of exact rollback, and the policy must allow the block.
    pub fn new(model: &'m GemmaModel, setup: KvSetup<'m>, block_size: usize) -> Result<Self> {
        setup
            .policy
            .check(model.config.max_position_embeddings, block_size)?;
        let setup = KvSetup {
            slack: setup.slack.max(block_size.max(1)),
            ..setup
        };
        Ok(Self {
            session: Session::with_kv(model, setup)?,
        })
    }

    /// A verifier over `session` as it stands (a prefix-cache fork): the session must come
    /// from this constructor's setup — the same model, KV setup and block size — so that its
    /// caches already keep the rollback a block needs.
    pub fn from_session(session: Session<'m>) -> Self {
        Self { session }
    }

    /// The session, taken back (a finished sequence's, for the prefix cache).
    pub fn into_session(self) -> Session<'m> {
        self.session
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
    pub fn model(&self) -> &'m GemmaModel {
        self.session.model()
    }

    /// Bytes of K/V held, by part.
    pub fn kv_bytes(&self) -> KvBytes {
        self.session.kv_bytes()
    }

    /// The session (inspection and tests).
    pub fn session(&self) -> &Session<'m> {
        &self.session
    }

    /// The session, for plain steps between blocks (a server batching this sequence's decode
    /// steps with others'); positions it adds are committed like a block's.
    pub fn session_mut(&mut self) -> &mut Session<'m> {
        &mut self.session
    }

    /// The compact store, brought up to date with every committed position.
    pub fn store_mut(&mut self) -> Result<Option<&mut CompactStore>> {
        self.session.store_mut()
    }

    /// Prefills the prompt in chunks; returns the last position's logits.
    pub fn prefill(&mut self, prompt: &[u32], chunk: usize) -> Result<Vec<f32>> {
        self.session.run(prompt, chunk)
    }

    /// Runs a block `[last committed, drafts...]` at the next positions in one forward and
    /// returns the greedy choice after each row. The block's K/V stay in the caches until
    /// [`Self::rollback`].
    ///
    /// # Shapes
    /// - `block`: `B` ids → choices `B` ids
    pub fn verify(&mut self, block: &[u32]) -> Result<Vec<u32>> {
        if block.is_empty() {
            return Err(RuntimeError::Input("empty block".into()));
        }
        let out = self
            .session
            .forward(block, Logits::All, Some(Choice::Greedy), &[])?;
        Ok(out.chosen.expect("asked for the greedy choices"))
    }

    /// Runs a block like [`Self::verify`] and returns the token `sampler` draws after each
    /// row (row `i` predicts the position after it, with that position's uniform): drawn on
    /// a GPU by the forward ([`Choice::Draw`]), else from the rows copied to the host
    /// ([`sampled_choices`]). Greedy: [`Self::verify`].
    ///
    /// # Shapes
    /// - `block`: `B` ids → choices `B` ids
    pub fn verify_sampled(&mut self, block: &[u32], sampler: &Sampler) -> Result<Vec<u32>> {
        let Some(draw) = sampler.draw() else {
            return self.verify(block);
        };
        if block.is_empty() {
            return Err(RuntimeError::Input("empty block".into()));
        }
        // The block's first row sits at the session's next position and predicts the one after.
        let first = self.session.len() + 1;
        let out = self
            .session
            .forward(block, Logits::All, Some(Choice::Draw(draw)), &[])?;
        if let Some(ids) = out.chosen {
            return Ok(ids);
        }
        let rows = logits_row(out.logits.expect("asked for logits"));
        let vocab = self.model().config.vocab_size;
        Ok(sampled_choices(&rows, vocab, first, sampler))
    }

    /// Runs `tree` (its root the last committed token) at the next positions in one forward
    /// and returns the token `sampler` picks after each node: node `i` predicts the position
    /// after its own (the next position plus its depth), with that position's uniform — so
    /// nodes at one depth share it, as every path is one plain decoding. The tree stays in
    /// the caches until [`Self::keep_path`]. On the CPU.
    ///
    /// # Shapes
    /// - `tree`: `T` nodes → choices `T` ids
    pub fn verify_tree(&mut self, tree: &DraftTree, sampler: &Sampler) -> Result<Vec<u32>> {
        let rows = tree.rows()?;
        let tokens: Vec<u32> = tree.nodes().iter().map(|n| n.token).collect();
        if sampler.draw().is_none() {
            let out =
                self.session
                    .forward_tree(&tokens, &rows, Logits::All, Some(Choice::Greedy))?;
            return Ok(out.chosen.expect("asked for the greedy choices"));
        }
        let first = self.session.len() + 1;
        let out = self
            .session
            .forward_tree(&tokens, &rows, Logits::All, None)?;
        let logits = logits_row(out.logits.expect("asked for logits"));
        let vocab = self.model().config.vocab_size;
        Ok(logits
            .chunks_exact(vocab)
            .zip(rows.depths())
            .map(|(row, depth)| sampler.pick(row, first + depth))
            .collect())
    }

    /// Keeps the nodes `path` (from the root) of the tree [`Self::verify_tree`] ran, drops
    /// the rest, and commits them.
    pub fn keep_path(&mut self, path: &[usize]) -> Result<()> {
        self.session.keep_path(path)
    }

    /// Keeps positions `< len` (the accepted part of a block), exactly, and commits them.
    pub fn rollback(&mut self, len: usize) -> Result<()> {
        self.session.truncate(len)
    }
}
