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

use serde::Serialize;

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
/// Pseudo-tries a slot's estimate takes from the previous slot's rate (slot 1: from ½).
const PRIOR_WEIGHT: f64 = 0.5;
/// Weight of an old observation after each new one.
const DECAY: f64 = 0.95;
/// Plain steps before the first probe, and after a probe that won.
const MIN_PROBE_INTERVAL: usize = 16;
/// Most plain steps between probes.
pub const MAX_PROBE_INTERVAL: usize = 128;
/// Cost of each extra verified row relative to one decode step, until measured (the CPU
/// block kernel: an 8-row block ≈ 3 steps).
const PRIOR_ROW_COST: f64 = 0.3;

/// What the schedule did, for the stats.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScheduleStats {
    /// Blocks by length (index `b - 1`); length 1 is a plain decode step.
    pub blocks_by_length: Vec<usize>,
    /// Probe blocks run while plain decoding was winning.
    pub probes: usize,
    /// Mean measured seconds of a verify forward, by block length (0: never run).
    pub verify_secs_by_length: Vec<f64>,
    /// Mean measured seconds of drafting, by block length (0: never run).
    pub draft_secs_by_length: Vec<f64>,
}

/// Chooses each block's length and learns from its outcome.
#[derive(Debug, Clone)]
pub struct BlockSchedule {
    schedule: Schedule,
    max: usize,
    /// Decayed (reached, accepted) counts per draft slot.
    slots: Vec<(f64, f64)>,
    /// Decayed (sum, weight) of seconds per block length, verify and draft.
    verify: Vec<(f64, f64)>,
    /// Decayed sums of the verify cost fit: weight, x, x², y, x·y (x = length − 1, y = secs).
    fit: [f64; 5],
    draft: Vec<(f64, f64)>,
    blocks: usize,
    plain_since_probe: usize,
    probe_interval: usize,
    probing: bool,
    stats: ScheduleStats,
}

impl BlockSchedule {
    /// A schedule of blocks up to `max` tokens.
    pub fn new(schedule: Schedule, max: usize) -> Self {
        let max = max.max(1);
        Self {
            schedule,
            max,
            slots: vec![(0.0, 0.0); max - 1],
            verify: vec![(0.0, 0.0); max],
            fit: [0.0; 5],
            draft: vec![(0.0, 0.0); max],
            blocks: 0,
            plain_since_probe: 0,
            probe_interval: MIN_PROBE_INTERVAL,
            probing: false,
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

    /// Expected tokens committed by a block of `b` (the verifier's own token included).
    pub fn expected_tokens(&self, b: usize) -> f64 {
        let (mut reach, mut e, mut prev) = (1.0, 1.0, 0.5);
        for &(tried, hit) in self.slots.iter().take(b.saturating_sub(1)) {
            let p = (hit + PRIOR_WEIGHT * prev) / (tried + PRIOR_WEIGHT);
            reach *= p;
            e += reach;
            prev = p;
        }
        e
    }

    fn mean(v: &[(f64, f64)], b: usize) -> Option<f64> {
        let (s, w) = v[b - 1];
        (w > 0.0).then(|| s / w)
    }

    /// Estimated verify seconds of a block of `b`: a line `α + β·(b − 1)` fitted by decayed
    /// least squares to every verify measured on this request (so one noisy timing of a length
    /// that is rarely run cannot stick); with one length measured so far, the prior per-row
    /// cost sets the slope. `None` before any measurement.
    fn verify_secs(&self, b: usize) -> Option<f64> {
        let [s0, s1, s2, sy, sxy] = self.fit;
        if s0 <= 0.0 {
            return None;
        }
        let x = (b - 1) as f64;
        let det = s0 * s2 - s1 * s1;
        let (alpha, beta) = if det > 1e-9 * s0 * s0 {
            let beta = ((s0 * sxy - s1 * sy) / det).max(0.0);
            ((sy - beta * s1) / s0, beta)
        } else {
            // One length so far: the mean at the mean length, the prior's slope.
            let (xm, ym) = (s1 / s0, sy / s0);
            let alpha = ym / (1.0 + PRIOR_ROW_COST * xm);
            (alpha, PRIOR_ROW_COST * alpha)
        };
        Some((alpha + beta * x).max(1e-9))
    }

    /// Estimated draft seconds for a block of `b` (the nearest measured length; 0 for `b = 1`).
    fn draft_secs(&self, b: usize) -> f64 {
        if b == 1 {
            return 0.0;
        }
        (2..=self.max)
            .filter(|&m| Self::mean(&self.draft, m).is_some())
            .min_by_key(|&m| m.abs_diff(b))
            .and_then(|m| Self::mean(&self.draft, m))
            .unwrap_or(0.0)
    }

    /// The length with the most committed tokens per second; speculation must beat plain
    /// decoding by [`MARGIN`] (so that noise alone does not keep it on).
    fn best(&self) -> Option<usize> {
        let rate = |b: usize| -> Option<f64> {
            let cost = self.verify_secs(b)? + self.draft_secs(b);
            Some(self.expected_tokens(b) / cost.max(1e-12))
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

    /// The length of the next block (before the remaining budget caps it).
    pub fn next_len(&mut self) -> usize {
        self.probing = false;
        if self.schedule == Schedule::Fixed {
            return self.max;
        }
        if self.blocks < WARMUP_BLOCKS {
            return 2.min(self.max);
        }
        let b = self.best().unwrap_or(self.max);
        if b > 1 {
            self.plain_since_probe = 0;
            return b;
        }
        self.plain_since_probe += 1;
        if self.max > 1 && self.plain_since_probe > self.probe_interval {
            self.plain_since_probe = 0;
            self.probing = true;
            self.stats.probes += 1;
            return 2;
        }
        1
    }

    /// Records a block: its length `b` (the last committed token and `drafted` drafts),
    /// `accepted` drafts, and the seconds spent drafting and verifying.
    pub fn record(&mut self, drafted: usize, accepted: usize, draft_secs: f64, verify_secs: f64) {
        let b = (drafted + 1).min(self.max);
        self.blocks += 1;
        self.stats.blocks_by_length[b - 1] += 1;
        if self.probing {
            // A probe that beat plain decoding means the drafts changed: the old evidence is
            // dropped, and probes come back to the shortest interval.
            let plain = self.verify_secs(1).unwrap_or(verify_secs);
            let won = (accepted + 1) as f64 / (draft_secs + verify_secs) > 1.0 / plain;
            if won {
                self.probe_interval = MIN_PROBE_INTERVAL;
                for s in &mut self.slots {
                    *s = (0.0, 0.0);
                }
            } else {
                self.probe_interval = (self.probe_interval * 2).min(MAX_PROBE_INTERVAL);
            }
        }
        for (k, slot) in self.slots.iter_mut().enumerate().take(drafted) {
            if k > accepted {
                break; // not reached: an earlier draft was rejected
            }
            *slot = (
                DECAY * slot.0 + 1.0,
                DECAY * slot.1 + f64::from(u8::from(k < accepted)),
            );
        }
        let add = |v: &mut (f64, f64), x: f64| *v = (DECAY * v.0 + x, DECAY * v.1 + 1.0);
        add(&mut self.verify[b - 1], verify_secs);
        let x = (b - 1) as f64;
        for (f, v) in self
            .fit
            .iter_mut()
            .zip([1.0, x, x * x, verify_secs, x * verify_secs])
        {
            *f = DECAY * *f + v;
        }
        if drafted > 0 {
            add(&mut self.draft[b - 1], draft_secs);
        }
    }

    /// What the schedule did.
    pub fn stats(&self) -> ScheduleStats {
        let means = |v: &[(f64, f64)]| {
            (1..=self.max)
                .map(|b| Self::mean(v, b).unwrap_or(0.0))
                .collect()
        };
        ScheduleStats {
            verify_secs_by_length: means(&self.verify),
            draft_secs_by_length: means(&self.draft),
            ..self.stats.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds blocks whose drafts are accepted with the given per-slot outcome; verify cost
    /// `1 + 0.3 (b - 1)` units, drafting `draft` units.
    fn run(s: &mut BlockSchedule, steps: usize, accept: impl Fn(usize) -> usize, draft: f64) {
        for i in 0..steps {
            let b = s.next_len();
            let a = if b > 1 { accept(i).min(b - 1) } else { 0 };
            let d = if b > 1 { draft } else { 0.0 };
            s.record(b - 1, a, d, 1.0 + 0.3 * (b - 1) as f64);
        }
    }

    #[test]
    fn useless_drafts_fall_back_to_plain_decoding_with_rare_probes() {
        let mut s = BlockSchedule::new(Schedule::Adaptive, 8);
        run(&mut s, 1000, |_| 0, 0.2);
        let st = s.stats();
        let plain = st.blocks_by_length[0];
        // Nearly every step is plain; probes back off to the longest interval.
        assert!(plain > 960, "{st:?}");
        assert!(st.probes < 20, "{st:?}");
        assert_eq!(s.probe_interval, MAX_PROBE_INTERVAL);
    }

    #[test]
    fn good_drafts_keep_long_blocks() {
        let mut s = BlockSchedule::new(Schedule::Adaptive, 8);
        run(&mut s, 200, |_| 7, 0.1);
        assert!(s.stats().blocks_by_length[7] > 190, "{:?}", s.stats());
    }

    #[test]
    fn middling_drafts_pick_a_middle_length() {
        // Slots 1–2 always right, later ones always wrong: a block of 3 is best.
        let mut s = BlockSchedule::new(Schedule::Adaptive, 8);
        run(&mut s, 300, |_| 2, 0.0);
        let st = s.stats();
        assert!(st.blocks_by_length[2] > 250, "{st:?}");
    }

    #[test]
    fn recovers_when_drafts_get_good_again() {
        let mut s = BlockSchedule::new(Schedule::Adaptive, 8);
        run(&mut s, 300, |_| 0, 0.2);
        run(&mut s, 400, |_| 7, 0.2);
        let st = s.stats();
        // After at most one long probe interval, long blocks take over.
        assert!(st.blocks_by_length[7] > 100, "{st:?}");
    }

    #[test]
    fn fixed_never_changes() {
        let mut s = BlockSchedule::new(Schedule::Fixed, 4);
        run(&mut s, 50, |_| 0, 1.0);
        assert_eq!(s.stats().blocks_by_length, vec![0, 0, 0, 50]);
        assert_eq!(s.stats().probes, 0);
    }

    #[test]
    fn expected_tokens_follow_the_slot_rates() {
        let mut s = BlockSchedule::new(Schedule::Adaptive, 4);
        assert!((s.expected_tokens(1) - 1.0).abs() < 1e-12);
        for _ in 0..200 {
            s.record(3, 3, 0.0, 1.0);
        }
        assert!(s.expected_tokens(4) > 3.9, "{}", s.expected_tokens(4));
        for _ in 0..200 {
            s.record(3, 0, 0.0, 1.0);
        }
        assert!(s.expected_tokens(4) < 1.1, "{}", s.expected_tokens(4));
    }
}
