//! The block schedule's tests.

use super::*;

/// Feeds blocks whose drafts are accepted with the given per-slot outcome; verify cost
/// `1 + 0.3 (b - 1)` units, drafting `draft` units.
fn run(s: &mut BlockSchedule, steps: usize, accept: impl Fn(usize) -> usize, draft: f64) {
    for i in 0..steps {
        let b = s.next_len(DraftSource::Model);
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
    assert_eq!(s.sources[0].probe_interval, MAX_PROBE_INTERVAL);
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
    assert!((s.expected_tokens(DraftSource::Model, 1) - 1.0).abs() < 1e-12);
    for _ in 0..200 {
        s.next_len(DraftSource::Model);
        s.record(3, 3, 0.0, 1.0);
    }
    assert!(
        s.expected_tokens(DraftSource::Model, 4) > 3.9,
        "{}",
        s.expected_tokens(DraftSource::Model, 4)
    );
    for _ in 0..200 {
        s.next_len(DraftSource::Model);
        s.record(3, 0, 0.0, 1.0);
    }
    assert!(
        s.expected_tokens(DraftSource::Model, 4) < 1.1,
        "{}",
        s.expected_tokens(DraftSource::Model, 4)
    );
}

#[test]
fn each_source_keeps_its_own_evidence() {
    // Three-token lookups always right, the model never: long blocks for the one, plain
    // steps (and rare probes) for the other, within one request.
    let mut s = BlockSchedule::new(Schedule::Adaptive, 8);
    for i in 0..600 {
        let source = if i % 3 == 0 {
            DraftSource::Lookup(3)
        } else {
            DraftSource::Model
        };
        let b = s.next_len(source);
        let a = if source == DraftSource::Model {
            0
        } else {
            b - 1
        };
        s.record(b - 1, a, 0.0, 1.0 + 0.3 * (b - 1) as f64);
    }
    let st = s.stats();
    let lookup = &st.blocks_by_source["lookup_3_plus"];
    let model = &st.blocks_by_source["model"];
    assert!(lookup[7] > 180, "{st:?}");
    assert!(model[0] > 370, "{st:?}");
    // A lookup that goes wrong is retried soon (its drafts cost no forward); a drafter
    // that goes wrong backs off to the longest interval.
    let mut s = BlockSchedule::new(Schedule::Adaptive, 8);
    for i in 0..800 {
        let source = if i % 2 == 0 {
            DraftSource::Lookup(1)
        } else {
            DraftSource::Model
        };
        let b = s.next_len(source);
        s.record(b - 1, 0, 0.0, 1.0 + 0.3 * (b - 1) as f64);
    }
    let st = s.stats();
    let (lookup, model) = (
        st.blocks_by_source["lookup_1"][1],
        st.blocks_by_source["model"][1],
    );
    assert!(lookup >= 400 / 17 && model <= 10, "{st:?}");
    // Longer tails count as three; with nothing to draft from, a plain step.
    assert_eq!(
        DraftSource::Lookup(9).index(),
        DraftSource::Lookup(3).index()
    );
    assert_eq!(s.next_len(DraftSource::Nothing), 1);
    // The table's classes are sources of their own, probed as soon as lookups.
    let indices: Vec<usize> = [
        DraftSource::Model,
        DraftSource::Lookup(1),
        DraftSource::Lookup(2),
        DraftSource::Lookup(3),
        DraftSource::Table(1),
        DraftSource::Table(2),
        DraftSource::Table(5),
        DraftSource::Nothing,
    ]
    .map(DraftSource::index)
    .to_vec();
    assert_eq!(indices, (0..SOURCES).collect::<Vec<_>>());
    assert_eq!(
        DraftSource::name(DraftSource::Table(4).index()),
        "table_3_plus"
    );
    assert!(DraftSource::is_lookup(DraftSource::Table(1).index()));
    assert!(!DraftSource::is_lookup(DraftSource::Model.index()));
    assert!(!DraftSource::is_lookup(DraftSource::Nothing.index()));
}

/// Beside other sequences: the longest run of slots whose chance of being committed stays
/// above the threshold; no warm-up or probe where an unknown source would not pay; a model
/// drafter never.
#[test]
fn beside_others_drafts_only_what_is_committed_often_enough() {
    let src = DraftSource::Lookup(3);
    // Slot k (0-based) accepted with chance 0.9 for k < 3, then never.
    let mut s = BlockSchedule::new(Schedule::Adaptive, 8);
    for _ in 0..400 {
        let b = s.next_len_in_batch(src, 0.3);
        let a = (0..b - 1).take_while(|&k| k < 3).count();
        s.record_in_batch(b - 1, a);
    }
    // Reach after 1, 2, 3 slots ≈ 0.988 (the decayed evidence, 20 tries, and the prior's half
    // a try at ½), then ≈ 0.
    assert_eq!(s.next_len_in_batch(src, 0.3), 4);
    assert_eq!(s.next_len_in_batch(src, 0.98), 4);
    assert_eq!(s.next_len_in_batch(src, 0.995), 1);
    assert!(s.expected_tokens(src, 5) < 4.2);
    // A source with no evidence: tried at a low threshold (its warm-up block), not at a high one.
    let mut fresh = BlockSchedule::new(Schedule::Adaptive, 8);
    assert_eq!(fresh.next_len_in_batch(DraftSource::Table(1), 0.7), 1);
    for _ in 0..200 {
        assert_eq!(
            fresh.next_len_in_batch(DraftSource::Table(1), 0.7),
            1,
            "no probes"
        );
        fresh.record_in_batch(0, 0);
    }
    assert_eq!(fresh.stats().probes, 0);
    assert_eq!(fresh.next_len_in_batch(DraftSource::Table(1), 0.3), 2);
    // Nothing to draft from, or a drafter that needs a forward: plain steps.
    assert_eq!(fresh.next_len_in_batch(DraftSource::Nothing, 0.0), 1);
    assert_eq!(fresh.next_len_in_batch(DraftSource::Model, 0.0), 1);
    // A fixed schedule drafts its length from lookups, and nothing without one.
    let mut fixed = BlockSchedule::new(Schedule::Fixed, 8);
    assert_eq!(fixed.next_len_in_batch(src, 0.99), 8);
    assert_eq!(fixed.next_len_in_batch(DraftSource::Nothing, 0.0), 1);
    assert_eq!(fixed.next_len_in_batch(DraftSource::Model, 0.0), 1);
}
