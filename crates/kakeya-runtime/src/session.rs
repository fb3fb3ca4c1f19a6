//! One sequence on the verifier: its KV state under a policy, the compact store, and the
//! commit horizon.
//!
//! Positions in the caches are committed unless a [`Session::truncate`] removes them before the
//! next forward. Committed positions get their compact-store rows (the drafter's context K/V,
//! projected from the verifier's hidden states at the drafter's target layers) — in one batch
//! when the store is next read, or at once in the restored modes — so the store only ever
//! holds committed positions: what the proposer drafts from and what restoration rebuilds
//! from.

use burn::tensor::Tensor;
use kakeya_models::{
    Choice, DFlashDrafter, DraftContext, ForwardOutput, ForwardRequest, GemmaModel, KvLayers,
    Logits, TreeRows,
};

use crate::error::{Result, RuntimeError};
use crate::kv::{CompactStore, KvBytes, KvPolicy, Restorer, SequenceKv};
use crate::sampler::{Sampler, Sampling, Scores};

mod batch;
mod store_feed;
mod tree_block;

use store_feed::StoreFeed;

use tree_block::{Recording, TreeBlock};

/// Copies one row of logits `[1, vocab]` to the host.
pub fn logits_row(logits: Tensor<2>) -> Vec<f32> {
    logits
        .into_data()
        .try_into_vec::<f32>()
        .expect("logits are f32")
}

/// What one session of [`Session::run_batch`] asks of its chunk.
#[derive(Debug, Clone, Copy)]
pub enum Want<'s> {
    /// Run the chunk; give what the sampler picks the token after it from.
    Next(&'s Sampler),
    /// Verify the block (its newest token, then drafts): give the sampler's choice after
    /// every row — the greedy one, or a draw with the uniform of the position the row
    /// predicts (speculative sampling's rule, as [`crate::Verifier::verify_sampled`]).
    Block(&'s Sampler),
}

/// What [`Session::run_batch`] gives one session.
#[derive(Debug, Clone)]
pub enum Verified {
    /// The sampler's choice after every row of its block ([`Want::Block`]).
    Block(Vec<u32>),
    /// What its sampler picks the token after its chunk from ([`Want::Next`]).
    Scores(Scores),
}

impl Verified {
    /// The scores of a session that ran its next chunk ([`Want::Next`]); `None` for a block.
    pub fn into_scores(self) -> Option<Scores> {
        match self {
            Verified::Scores(s) => Some(s),
            Verified::Block(_) => None,
        }
    }
}

/// The [`Scores`] of a forward that asked for what `sampler` wants: the choice made on the
/// device (the greedy one, or a draw on a GPU), else the last row's logits on the host.
fn scores(out: ForwardOutput, sampler: &Sampler) -> Scores {
    match out.chosen {
        Some(ids) => {
            let id = *ids.last().expect("one choice per wanted row");
            match sampler.mode() {
                Sampling::Greedy => Scores::Greedy(id),
                Sampling::Sample { .. } => Scores::Drawn(id),
            }
        }
        None => Scores::Logits(logits_row(out.logits.expect("asked for logits"))),
    }
}

/// How a session keeps its K/V.
#[derive(Debug, Clone, Copy)]
pub struct KvSetup<'m> {
    /// The policy.
    pub policy: KvPolicy,
    /// Positions every cache can roll back exactly (speculation: `block − 1` or more).
    pub slack: usize,
    /// The drafter whose context the compact store holds (speculative decoding, or the
    /// restorer's input).
    pub drafter: Option<&'m DFlashDrafter>,
    /// The restorer of the restored modes.
    pub restorer: Option<&'m dyn Restorer>,
}

impl<'m> KvSetup<'m> {
    /// `policy`, no extra rollback slack, no drafter, no restorer.
    pub fn new(policy: KvPolicy) -> Self {
        Self {
            policy,
            slack: 0,
            drafter: None,
            restorer: None,
        }
    }

    /// Native caches, no store.
    pub fn full(slack: usize) -> Self {
        Self {
            slack,
            ..Self::new(KvPolicy::default())
        }
    }

    /// With the compact store of `drafter`.
    pub fn drafter(self, drafter: &'m DFlashDrafter) -> Self {
        Self {
            drafter: Some(drafter),
            ..self
        }
    }

    /// With a restorer (used by the restored modes).
    pub fn restorer(self, restorer: &'m dyn Restorer) -> Self {
        Self {
            restorer: Some(restorer),
            ..self
        }
    }
}

/// A model plus the KV state of one sequence. A clone shares the K/V buffers until either
/// side writes them (copy on write): the prefix cache forks sessions this way.
#[derive(Debug, Clone)]
pub struct Session<'m> {
    model: &'m GemmaModel,
    policy: KvPolicy,
    kv: SequenceKv<'m>,
    drafter: Option<&'m DFlashDrafter>,
    /// The hidden states waiting for their compact-store rows.
    feed: StoreFeed,
    /// A tree verified by the last forward, until its path is kept.
    tree_block: Option<TreeBlock>,
    len: usize,
}

impl<'m> Session<'m> {
    /// An empty sequence with the model's native caches; rings keep `slack` positions of
    /// exact rollback.
    pub fn new(model: &'m GemmaModel, slack: usize) -> Self {
        Self::with_kv(model, KvSetup::full(slack)).expect("native caches need nothing")
    }

    /// An empty sequence under `setup`; refuses a policy that does not fit the model or lacks
    /// what it needs (a restorer, a drafter for the store).
    pub fn with_kv(model: &'m GemmaModel, setup: KvSetup<'m>) -> Result<Self> {
        let c = &model.config;
        setup.policy.check(c.max_position_embeddings, 1)?;
        let mode = setup.policy.mode;
        if mode.restores() {
            let r = setup.restorer.ok_or_else(|| {
                RuntimeError::Input(format!(
                    "KV mode {mode} rebuilds evicted K/V: it needs an f_θ (--f-theta)"
                ))
            })?;
            if r.reads_store() && setup.drafter.is_none() {
                return Err(RuntimeError::Input(format!(
                    "KV mode {mode}: f_θ reads the drafter's compact store: it needs the drafter (--drafter)"
                )));
            }
        }
        let store = setup.drafter.map(|d| {
            CompactStore::with_reach(
                d.context_width(),
                setup.policy.store_format(),
                setup.policy.draft_reach(),
                model.device(),
            )
        });
        Ok(Self {
            model,
            policy: setup.policy,
            kv: SequenceKv::new(
                &model.cache_specs(),
                (
                    &(0..c.num_hidden_layers)
                        .map(|i| c.kv_width_of(i))
                        .collect::<Vec<_>>(),
                    &(0..c.num_hidden_layers)
                        .map(|i| c.head_dim_of(i))
                        .collect::<Vec<_>>(),
                ),
                &setup.policy,
                setup.slack,
                store,
                setup.restorer.filter(|_| mode.restores()),
            ),
            drafter: setup.drafter,
            feed: StoreFeed::default(),
            tree_block: None,
            len: 0,
        })
    }

    /// Positions processed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before any token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The model.
    pub fn model(&self) -> &'m GemmaModel {
        self.model
    }

    /// The KV policy.
    pub fn policy(&self) -> &KvPolicy {
        &self.policy
    }

    /// Bytes of K/V held, by part (hidden states waiting for their store rows count as store).
    pub fn kv_bytes(&self) -> KvBytes {
        let mut b = self.kv.bytes();
        let waiting = self.feed.waiting_bytes();
        b.store += waiting;
        b.total += waiting;
        b.ratio_to_full_f16 = b.full_f16 as f64 / b.total.max(1) as f64;
        b
    }

    /// The KV state (inspection and tests).
    pub fn kv(&self) -> &SequenceKv<'m> {
        &self.kv
    }

    /// The compact store, brought up to date with every position in the caches (which this
    /// commits; a later [`Self::truncate`] takes back the store rows it removes), when there
    /// is one.
    pub fn store_mut(&mut self) -> Result<Option<&mut CompactStore>> {
        self.commit()?;
        self.flush_backlog()?;
        Ok(self.kv.store_mut())
    }

    /// Stops keeping the drafter's compact store: frees it, with the hidden states waiting for
    /// their rows, and later forwards take no hidden states at the drafter's target layers for
    /// this sequence. For a sequence that will not draft with the drafter — a server's
    /// sequence decoding in a batch, whose drafts come from lookups — that work is waste.
    /// Returns whether a store was released: false when there is none, or when the KV mode's
    /// restoration reads it (kept).
    pub fn release_store(&mut self) -> bool {
        if self.policy.mode.restores() || self.kv.store().is_none() {
            return false;
        }
        self.kv.drop_store();
        self.feed.clear();
        true
    }

    /// Whether the session keeps the drafter's compact store (it had a drafter, and
    /// [`Self::release_store`] did not release it).
    pub fn keeps_store(&self) -> bool {
        self.kv.store().is_some()
    }

    /// Commits every position in the caches: their hidden states join the backlog of store
    /// rows (computed at once in the restored modes, whose forwards read the store).
    pub fn commit(&mut self) -> Result<()> {
        if self.feed.commit(self.len, self.policy.mode.restores()) {
            self.flush_backlog()?;
        }
        Ok(())
    }

    /// Computes the store rows of the committed positions waiting for them, in one batch.
    fn flush_backlog(&mut self) -> Result<()> {
        let (Some(d), Some(store)) = (self.drafter, self.kv.store_mut()) else {
            return Ok(());
        };
        self.feed.flush(d, store)
    }

    /// Runs `tokens` at the next positions — a prompt, or one decode step — in forwards of at
    /// most `chunk` tokens, and commits them; returns the last position's logits.
    pub fn run(&mut self, tokens: &[u32], chunk: usize) -> Result<Vec<f32>> {
        let out = self.run_out(tokens, chunk, None)?;
        Ok(logits_row(out.logits.expect("last chunk returns logits")))
    }

    /// Runs `tokens` like [`Self::run`]; returns what `sampler` picks the next token from.
    pub fn run_for(&mut self, tokens: &[u32], chunk: usize, sampler: &Sampler) -> Result<Scores> {
        let out = self.run_out(tokens, chunk, Some(sampler.choice()))?;
        Ok(scores(out, sampler))
    }

    /// Runs `tokens` in chunks of at most `chunk`; the last chunk returns the last position's
    /// logits, or the token `choice` chooses after it.
    fn run_out(
        &mut self,
        tokens: &[u32],
        chunk: usize,
        choice: Option<Choice>,
    ) -> Result<ForwardOutput> {
        if tokens.is_empty() {
            return Err(RuntimeError::Input("empty prompt: nothing to run".into()));
        }
        let ctx = self.model.config.max_position_embeddings;
        if self.len + tokens.len() > ctx {
            return Err(RuntimeError::Input(format!(
                "prompt of {} tokens (plus {} already in context) is longer than the model's context of {ctx}",
                tokens.len(),
                self.len
            )));
        }
        let mut out = None;
        let n = tokens.chunks(chunk.max(1)).count();
        for (i, part) in tokens.chunks(chunk.max(1)).enumerate() {
            let logits = if i + 1 == n {
                Logits::Last
            } else {
                Logits::None
            };
            out = Some(self.forward(part, logits, choice, &[])?);
        }
        self.commit()?;
        Ok(out.expect("at least one chunk"))
    }

    /// Runs `tokens` at the next positions in one forward (committing what the caches held
    /// before), returning what `logits`, `choice` ([`kakeya_models::ForwardRequest::choice`])
    /// and `hidden_after` ask for.
    ///
    /// # Shapes
    /// - returns logits `[1 or T, vocab]`, hidden states `[T, hidden]` per requested layer
    pub fn forward(
        &mut self,
        tokens: &[u32],
        logits: Logits,
        choice: Option<Choice>,
        hidden_after: &[usize],
    ) -> Result<ForwardOutput> {
        let heads = [(logits, choice)];
        let mut out = Self::forward_many(&mut [self], &[tokens], &heads, hidden_after, &[])?;
        Ok(out.pop().expect("one output per session"))
    }

    /// Runs `chunks[i]` at session `i`'s next positions, all in one forward (committing what
    /// each session's caches held before); each output holds what `heads` and `hidden_after`
    /// ask for (`heads[i]`, its rows and choice, for session `i`), the drafter's target layers going to the
    /// session's pending rows. `trees[i]`, when given, runs chunk `i` as a tree whose K/V the
    /// session keeps for [`Self::keep_path`] (no `trees`: every chunk causal). The sessions
    /// must share one model and one drafter (or none).
    ///
    /// # Shapes
    /// - per session: logits `[1 or T, vocab]`, hidden states `[T, hidden]` per requested layer
    fn forward_many(
        sessions: &mut [&mut Session<'m>],
        chunks: &[&[u32]],
        heads: &[(Logits, Option<Choice>)],
        hidden_after: &[usize],
        trees: &[Option<&TreeRows>],
    ) -> Result<Vec<ForwardOutput>> {
        let Some(first) = sessions.first() else {
            return Ok(Vec::new());
        };
        if sessions.iter().any(|s| s.tree_block.is_some()) {
            return Err(RuntimeError::Input(
                "a verified tree's path must be kept before the next forward".into(),
            ));
        }
        let tree_of = |i: usize| trees.get(i).copied().flatten();
        let (model, drafter) = (first.model, first.drafter);
        if sessions.iter().any(|s| {
            !std::ptr::eq(s.model, model)
                || s.drafter.map(std::ptr::from_ref) != drafter.map(std::ptr::from_ref)
        }) {
            return Err(RuntimeError::Input(
                "batched sessions must share one model and one drafter".into(),
            ));
        }
        for s in sessions.iter_mut() {
            s.commit()?;
        }
        // The drafter's target layers, when a session keeps its store (a batch asks every
        // request for the same layers; the sessions without a store drop theirs).
        let targets: &[usize] = match drafter {
            Some(d) if sessions.iter().any(|s| s.keeps_store()) => &d.config.target_layer_ids,
            _ => &[],
        };
        let layers: Vec<usize> = hidden_after.iter().chain(targets).copied().collect();
        let reqs: Vec<ForwardRequest<'_>> = sessions
            .iter()
            .zip(chunks)
            .zip(heads)
            .enumerate()
            .map(|(i, ((s, tokens), &(logits, choice)))| {
                let mut req = ForwardRequest::new(tokens, s.len, logits);
                req.choice = choice;
                req.hidden_after = &layers;
                req.tree = tree_of(i);
                req
            })
            .collect();
        let mut recordings: Vec<Recording<'_>> = sessions
            .iter_mut()
            .enumerate()
            .map(|(i, s)| Recording::new(&mut s.kv, tree_of(i).is_some()))
            .collect();
        let mut kvs: Vec<&mut dyn KvLayers> = recordings
            .iter_mut()
            .map(|r| r as &mut dyn KvLayers)
            .collect();
        let mut outs = model.forward_batch(&reqs, &mut kvs)?;
        drop(kvs);
        let kept: Vec<_> = recordings.into_iter().map(Recording::into_kept).collect();
        for (i, (((s, out), tokens), kv)) in sessions
            .iter_mut()
            .zip(&mut outs)
            .zip(chunks)
            .zip(kept)
            .enumerate()
        {
            if let (Some(tree), Some(kv)) = (tree_of(i), kv) {
                s.tree_block = Some(TreeBlock {
                    start: s.len,
                    tree: tree.clone(),
                    kv,
                });
            }
            if !targets.is_empty() {
                let aux = out.hidden.split_off(hidden_after.len());
                if s.keeps_store() {
                    s.feed.hold(s.len, Tensor::cat(aux, 1));
                }
            }
            s.len += tokens.len();
        }
        Ok(outs)
    }

    /// Whether a [`Self::truncate`] to `len` would succeed with every cache native (a
    /// prefix-cache fork).
    pub fn natively_reaches(&self, len: usize) -> bool {
        len <= self.len && self.kv.natively_reaches(len)
    }

    /// Forgets positions `>= len` (exactly, or an error when a cache already demoted a
    /// position it would need) and commits the rest.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if let Some(block) = &self.tree_block {
            if len > block.start {
                return Err(RuntimeError::Input(format!(
                    "truncating to {len} inside a verified tree: keep a path of it (keep_path)"
                )));
            }
            self.tree_block = None;
        }
        self.kv.truncate(len)?;
        if let Some(store) = self.kv.store_mut()
            && store.len() > len
        {
            store.truncate(len);
        }
        // Waiting rows past `len` go too.
        self.feed.truncate(len);
        self.len = len;
        self.commit()
    }
}
