//! One decode turn's stacked forward: which prompt chunks join the decoding sequences' steps,
//! which sequences verify drafts beside the others (and how many), and the forward itself.

use kakeya_models::GemmaModel;
use kakeya_models::linear::QUANT_MAX_ROWS;
use kakeya_runtime::{RuntimeError, Sampler, Sampling, Session, Verified, Want, accepted_count};

use super::seq::Seq;
use crate::metrics::Metrics;

/// The sequences (indices into `active`, from `prefilling`, oldest first) whose next prompt
/// chunks run in this turn's forward beside the decoding sequences' steps: as many as fit in
/// `chunk` prompt rows (at least one) and [`QUANT_MAX_ROWS`] sequences in all. Empty when
/// nothing prefills, or when that forward would not give every row its own bits (weights off
/// the block kernel with more than its rows): the oldest chunk then runs alone.
pub(super) fn prompt_batch(
    active: &[Seq<'_>],
    prefilling: &[usize],
    decoding: &[usize],
    chunk: usize,
    model: &GemmaModel,
) -> Vec<usize> {
    if decoding.len() >= QUANT_MAX_ROWS {
        return Vec::new();
    }
    let any_count = model.rows_invariant_at_any_count();
    let mut batch = Vec::new();
    let mut rows = 0;
    for &i in prefilling {
        let n = (active[i].job.prompt.len() - active[i].prefilled).min(chunk);
        // Past the budget (the first chunk always fits it), or past the rows that keep bits.
        let over_budget = !batch.is_empty()
            && (rows + n > chunk || decoding.len() + batch.len() >= QUANT_MAX_ROWS);
        let changes_bits = !any_count && rows + n + decoding.len() > QUANT_MAX_ROWS;
        if over_budget || changes_bits {
            break;
        }
        batch.push(i);
        rows += n;
    }
    if decoding.is_empty() && batch.len() == 1 {
        // One chunk alone: the sequence's own prefill.
        batch.clear();
    }
    batch
}

/// A stacked forward's cost of each row beyond the first, relative to one row, until measured
/// (the CPU block kernel: 8 rows ≈ 2 single-row steps).
pub(super) const PRIOR_ROW_COST: f64 = 0.15;

/// The chance of being committed from which a draft row beside `n` sequences' steps pays: its
/// cost against the batch's tokens per second without it, `β · n / T(n)` for a forward of
/// `R` rows costing `T = α + β·(R − 1)` seconds (`coefficients`: `(α, β)`, the prior's when
/// nothing was measured yet).
pub(super) fn draft_threshold(coefficients: Option<(f64, f64)>, n: usize) -> f64 {
    let (alpha, beta) = coefficients.unwrap_or((1.0, PRIOR_ROW_COST));
    let plain = alpha + beta * (n.max(1) - 1) as f64;
    (beta * n as f64 / plain.max(1e-12)).min(1.0)
}

/// Which decoding sequences verify drafts beside other sequences, and how many.
#[derive(Debug, Clone, Copy)]
pub(super) struct Beside {
    /// Least chance of being committed a draft row must have.
    pub(super) threshold: f64,
    /// Sampled sequences too ([`super::EngineParts::sampled_blocks`]), not only greedy ones.
    pub(super) sampled: bool,
    /// Blocks of one length filling at most this many rows ([`super::EngineParts::beside_rows`]).
    pub(super) rows: Option<usize>,
}

/// Most drafts a padded block beside other sequences holds.
const PADDED_DRAFTS_MAX: usize = 7;

/// Blocks of rows, and per block how many drafts were proposed (`None`: a plain step).
type Blocks = (Vec<Vec<u32>>, Vec<Option<usize>>);

/// Each sequence of `group`'s block: its newest token, then — for a sequence `beside` admits
/// — the drafts its lookups offer (a padded length when `padded` is given, else those that
/// pay, within `spare` rows in all). Returns the blocks, and per block how many drafts were
/// proposed (`None`: a plain step).
fn group_blocks(
    active: &mut [Seq<'_>],
    group: &[usize],
    beside: Option<Beside>,
    (padded, mut spare): (Option<usize>, usize),
) -> Result<Blocks, RuntimeError> {
    let mut blocks: Vec<Vec<u32>> = Vec::with_capacity(group.len());
    let mut verifies: Vec<Option<usize>> = Vec::with_capacity(group.len());
    for &i in group {
        let admitted = admits(&active[i], beside);
        let s = &mut active[i];
        let last = *s.tokens.last().expect("a decoding sequence has tokens");
        let ctx_room = (s.verifier.model().config.max_position_embeddings)
            .saturating_sub(s.verifier.len() + 1);
        let mut block = vec![last];
        let proposed = match (s.dec.as_mut(), s.proposer.as_mut(), beside) {
            (Some(dec), Some(proposer), Some(b)) if admitted => {
                let (drafts, proposed) = match padded {
                    Some(k) => {
                        dec.padded_drafts_in_batch(proposer.as_mut(), &s.tokens, k.min(ctx_room))?
                    }
                    None => {
                        let room = 1 + spare
                            .min(s.sink.remaining().saturating_sub(1))
                            .min(ctx_room);
                        let d =
                            dec.drafts_in_batch(proposer.as_mut(), &s.tokens, room, b.threshold)?;
                        let n = d.len();
                        (d, n)
                    }
                };
                spare = spare.saturating_sub(drafts.len());
                block.extend(drafts);
                Some(proposed)
            }
            _ => None,
        };
        blocks.push(block);
        verifies.push(proposed);
    }
    Ok((blocks, verifies))
}

/// Whether sequence `s` verifies drafts beside others: speculative, and greedy unless
/// `beside` lets sampled sequences in (a sampled block's rows are drawn with their
/// positions' uniforms, speculative sampling's rule).
fn admits(s: &Seq<'_>, beside: Option<Beside>) -> bool {
    s.dec.is_some()
        && s.proposer.is_some()
        && beside.is_some_and(|b| b.sampled || s.sampler.mode() == &Sampling::Greedy)
}

/// Takes each sequence's verified rows (in `order`, the first `n_group` decoding, the rest
/// prompt chunks): a prompt chunk's scores end its prefill; a block commits its accepted
/// drafts and the verifier's token; a plain step commits the token its sampler picks.
fn commit_verified(
    active: &mut [Seq<'_>],
    (order, n_group): (&[usize], usize),
    (blocks, verifies): (&[Vec<u32>], &[Option<usize>]),
    verified: Vec<Verified>,
    metrics: &Metrics,
) -> Result<(), RuntimeError> {
    for (k, (&i, v)) in order.iter().zip(verified).enumerate() {
        let (s, block) = (&mut active[i], &blocks[k]);
        if k >= n_group {
            let Verified::Scores(l) = v else {
                unreachable!("a prompt chunk gets its sampler's scores")
            };
            s.prefilled_to(s.prefilled + block.len(), &l);
            continue;
        }
        s.batched_steps += 1;
        let before = s.tokens.len();
        match v {
            Verified::Block(choices) => {
                let a = accepted_count(&block[1..], &choices);
                metrics.drafts_in_batch(block.len() - 1, a);
                let proposed = verifies[k].expect("a verified block was drafted");
                s.commit_in_batch((&block[1..], proposed), &choices)?;
            }
            Verified::Scores(l) => {
                let tok = s.sampler.pick_scores(&l, s.verifier.len());
                s.accept(tok);
            }
        }
        metrics.committed(s.tokens.len() - before);
    }
    Ok(())
}

/// One decode step of the sequences `group` (indices into `active`) in one stacked forward,
/// where each speculative sequence that `beside` admits (`None`: none) verifies a block — its
/// newest token, then the drafts its lookups offer whose chance of being committed is at
/// least the threshold — and every other sequence takes a plain step; with, in the same forward, the next
/// prompt chunk (of at most `chunk` tokens) of each sequence in `prefill` (not in `group`); at
/// most `max_rows` rows in all (the drafts give way). Returns the rows run.
pub(super) fn verify_group(
    active: &mut [Seq<'_>],
    group: &[usize],
    prefill: &[usize],
    chunk: usize,
    beside: Option<Beside>,
    max_rows: usize,
    metrics: &Metrics,
) -> Result<usize, RuntimeError> {
    let prompt_chunks: Vec<Vec<u32>> = prefill
        .iter()
        .map(|&i| {
            let s = &active[i];
            let end = (s.prefilled + chunk).min(s.job.prompt.len());
            s.job.prompt[s.prefilled..end].to_vec()
        })
        .collect();
    let prompt_rows: usize = prompt_chunks.iter().map(Vec::len).sum();
    let spare = max_rows.saturating_sub(group.len() + prompt_rows);
    if group.len() + prefill.len() > 1 {
        for &i in group {
            active[i].join_batch();
        }
    }
    let verifying = group
        .iter()
        .filter(|&&i| admits(&active[i], beside))
        .count();
    // Padded blocks: one length for every verifying sequence, the rows shared evenly.
    let padded = beside.and_then(|b| b.rows).map(|rows| {
        (rows.min(max_rows).saturating_sub(group.len() + prompt_rows) / verifying.max(1))
            .min(PADDED_DRAFTS_MAX)
    });
    let (mut blocks, mut verifies) = group_blocks(active, group, beside, (padded, spare))?;
    blocks.extend(prompt_chunks);
    verifies.extend(prefill.iter().map(|_| None));
    let order: Vec<usize> = group.iter().chain(prefill).copied().collect();
    let rows = blocks.iter().map(Vec::len).sum();
    let samplers: Vec<Sampler> = order.iter().map(|&i| active[i].sampler.clone()).collect();
    let wants: Vec<Want<'_>> = samplers
        .iter()
        .zip(&verifies)
        .map(|(s, v)| {
            if v.is_some() {
                Want::Block(s)
            } else {
                Want::Next(s)
            }
        })
        .collect();
    // Sessions in `order`'s order (each index once).
    let mut slots: Vec<Option<&mut Session<'_>>> = active
        .iter_mut()
        .map(|s| Some(s.verifier.session_mut()))
        .collect();
    let mut sessions: Vec<&mut Session<'_>> = order
        .iter()
        .map(|&i| slots[i].take().expect("each sequence once"))
        .collect();
    let block_refs: Vec<&[u32]> = blocks.iter().map(Vec::as_slice).collect();
    let verified = Session::run_batch(&mut sessions, &block_refs, &wants)?;
    drop(sessions);
    drop(slots);
    if !group.is_empty() {
        metrics.batch(group.len());
    }
    if !prefill.is_empty() {
        metrics.prompt_chunks(prefill.len());
    }
    commit_verified(
        active,
        (&order, group.len()),
        (&blocks, &verifies),
        verified,
        metrics,
    )?;
    Ok(rows)
}
