//! The speculative decoding loop: draft a block, verify it in one forward, accept greedily,
//! commit, roll back the rejected tail, tell the proposer what was committed.

use std::time::Instant;

use serde::Serialize;

use super::accepted_count;
use super::adaptive::{BlockSchedule, DraftSource, Schedule, ScheduleStats};
use super::proposer::Proposer;
use super::tree::DraftTree;
use super::tree_drafts::TreeDrafts;
use super::verifier::Verifier;
use crate::error::{Result, RuntimeError};
use crate::generate::{Generation, GenerationConfig, GenerationStats, StopReason, TokenSink, rate};
use crate::sampler::{Sampler, Sampling};

/// Speculation settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    /// Tokens per verified block (the longest, when adaptive): the last committed token plus
    /// `block_size - 1` drafts.
    pub block_size: usize,
    /// Fixed blocks, or lengths adapted to what speculation earns.
    pub schedule: Schedule,
    /// What the adaptive schedule is told a block cost: the measured seconds, or a model of
    /// them (for tests and simulations, which must not depend on the machine's load).
    pub costs: Costs,
}

/// Block costs as the adaptive schedule sees them (and its [`ScheduleStats`] report);
/// [`SpecStats::draft_secs`] and [`SpecStats::verify_secs`] are always measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Costs {
    /// Wall-clock seconds of each draft and each verify forward.
    #[default]
    Measured,
    /// A verify forward of `b` rows costs `step_us + row_us · (b − 1)` µs, a draft of `n`
    /// tokens `draft_us · n` µs.
    Linear {
        /// One row's verify forward (a plain decode step), µs.
        step_us: u32,
        /// Each further verified row, µs.
        row_us: u32,
        /// Each drafted token, µs.
        draft_us: u32,
    },
}

impl Costs {
    /// `(draft, verify)` seconds the schedule is told for a block of `drafts + 1` rows that
    /// measured `measured`.
    fn seen(self, drafts: usize, measured: (f64, f64)) -> (f64, f64) {
        match self {
            Costs::Measured => measured,
            Costs::Linear {
                step_us,
                row_us,
                draft_us,
            } => {
                let us = |x: f64| x * 1e-6;
                (
                    us(f64::from(draft_us) * drafts as f64),
                    us(f64::from(step_us) + f64::from(row_us) * drafts as f64),
                )
            }
        }
    }
}

impl SpecConfig {
    /// Every block `block_size` long.
    pub fn fixed(block_size: usize) -> Self {
        Self {
            block_size,
            schedule: Schedule::Fixed,
            costs: Costs::Measured,
        }
    }

    /// Blocks of up to `block_size`, down to plain decoding when speculation loses.
    pub fn adaptive(block_size: usize) -> Self {
        Self {
            block_size,
            schedule: Schedule::Adaptive,
            costs: Costs::Measured,
        }
    }

    /// The same settings with the schedule told `costs` instead of measured seconds.
    pub fn with_costs(self, costs: Costs) -> Self {
        Self { costs, ..self }
    }
}

/// Figures of one speculative generation.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SpecStats {
    /// Block size used (the longest, when adaptive).
    pub block_size: usize,
    /// How block lengths were chosen.
    pub schedule: Option<Schedule>,
    /// What the schedule did: blocks by length, probes, measured costs.
    pub schedule_stats: ScheduleStats,
    /// Verifier forwards over a block (plain steps of an adaptive schedule included).
    pub blocks: usize,
    /// Draft tokens proposed.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Mean tokens committed per block (accepted drafts + the verifier's own token).
    pub mean_acceptance_length: f64,
    /// For draft slot `k` (1-based, index `k - 1`): the fraction of blocks that drafted slot
    /// `k` and accepted it.
    pub per_position_acceptance: Vec<f64>,
    /// Blocks that drafted slot `k` (index `k - 1`).
    pub per_position_drafted: Vec<usize>,
    /// Blocks that accepted slot `k` (index `k - 1`).
    pub per_position_accepted: Vec<usize>,
    /// Seconds spent in the proposer.
    pub draft_secs: f64,
    /// Seconds spent in verifier forwards.
    pub verify_secs: f64,
}

/// The speculative loop one block at a time, for callers that interleave sequences (a
/// server) — [`speculative_generate`] is this in a loop. The sequence's state is the verifier
/// (its caches), the committed tokens (prompt included; the newest is not yet in the caches)
/// and the [`TokenSink`]; between blocks the caller may also advance the sequence by plain
/// steps of the same verifier, with the same sampler, and the output stays that of plain
/// decoding.
#[derive(Debug)]
pub struct SpecDecoder {
    schedule: BlockSchedule,
    costs: Costs,
    stats: SpecStats,
    slot_tried: Vec<usize>,
    slot_hit: Vec<usize>,
    sampler: Sampler,
    committed: usize,
}

impl SpecDecoder {
    /// A decoder of blocks under `spec`, choosing tokens by `sampling`; refuses a block size
    /// outside `1..=context`.
    pub fn new(spec: SpecConfig, sampling: &Sampling, context: usize) -> Result<Self> {
        if spec.block_size == 0 || spec.block_size > context {
            return Err(RuntimeError::Input(format!(
                "block size {} must be between 1 and the context length {context}",
                spec.block_size
            )));
        }
        let slots = spec.block_size.saturating_sub(1);
        Ok(Self {
            schedule: BlockSchedule::new(spec.schedule, spec.block_size),
            costs: spec.costs,
            stats: SpecStats {
                block_size: spec.block_size,
                schedule: Some(spec.schedule),
                ..SpecStats::default()
            },
            slot_tried: vec![0; slots],
            slot_hit: vec![0; slots],
            sampler: Sampler::new(sampling.clone()),
            committed: 0,
        })
    }

    /// The sampler (the same position-keyed draws as plain decoding).
    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// Tokens committed by blocks so far.
    pub fn committed(&self) -> usize {
        self.committed
    }

    /// Drafts, verifies and commits one block after `tokens` (the committed sequence; its
    /// last token is not yet in `verifier`'s caches), appending the committed tokens to
    /// `tokens` and offering them to `sink`; `Some(reason)` when generation stops.
    pub fn block(
        &mut self,
        verifier: &mut Verifier<'_>,
        proposer: &mut dyn Proposer,
        tokens: &mut Vec<u32>,
        sink: &mut TokenSink<'_>,
    ) -> Result<Option<StopReason>> {
        let Some((pos, last, room)) = Self::next_position(verifier, tokens)? else {
            return Ok(Some(StopReason::ContextFull));
        };
        let source = proposer.source(tokens);
        let b = self.block_len(source, room, sink);
        let td = Instant::now();
        let mut drafts = if b > 1 {
            proposer.propose(tokens, b - 1, verifier.store_mut()?)?
        } else {
            Vec::new()
        };
        drafts.truncate(b - 1);
        let draft_secs = td.elapsed().as_secs_f64();
        let mut block = Vec::with_capacity(b);
        block.push(last);
        block.extend(&drafts);
        let tv = Instant::now();
        let choices = verifier.verify_sampled(&block, &self.sampler)?;
        let a = accepted_count(&drafts, &choices);
        verifier.rollback(pos + a + 1)?;
        let verify_secs = tv.elapsed().as_secs_f64();
        let rows = drafts.len() + 1;
        self.account(rows, (drafts.len(), a), (draft_secs, verify_secs));
        Ok(self.commit(&drafts, &choices, a, tokens, sink))
    }

    /// The length of the next block drafted by `source`: the schedule's, within the `room`
    /// left in the context and what `sink` still takes.
    fn block_len(&mut self, source: DraftSource, room: usize, sink: &TokenSink<'_>) -> usize {
        self.schedule
            .next_len(source)
            .min(room)
            .min(sink.remaining())
            .max(1)
    }

    /// Tells the schedule what a verified block of `rows` rows cost (its drafts `drafted`
    /// deep, `a` accepted) and adds its measured seconds to the stats.
    fn account(&mut self, rows: usize, (drafted, a): (usize, usize), secs: (f64, f64)) {
        let (seen_draft, seen_verify) = self.costs.seen(rows - 1, secs);
        self.schedule
            .record_rows(rows, (drafted, a), seen_draft, seen_verify);
        self.stats.draft_secs += secs.0;
        self.stats.verify_secs += secs.1;
    }

    /// The next position, the newest committed token (not yet in `verifier`'s caches) and
    /// the positions left in the context; `None` when the context is full.
    fn next_position(
        verifier: &Verifier<'_>,
        tokens: &[u32],
    ) -> Result<Option<(usize, u32, usize)>> {
        let ctx = verifier.model().config.max_position_embeddings;
        let pos = verifier.len();
        let Some(&last) = tokens.last() else {
            return Err(RuntimeError::Input("nothing to continue: no tokens".into()));
        };
        if tokens.len() != pos + 1 {
            return Err(RuntimeError::Input(format!(
                "{} committed tokens for {pos} cached positions: the newest token alone must be outside the caches",
                tokens.len()
            )));
        }
        Ok((pos < ctx).then_some((pos, last, ctx - pos)))
    }

    /// Drafts a tree of as many rows as the schedule gives a block after `tokens` (from
    /// `drafts`' sources; the drafter runs where the chain would run it), verifies it in one
    /// forward, keeps the accepted path and commits it (see [`Self::block`]). On the CPU.
    pub fn tree_block(
        &mut self,
        verifier: &mut Verifier<'_>,
        drafts: &mut TreeDrafts<'_>,
        tokens: &mut Vec<u32>,
        sink: &mut TokenSink<'_>,
    ) -> Result<Option<StopReason>> {
        let Some((_, last, room)) = Self::next_position(verifier, tokens)? else {
            return Ok(Some(StopReason::ContextFull));
        };
        let source = drafts.source(tokens);
        let b = self.block_len(source, room, sink);
        let td = Instant::now();
        let tree = if b > 1 {
            let store = match source {
                DraftSource::Model => verifier.store_mut()?,
                _ => None,
            };
            let evidence = drafts.evidence(tokens, b - 1, store)?;
            drafts.tree(&evidence, tokens, b)
        } else {
            DraftTree::new(last)
        };
        let draft_secs = td.elapsed().as_secs_f64();
        let tv = Instant::now();
        let choices = verifier.verify_tree(&tree, &self.sampler)?;
        let path = tree.accepted_path(&choices);
        verifier.keep_path(&path)?;
        let verify_secs = tv.elapsed().as_secs_f64();
        let a = path.len() - 1;
        let committed: Vec<u32> = path[1..]
            .iter()
            .map(|&i| tree.nodes()[i].token)
            .chain([choices[path[a]]])
            .collect();
        drafts.observe(&tree, &committed);
        let drafted = tree.len() - 1;
        let deepest = tree.nodes().iter().map(|n| n.depth).max().unwrap_or(0);
        self.account(tree.len(), (deepest, a), (draft_secs, verify_secs));
        self.tally(drafted, deepest, a);
        Ok(self.emit(&committed, tokens, sink))
    }

    /// Drafts for a block whose rows are verified beside other sequences' in one stacked
    /// forward (a server's batch), after `tokens` (its newest not yet in the caches), at most
    /// `room − 1` of them: as many as the schedule expects each to be committed with chance
    /// at least `threshold` ([`BlockSchedule::next_len_in_batch`]). None where the drafts
    /// would need a forward of their own (a model drafter). Verify `[newest, drafts...]` with
    /// the batch (`Want::Block` with this decoder's sampler), then call
    /// [`Self::commit_in_batch`].
    pub fn drafts_in_batch(
        &mut self,
        proposer: &mut dyn Proposer,
        tokens: &[u32],
        room: usize,
        threshold: f64,
    ) -> Result<Vec<u32>> {
        let source = proposer.source(tokens);
        let b = self
            .schedule
            .next_len_in_batch(source, threshold)
            .min(room)
            .max(1);
        if b == 1 {
            return Ok(Vec::new());
        }
        // A lookup's or the table's drafts (the schedule gave a model drafter no slot): no
        // forward, so no compact store.
        let mut drafts = proposer.propose(tokens, b - 1, None)?;
        drafts.truncate(b - 1);
        Ok(drafts)
    }

    /// Exactly `k` drafts (at most the schedule's longest block less one) for a block verified
    /// beside other sequences in a forward whose
    /// shape the batch fixes (on a GPU, so that one recording replays every step): the
    /// proposer's lookups (at most `k`; none where it would need the drafter's forward), then
    /// the last of them — or `tokens`' newest — repeated. The filler rows cost the recorded
    /// forward nothing more and are committed only where right. Returns the drafts and how
    /// many the proposer made (what [`Self::commit_in_batch`] credits the schedule with).
    pub fn padded_drafts_in_batch(
        &mut self,
        proposer: &mut dyn Proposer,
        tokens: &[u32],
        k: usize,
    ) -> Result<(Vec<u32>, usize)> {
        let source = proposer.source(tokens);
        self.schedule.fixed_in_batch(source);
        // No longer than the schedule's blocks: the verifier rolls back at most that far.
        let k = k.min(self.schedule.max() - 1);
        if k == 0 {
            return Ok((Vec::new(), 0));
        }
        let mut drafts = match source {
            DraftSource::Model | DraftSource::Nothing => Vec::new(),
            _ => proposer.propose(tokens, k, None)?,
        };
        drafts.truncate(k);
        let proposed = drafts.len();
        let fill = *drafts
            .last()
            .or(tokens.last())
            .ok_or_else(|| RuntimeError::Input("nothing to draft from".into()))?;
        drafts.resize(k, fill);
        Ok((drafts, proposed))
    }

    /// Commits a block from [`Self::drafts_in_batch`] (`proposed` = its drafts) or
    /// [`Self::padded_drafts_in_batch`] that the batch verified: `choices` holds the sampler's
    /// choice after each of its rows (greedy, or drawn). Rolls the verifier back past the
    /// rejected drafts and appends the committed tokens to `tokens`, offering them to `sink`;
    /// `Some(reason)` when generation stops. The schedule's evidence counts the `proposed`
    /// drafts alone, not the filler after them.
    pub fn commit_in_batch(
        &mut self,
        verifier: &mut Verifier<'_>,
        (drafts, proposed): (&[u32], usize),
        choices: &[u32],
        tokens: &mut Vec<u32>,
        sink: &mut TokenSink<'_>,
    ) -> Result<Option<StopReason>> {
        if choices.len() != drafts.len() + 1 || proposed > drafts.len() {
            return Err(RuntimeError::Input(format!(
                "{} choices for a block of {} drafts ({proposed} proposed)",
                choices.len(),
                drafts.len()
            )));
        }
        let a = accepted_count(drafts, choices);
        verifier.rollback(verifier.len() - drafts.len() + a)?;
        self.schedule.record_in_batch(proposed, a.min(proposed));
        Ok(self.commit(drafts, choices, a, tokens, sink))
    }

    /// The stats of a verified chain block whose first `a` drafts were accepted, and its
    /// tokens: those drafts and the verifier's choice after them.
    fn commit(
        &mut self,
        drafts: &[u32],
        choices: &[u32],
        a: usize,
        tokens: &mut Vec<u32>,
        sink: &mut TokenSink<'_>,
    ) -> Option<StopReason> {
        self.tally(drafts.len(), drafts.len(), a);
        let committed: Vec<u32> = drafts[..a].iter().chain([&choices[a]]).copied().collect();
        self.emit(&committed, tokens, sink)
    }

    /// Counts a verified block of `drafted` drafts reaching `slots` deep (a chain's drafts
    /// are its slots; a tree's, its depth) of which `a` were accepted.
    fn tally(&mut self, drafted: usize, slots: usize, a: usize) {
        let st = &mut self.stats;
        st.blocks += 1;
        st.drafted += drafted;
        st.accepted += a;
        for k in 0..slots.min(self.slot_tried.len()) {
            self.slot_tried[k] += 1;
            self.slot_hit[k] += usize::from(k < a);
        }
    }

    /// Appends a block's committed tokens to `tokens`, offering them to `sink`, until it
    /// stops generation.
    fn emit(
        &mut self,
        committed: &[u32],
        tokens: &mut Vec<u32>,
        sink: &mut TokenSink<'_>,
    ) -> Option<StopReason> {
        for &tok in committed {
            self.committed += 1;
            tokens.push(tok);
            if let Some(r) = sink.push(tok) {
                return Some(r);
            }
        }
        None
    }

    /// The figures so far.
    pub fn stats(&self) -> SpecStats {
        let mut stats = self.stats.clone();
        stats.mean_acceptance_length = if stats.blocks > 0 {
            (stats.accepted + stats.blocks) as f64 / stats.blocks as f64
        } else {
            0.0
        };
        stats.per_position_acceptance = self
            .slot_tried
            .iter()
            .zip(&self.slot_hit)
            .map(|(&t, &h)| if t > 0 { h as f64 / t as f64 } else { 0.0 })
            .collect();
        stats.per_position_drafted = self.slot_tried.clone();
        stats.per_position_accepted = self.slot_hit.clone();
        stats.schedule_stats = self.schedule.stats();
        stats
    }
}

/// Generates from `prompt` with speculation: the output is token-for-token what
/// [`crate::generate`] produces for the same verifier and `cfg`, greedy or sampled (the
/// sampled rule is [`sampled_choices`]: speculative sampling with position-keyed draws).
pub fn speculative_generate(
    verifier: &mut Verifier<'_>,
    proposer: &mut dyn Proposer,
    prompt: &[u32],
    cfg: &GenerationConfig,
    spec: SpecConfig,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    generate_blocks(
        verifier,
        prompt,
        cfg,
        spec,
        on_token,
        &mut |dec, ver, tokens, sink| dec.block(ver, proposer, tokens, sink),
    )
}

/// Generates from `prompt` like [`speculative_generate`], each block a tree from `drafts`
/// ([`SpecDecoder::tree_block`]): token for token plain decoding's output. On the CPU, with
/// blocks of at most [`TREE_MAX_VERIFY_ROWS`] rows.
pub fn speculative_generate_tree(
    verifier: &mut Verifier<'_>,
    drafts: &mut TreeDrafts<'_>,
    prompt: &[u32],
    cfg: &GenerationConfig,
    spec: SpecConfig,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    if spec.block_size > TREE_MAX_VERIFY_ROWS {
        return Err(RuntimeError::Input(format!(
            "trees of up to {TREE_MAX_VERIFY_ROWS} rows are verified: block size {} is more",
            spec.block_size
        )));
    }
    generate_blocks(
        verifier,
        prompt,
        cfg,
        spec,
        on_token,
        &mut |dec, ver, tokens, sink| dec.tree_block(ver, drafts, tokens, sink),
    )
}

/// Most rows of a verified tree: the rows whose weight products and quantised-tier reads
/// are each row's own bits (a tree's rows must compute what plain steps would).
pub const TREE_MAX_VERIFY_ROWS: usize = kakeya_models::linear::QUANT_MAX_ROWS;

/// One block of a generation: the decoder, the verifier, the committed tokens and the sink.
type NextBlock<'a> = dyn FnMut(
        &mut SpecDecoder,
        &mut Verifier<'_>,
        &mut Vec<u32>,
        &mut TokenSink<'_>,
    ) -> Result<Option<StopReason>>
    + 'a;

/// Prefills `prompt`, picks the first token, then runs `next` block by block until it stops.
fn generate_blocks(
    verifier: &mut Verifier<'_>,
    prompt: &[u32],
    cfg: &GenerationConfig,
    spec: SpecConfig,
    on_token: &mut dyn FnMut(u32),
    next: &mut NextBlock<'_>,
) -> Result<Generation> {
    let ctx = verifier.model().config.max_position_embeddings;
    let mut dec = SpecDecoder::new(spec, &cfg.sampling, ctx)?;
    if cfg.max_tokens == 0 {
        return Err(RuntimeError::Input("max_tokens must be at least 1".into()));
    }
    let t0 = Instant::now();
    let logits = verifier.prefill(prompt, cfg.prefill_chunk)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut sink = TokenSink::new(cfg, on_token);
    let mut tokens = Vec::with_capacity(prompt.len() + cfg.max_tokens);
    tokens.extend_from_slice(prompt);
    let first = dec.sampler().pick(&logits, prompt.len());
    tokens.push(first);
    let stop_reason = match sink.push(first) {
        Some(r) => r,
        None => loop {
            if let Some(r) = next(&mut dec, verifier, &mut tokens, &mut sink)? {
                break r;
            }
        },
    };
    let decode_secs = t1.elapsed().as_secs_f64();
    let stats = dec.stats();
    let tokens = sink.finish();
    let gen_stats = GenerationStats {
        prompt_tokens: prompt.len(),
        generated_tokens: tokens.len(),
        prefill_secs,
        decode_steps: stats.blocks,
        decode_secs,
        prefill_tok_s: rate(prompt.len(), prefill_secs),
        decode_tok_s: rate(dec.committed(), decode_secs),
        kv_bytes: verifier.kv_bytes().total,
        kv_mode: Some(verifier.session().policy().mode),
        kv: verifier.kv_bytes(),
    };
    Ok(Generation {
        tokens,
        stop_reason,
        stopped_on_runaway: stop_reason == StopReason::Runaway,
        stats: gen_stats,
        spec: Some(stats),
    })
}
