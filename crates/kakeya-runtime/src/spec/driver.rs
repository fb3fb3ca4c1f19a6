//! The speculative decoding loop: draft a block, verify it in one forward, accept greedily,
//! commit, roll back the rejected tail, tell the proposer what was committed.

use std::time::Instant;

use serde::Serialize;

use super::accept_greedy;
use super::adaptive::{BlockSchedule, Schedule, ScheduleStats};
use super::proposer::Proposer;
use super::sampled::sampled_posterior;
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

/// Generates from `prompt` with speculation: the output is token-for-token what
/// [`crate::generate`] produces for the same verifier and `cfg`, greedy or sampled (the
/// sampled rule is [`sampled_posterior`]: speculative sampling with position-keyed draws).
pub fn speculative_generate(
    verifier: &mut Verifier<'_>,
    proposer: &mut dyn Proposer,
    prompt: &[u32],
    cfg: &GenerationConfig,
    spec: SpecConfig,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    let ctx = verifier.model().config.max_position_embeddings;
    if spec.block_size == 0 || spec.block_size > ctx {
        return Err(RuntimeError::Input(format!(
            "block size {} must be between 1 and the context length {ctx}",
            spec.block_size
        )));
    }
    if cfg.max_tokens == 0 {
        return Err(RuntimeError::Input("max_tokens must be at least 1".into()));
    }
    let t0 = Instant::now();
    let logits = verifier.prefill(prompt, cfg.prefill_chunk)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut sink = TokenSink::new(cfg, on_token);
    let mut stats = SpecStats {
        block_size: spec.block_size,
        schedule: Some(spec.schedule),
        ..SpecStats::default()
    };
    let mut schedule = BlockSchedule::new(spec.schedule, spec.block_size);
    let mut tokens = Vec::with_capacity(prompt.len() + cfg.max_tokens);
    tokens.extend_from_slice(prompt);
    let mut slot_tried = vec![0usize; spec.block_size.saturating_sub(1)];
    let mut slot_hit = vec![0usize; spec.block_size.saturating_sub(1)];
    let greedy = cfg.sampling == Sampling::Greedy;
    let sampler = Sampler::new(cfg.sampling.clone());
    let vocab = verifier.model().config.vocab_size;
    let mut last = sampler.pick(&logits, prompt.len());
    let mut pos = prompt.len();
    let mut committed_in_decode = 0;
    let stop_reason = 'outer: {
        tokens.push(last);
        if let Some(r) = sink.push(last) {
            break 'outer r;
        }
        loop {
            if pos >= ctx {
                break 'outer StopReason::ContextFull;
            }
            let remaining = cfg.max_tokens - sink.tokens().len();
            let b = schedule.next_len().min(ctx - pos).min(remaining).max(1);
            let td = Instant::now();
            let mut drafts = if b > 1 {
                proposer.propose(&tokens, b - 1, verifier.store_mut()?)?
            } else {
                Vec::new()
            };
            drafts.truncate(b - 1);
            let draft_secs = td.elapsed().as_secs_f64();
            let mut block = Vec::with_capacity(b);
            block.push(last);
            block.extend(&drafts);
            let tv = Instant::now();
            let posterior = if greedy {
                verifier.verify(&block)?
            } else {
                let rows = verifier.verify_logits(&block)?;
                sampled_posterior(&rows, vocab, pos + 1, &sampler)
            };
            let a = accept_greedy(&drafts, &posterior);
            let next = posterior[a];
            verifier.rollback(pos + a + 1)?;
            let verify_secs = tv.elapsed().as_secs_f64();
            let (seen_draft, seen_verify) =
                spec.costs.seen(drafts.len(), (draft_secs, verify_secs));
            schedule.record(drafts.len(), a, seen_draft, seen_verify);
            stats.draft_secs += draft_secs;
            stats.verify_secs += verify_secs;
            stats.blocks += 1;
            stats.drafted += drafts.len();
            stats.accepted += a;
            for k in 0..drafts.len() {
                slot_tried[k] += 1;
                slot_hit[k] += usize::from(k < a);
            }
            pos += a + 1;
            for &tok in drafts[..a].iter().chain([&next]) {
                committed_in_decode += 1;
                tokens.push(tok);
                if let Some(r) = sink.push(tok) {
                    break 'outer r;
                }
            }
            last = next;
        }
    };
    let decode_secs = t1.elapsed().as_secs_f64();
    stats.mean_acceptance_length = if stats.blocks > 0 {
        (stats.accepted + stats.blocks) as f64 / stats.blocks as f64
    } else {
        0.0
    };
    stats.per_position_acceptance = slot_tried
        .iter()
        .zip(&slot_hit)
        .map(|(&t, &h)| if t > 0 { h as f64 / t as f64 } else { 0.0 })
        .collect();
    stats.per_position_drafted = slot_tried;
    stats.schedule_stats = schedule.stats();
    stats.per_position_accepted = slot_hit;
    let tokens = sink.finish();
    let gen_stats = GenerationStats {
        prompt_tokens: prompt.len(),
        generated_tokens: tokens.len(),
        prefill_secs,
        decode_steps: stats.blocks,
        decode_secs,
        prefill_tok_s: rate(prompt.len(), prefill_secs),
        decode_tok_s: rate(committed_in_decode, decode_secs),
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
