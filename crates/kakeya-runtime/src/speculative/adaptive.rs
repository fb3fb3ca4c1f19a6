//! The block-size schedule: fixed, or adapted to what speculation earns on the running
//! request so that it is never much slower than plain decoding.
//!
//! The adaptive schedule keeps, per draft slot `k`, the decayed rate at which a slot that was
//! reached (every earlier draft accepted) is accepted, `p_k`, the measured seconds of a draft
//! per block length, and a line fitted to the measured seconds of verify forwards against the
//! block length `b`. A block of `b` then commits
//! `E(b) = 1 + Σ_{k<b} Π_{j≤k} p_j` tokens in expectation for `T_d(b) + T_v(b)` seconds
//! (`b = 1` is a plain decode step: no draft). Each block uses the `b` with the most
//! committed tokens per second. A slot with little evidence leans on the previous slot's rate,
//! so lengths grow one slot at a time while drafts keep being accepted. While plain decoding
//! wins, a cheap probe (one draft) runs now and then — the interval doubles after each probe
//! that loses, up to [`MAX_PROBE_INTERVAL`] steps — so that the schedule notices when drafts
//! get good again; a probe that wins forgets the old per-slot evidence.
//!
//! The acceptance evidence, the draft costs and the probes are kept per [`DraftSource`]: a
//! prompt lookup whose three-token tail matched earlier text is right far more often than one
//! whose single token did, or than a weak drafter, and it costs no forward. Before each block
//! the driver asks the proposer which source it would draft from, and the schedule chooses the
//! length for that source. The verify cost line is shared: it is the verifier's. A lookup's
//! probe costs one verified row and no forward, so lookups (in the sequence or in a static
//! n-gram table) are probed after 2 … 16 plain steps of their own instead of 16 … 128.

use std::collections::BTreeMap;

use serde::Serialize;

use super::cost::CostLine;

/// Lookup sources the schedule tells apart, for the sequence and for the table alike: tails
/// (contexts) of 1, 2, and 3 or more matched tokens.
const LOOKUP_CLASSES: usize = 3;
/// Sources with evidence of their own: the model, each lookup class of the sequence and of the
/// table, and nothing.
const SOURCES: usize = 2 * LOOKUP_CLASSES + 2;

/// Where a block's drafts come from ([`super::Proposer::source`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSource {
    /// A model drafter (a forward per block).
    Model,
    /// Prompt lookup whose tail matched this many tokens of earlier text.
    Lookup(usize),
    /// A static n-gram table ([`super::NgramTable`]) whose longest held context has this
    /// many tokens.
    Table(usize),
    /// Nothing to draft from: the block is a plain step.
    Nothing,
}

impl DraftSource {
    fn index(self) -> usize {
        match self {
            DraftSource::Model => 0,
            DraftSource::Lookup(n) => n.clamp(1, LOOKUP_CLASSES),
            DraftSource::Table(n) => LOOKUP_CLASSES + n.clamp(1, LOOKUP_CLASSES),
            DraftSource::Nothing => SOURCES - 1,
        }
    }

    /// Whether its drafts cost no forward.
    fn is_lookup(i: usize) -> bool {
        (1..SOURCES - 1).contains(&i)
    }

    /// The name of source index `i` in the stats.
    fn name(i: usize) -> &'static str {
        [
            "model",
            "lookup_1",
            "lookup_2",
            "lookup_3_plus",
            "table_1",
            "table_2",
            "table_3_plus",
            "nothing",
        ][i]
    }
}

/// How block lengths are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// Every block has the configured length (shorter only at the end of the budget).
    Fixed,
    /// Lengths up to the configured one, chosen from measured acceptance and cost.
    Adaptive,
}

/// Probe-length blocks (one draft) before the schedule starts choosing: a request starts
/// cheaply, and lengths grow slot by slot while drafts are accepted.
const WARMUP_BLOCKS: usize = 1;
/// How much faster than plain decoding a block length must be expected to be to run.
const MARGIN: f64 = 1.02;
/// Pseudo-tries a slot's estimate takes from the previous slot's rate (slot 1: from
/// [`PRIOR_RATE`]).
const PRIOR_WEIGHT: f64 = 0.5;
/// The acceptance rate a draft slot is assumed to have before any evidence.
const PRIOR_RATE: f64 = 0.5;
/// Weight of an old observation after each new one.
const DECAY: f64 = 0.95;
/// Plain steps before the first probe, and after a probe that won.
const MIN_PROBE_INTERVAL: usize = 16;
/// Most plain steps between probes.
pub const MAX_PROBE_INTERVAL: usize = 128;
/// The probe intervals of a lookup source, whose drafts cost no forward: a probe costs one
/// verified row, so lookups are retried far sooner than a drafter.
const LOOKUP_PROBE_INTERVALS: (usize, usize) = (2, 16);
/// Cost of each extra verified row relative to one decode step, until measured (the CPU
/// block kernel: an 8-row block ≈ 3 steps).
const PRIOR_ROW_COST: f64 = 0.3;

/// What the schedule did, for the stats.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScheduleStats {
    /// Blocks by length (index `b - 1`); length 1 is a plain decode step.
    pub blocks_by_length: Vec<usize>,
    /// Blocks by where their drafts would come from (`model`, `lookup_1`, `lookup_2`,
    /// `lookup_3_plus`, `table_1`, `table_2`, `table_3_plus`, `nothing`), each with its blocks
    /// by length.
    pub blocks_by_source: BTreeMap<&'static str, Vec<usize>>,
    /// Drafts accepted, by source.
    pub accepted_by_source: BTreeMap<&'static str, usize>,
    /// Probe blocks run while plain decoding was winning.
    pub probes: usize,
    /// Mean measured seconds of a verify forward, by block length (0: never run).
    pub verify_secs_by_length: Vec<f64>,
    /// Mean measured seconds of drafting, by block length (0: never run).
    pub draft_secs_by_length: Vec<f64>,
}

/// What one draft source has shown on this request.
#[derive(Debug, Clone)]
struct Evidence {
    /// Decayed (reached, accepted) counts per draft slot.
    slots: Vec<(f64, f64)>,
    /// Decayed (sum, weight) of drafting seconds per block length.
    draft: Vec<(f64, f64)>,
    /// Blocks run with drafts of this source (probes included).
    blocks: usize,
    plain_since_probe: usize,
    probe_interval: usize,
    /// Shortest and longest probe intervals.
    intervals: (usize, usize),
}

impl Evidence {
    fn new(max: usize, intervals: (usize, usize)) -> Self {
        Self {
            slots: vec![(0.0, 0.0); max - 1],
            draft: vec![(0.0, 0.0); max],
            blocks: 0,
            plain_since_probe: 0,
            probe_interval: intervals.0,
            intervals,
        }
    }
}

/// Chooses each block's length and learns from its outcome.
#[derive(Debug, Clone)]
pub struct BlockSchedule {
    schedule: Schedule,
    max: usize,
    /// Per [`DraftSource`] index.
    sources: Vec<Evidence>,
    /// Decayed (sum, weight) of verify seconds per block length.
    verify: Vec<(f64, f64)>,
    /// Verify seconds against the block length.
    fit: CostLine,
    /// The source of the block being run, and whether it is a probe.
    current: (usize, bool),
    stats: ScheduleStats,
}

impl BlockSchedule {
    /// A schedule of blocks up to `max` tokens.
    pub fn new(schedule: Schedule, max: usize) -> Self {
        let max = max.max(1);
        Self {
            schedule,
            max,
            sources: (0..SOURCES)
                .map(|i| {
                    let intervals = if DraftSource::is_lookup(i) {
                        LOOKUP_PROBE_INTERVALS
                    } else {
                        (MIN_PROBE_INTERVAL, MAX_PROBE_INTERVAL)
                    };
                    Evidence::new(max, intervals)
                })
                .collect(),
            verify: vec![(0.0, 0.0); max],
            fit: CostLine::new(PRIOR_ROW_COST),
            current: (0, false),
            stats: ScheduleStats {
                blocks_by_length: vec![0; max],
                ..ScheduleStats::default()
            },
        }
    }

    /// The longest block.
    pub fn max(&self) -> usize {
        self.max
    }

    /// Expected tokens committed by a block of `b` drafted by `source` (the verifier's own
    /// token included).
    pub fn expected_tokens(&self, source: DraftSource, b: usize) -> f64 {
        let mut reach = 1.0;
        1.0 + self
            .slot_rates(source)
            .take(b.saturating_sub(1))
            .map(|p| {
                reach *= p;
                reach
            })
            .sum::<f64>()
    }

    /// The estimated rate at which each draft slot of `source` is accepted once reached. A
    /// slot with little evidence leans on the previous slot's rate (slot 1 on ½).
    fn slot_rates(&self, source: DraftSource) -> impl Iterator<Item = f64> + '_ {
        let mut prev = PRIOR_RATE;
        self.sources[source.index()]
            .slots
            .iter()
            .map(move |&(tried, hit)| {
                prev = (hit + PRIOR_WEIGHT * prev) / (tried + PRIOR_WEIGHT);
                prev
            })
    }

    fn mean(v: &[(f64, f64)], b: usize) -> Option<f64> {
        let (s, w) = v[b - 1];
        (w > 0.0).then(|| s / w)
    }

    /// Estimated verify seconds of a block of `b` ([`CostLine`] over every verify measured on
    /// this request). `None` before any measurement.
    fn verify_secs(&self, b: usize) -> Option<f64> {
        self.fit.at(b - 1)
    }

    /// Estimated seconds for `source` to draft a block of `b` (the nearest measured length; 0
    /// for `b = 1`).
    fn draft_secs(&self, source: DraftSource, b: usize) -> f64 {
        if b == 1 {
            return 0.0;
        }
        let draft = &self.sources[source.index()].draft;
        (2..=self.max)
            .filter(|&m| Self::mean(draft, m).is_some())
            .min_by_key(|&m| m.abs_diff(b))
            .and_then(|m| Self::mean(draft, m))
            .unwrap_or(0.0)
    }

    /// The length with the most committed tokens per second for drafts of `source`;
    /// speculation must beat plain decoding by [`MARGIN`] (so that noise alone does not keep
    /// it on).
    fn best(&self, source: DraftSource) -> Option<usize> {
        let rate = |b: usize| -> Option<f64> {
            let cost = self.verify_secs(b)? + self.draft_secs(source, b);
            Some(self.expected_tokens(source, b) / cost.max(1e-12))
        };
        let plain = rate(1)?;
        let mut best = (1, plain * MARGIN);
        for b in 2..=self.max {
            let r = rate(b)?;
            if r > best.1 {
                best = (b, r);
            }
        }
        Some(best.0)
    }

    /// The length of the next block, drafted by `source` (before the remaining budget caps
    /// it). With nothing to draft from, a plain step.
    pub fn next_len(&mut self, source: DraftSource) -> usize {
        self.choose(source, None)
    }

    /// The length of the next block when its rows are verified beside other sequences' in a
    /// stacked forward, where a draft row pays when it is committed with chance at least
    /// `threshold` (its cost against the batch's tokens per second): the most drafts of
    /// `source` whose every one is expected to be committed that often. Drafts that need a
    /// forward of their own (a model drafter's) are not run beside others, whatever the
    /// schedule: a plain step, as with nothing to draft from.
    pub fn next_len_in_batch(&mut self, source: DraftSource, threshold: f64) -> usize {
        if matches!(source, DraftSource::Model | DraftSource::Nothing) {
            self.current = (source.index(), false);
            return 1;
        }
        self.choose(source, Some(threshold))
    }

    fn choose(&mut self, source: DraftSource, beside: Option<f64>) -> usize {
        let i = source.index();
        self.current = (i, false);
        if self.schedule == Schedule::Fixed {
            return self.max;
        }
        if source == DraftSource::Nothing {
            return 1;
        }
        // Beside other sequences, a draft row costs a share of the batch's forward: a
        // source with no evidence is tried (warm-up blocks, probes) only where a draft right
        // as often as the prior says (½) pays.
        let explore = beside.is_none_or(|threshold| threshold <= PRIOR_RATE);
        if explore && self.sources[i].blocks < WARMUP_BLOCKS {
            return 2.min(self.max);
        }
        let b = match beside {
            None => self.best(source).unwrap_or(self.max),
            Some(threshold) => {
                let mut reach = 1.0;
                1 + self
                    .slot_rates(source)
                    .take(self.max - 1)
                    .take_while(|p| {
                        reach *= p;
                        reach >= threshold
                    })
                    .count()
            }
        };
        let ev = &mut self.sources[i];
        if b > 1 {
            ev.plain_since_probe = 0;
            return b;
        }
        ev.plain_since_probe += 1;
        if explore && self.max > 1 && ev.plain_since_probe > ev.probe_interval {
            ev.plain_since_probe = 0;
            self.current.1 = true;
            self.stats.probes += 1;
            return 2;
        }
        1
    }

    /// Records the block [`Self::next_len`] chose: its length `b` (the last committed token
    /// and `drafted` drafts), `accepted` drafts, and the seconds spent drafting and verifying.
    pub fn record(&mut self, drafted: usize, accepted: usize, draft_secs: f64, verify_secs: f64) {
        self.record_rows(drafted + 1, (drafted, accepted), draft_secs, verify_secs);
    }

    /// Records a block of `rows` rows whose drafts reached `drafted` deep (a tree's depth; a
    /// chain's drafts), `accepted` of them on the committed path: the cost counts the rows,
    /// the evidence per draft slot the depths.
    pub fn record_rows(
        &mut self,
        rows: usize,
        (drafted, accepted): (usize, usize),
        draft_secs: f64,
        verify_secs: f64,
    ) {
        let b = rows.clamp(1, self.max);
        let plain = self.verify_secs(1).unwrap_or(verify_secs);
        // A probe wins when it beat plain decoding.
        let won = (accepted + 1) as f64 / (draft_secs + verify_secs) > 1.0 / plain;
        self.outcome(b, (drafted, accepted), won);
        let add = |v: &mut (f64, f64), x: f64| *v = (DECAY * v.0 + x, DECAY * v.1 + 1.0);
        add(&mut self.verify[b - 1], verify_secs);
        self.fit.add(b - 1, verify_secs);
        if drafted > 0 {
            let i = self.current.0;
            add(&mut self.sources[i].draft[b - 1], draft_secs);
        }
    }

    /// A block beside other sequences of a length the batch fixed, drafted from `source`:
    /// what [`Self::record_in_batch`] then credits (no length is chosen, nothing probed).
    pub fn fixed_in_batch(&mut self, source: DraftSource) {
        self.current = (source.index(), false);
    }

    /// Records the block [`Self::next_len_in_batch`] chose: `drafted` drafts, `accepted` of
    /// them. Its seconds were the batch's, not this sequence's, and are not recorded; a
    /// probe wins when its draft was accepted.
    pub fn record_in_batch(&mut self, drafted: usize, accepted: usize) {
        let won = drafted > 0 && accepted == drafted;
        self.outcome(drafted + 1, (drafted, accepted), won);
    }

    /// The acceptance evidence and the stats of a block of `rows` rows whose drafts reached
    /// `drafted` deep; `won`: whether it beat plain decoding (matters for probes).
    fn outcome(&mut self, rows: usize, (drafted, accepted): (usize, usize), won: bool) {
        let b = rows.clamp(1, self.max);
        let (i, probing) = self.current;
        self.stats.blocks_by_length[b - 1] += 1;
        self.stats
            .blocks_by_source
            .entry(DraftSource::name(i))
            .or_insert_with(|| vec![0; self.max])[b - 1] += 1;
        if drafted > 0 {
            *self
                .stats
                .accepted_by_source
                .entry(DraftSource::name(i))
                .or_default() += accepted;
        }
        let ev = &mut self.sources[i];
        if drafted > 0 {
            ev.blocks += 1;
        }
        if probing {
            // A probe that won means the drafts changed: the old evidence is dropped, and
            // probes come back to the shortest interval.
            if won {
                ev.probe_interval = ev.intervals.0;
                for s in &mut ev.slots {
                    *s = (0.0, 0.0);
                }
            } else {
                ev.probe_interval = (ev.probe_interval * 2).min(ev.intervals.1);
            }
        }
        for (k, slot) in ev.slots.iter_mut().enumerate().take(drafted) {
            if k > accepted {
                break; // not reached: an earlier draft was rejected
            }
            *slot = (
                DECAY * slot.0 + 1.0,
                DECAY * slot.1 + f64::from(u8::from(k < accepted)),
            );
        }
    }

    /// What the schedule did.
    pub fn stats(&self) -> ScheduleStats {
        let means = |v: &[(f64, f64)]| {
            (1..=self.max)
                .map(|b| Self::mean(v, b).unwrap_or(0.0))
                .collect()
        };
        // Drafting seconds by length over every source, weighted by their blocks.
        let draft = (0..self.max)
            .map(|k| {
                self.sources
                    .iter()
                    .fold((0.0, 0.0), |(s, w), e| (s + e.draft[k].0, w + e.draft[k].1))
            })
            .collect::<Vec<_>>();
        ScheduleStats {
            verify_secs_by_length: means(&self.verify),
            draft_secs_by_length: means(&draft),
            ..self.stats.clone()
        }
    }
}

#[cfg(test)]
mod tests;
