//! The KV modes on tiny random models: a window covering the whole context equals `full`;
//! `restored` with an oracle restorer (the verifier's own K/V) equals `full`, and so do the
//! residual modes with it as their predictor; speculative
//! decoding equals plain greedy decoding in the same mode, for every mode and blocks 4/8/16 with
//! windows wrapping mid-block; rollback under random accept counts never needs a demoted
//! position; the `bounded-*` and `residual-*` presets (per-channel keys, rotation) decode
//! speculatively as plainly; per-layer rules shape the plan; the byte accounting adds up; bad settings are
//! refused.

mod common;

use burn::tensor::Device;
use common::{NoisyReplay, max_diff, oracle_restorer, random_f_theta_restorer, tiny_prompt};
use kakeya_models::testing::{drafter_config, random_checkpoint, random_drafter, tiny_config};
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::kv::{Bits, Keep, KvMode, KvPolicy, LayerRule, Restorer};
use kakeya_runtime::{
    DFlashProposer, Generation, GenerationConfig, KvSetup, Proposer, Session, SpecConfig, Verifier,
    generate, speculative_generate,
};

/// Native sliding window of the tiny verifier (layer 5 is global).
const NATIVE: usize = 24;

fn verifier() -> GemmaModel {
    GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(NATIVE), 11), &Device::flex())
        .unwrap()
}

fn drafter(v: &GemmaModel, block: usize) -> DFlashDrafter {
    let c = drafter_config(&v.config, 2, block);
    DFlashDrafter::from_checkpoint(random_drafter(&c, 5), v).unwrap()
}

fn prompt(i: usize, len: usize) -> Vec<u32> {
    tiny_prompt(i, len)
}

fn cfg(max_tokens: usize) -> GenerationConfig {
    GenerationConfig::greedy(max_tokens, 16)
}

fn policy(mode: KvMode, sink: usize, window: usize) -> KvPolicy {
    KvPolicy {
        mode,
        sink,
        window,
        ..KvPolicy::new(mode)
    }
}

fn setup<'m>(p: KvPolicy, d: &'m DFlashDrafter, r: &'m dyn Restorer) -> KvSetup<'m> {
    KvSetup::new(p).drafter(d).restorer(r)
}

fn plain(v: &GemmaModel, s: KvSetup<'_>, p: &[u32], n: usize) -> Generation {
    generate(
        &mut Session::with_kv(v, s).unwrap(),
        p,
        &cfg(n),
        &mut |_| {},
    )
    .unwrap()
}

fn spec(
    v: &GemmaModel,
    s: KvSetup<'_>,
    prop: &mut dyn Proposer,
    p: &[u32],
    n: usize,
    block: usize,
) -> Generation {
    let mut ver = Verifier::new(v, s, block).unwrap();
    speculative_generate(
        &mut ver,
        prop,
        p,
        &cfg(n),
        SpecConfig::fixed(block),
        &mut |_| {},
    )
    .unwrap()
}

/// Logits of the prompt's last position and of every step feeding `tokens`.
fn trace(v: &GemmaModel, s: KvSetup<'_>, p: &[u32], tokens: &[u32]) -> Vec<Vec<f32>> {
    common::trace(v, s, 16, p, tokens)
}

#[test]
fn a_window_covering_the_context_equals_full() {
    let v = verifier();
    let d = drafter(&v, 4);
    let r = random_f_theta_restorer(&v, &d);
    let p = prompt(1, 45);
    let full = plain(&v, KvSetup::full(0), &p, 40);
    let reference = trace(&v, KvSetup::full(0), &p, &full.tokens);
    for mode in KvMode::all().into_iter().filter(|m| m.windowed()) {
        let s = setup(policy(mode, 4, 200), &d, &r);
        let got = plain(&v, s, &p, 40);
        assert_eq!(got.tokens, full.tokens, "{mode}: tokens");
        let diff = max_diff(&trace(&v, s, &p, &full.tokens), &reference);
        assert!(diff <= 1e-5, "{mode}: max |Δlogit| {diff} > 1e-5");
    }
}

#[test]
fn restored_with_an_oracle_restorer_equals_full() {
    let v = verifier();
    // 420 + 40 positions: the global layer reads its evicted tier in two tiles of 256.
    for (i, len) in [(0, 37), (1, 60), (2, 420)] {
        let p = prompt(i, len);
        // f32 exact tiers: the oracle's K/V are the exact f32 values.
        let native = KvSetup::new(common::f32_kv(KvPolicy::new(KvMode::Full)));
        let full = plain(&v, native, &p, 40);
        let mut seq = p.clone();
        seq.extend(&full.tokens);
        let o = oracle_restorer(&v, &seq);
        let reference = trace(&v, native, &p, &full.tokens);
        for (sink, window) in [(2, 4), (0, 1), (4, 9)] {
            let s =
                KvSetup::new(common::f32_kv(policy(KvMode::Restored, sink, window))).restorer(&o);
            let got = plain(&v, s, &p, 40);
            assert_eq!(got.tokens, full.tokens, "sink {sink}, window {window}");
            let diff = max_diff(&trace(&v, s, &p, &full.tokens), &reference);
            assert!(
                diff <= 1e-5,
                "sink {sink}, window {window}: max |Δlogit| {diff}"
            );
        }
        // The same machinery with the tier dropped differs: the test can tell.
        let dropped = trace(
            &v,
            KvSetup::new(common::f32_kv(policy(KvMode::SinkWindow, 2, 4))),
            &p,
            &full.tokens,
        );
        assert!(max_diff(&dropped, &reference) > 1e-2);
    }
}

/// `residual-k2v2` with every layer's evicted K/V held as residuals (global layers' window
/// 64, the least per-channel keys allow; sliding layers per token).
fn residual_everywhere(sink: usize, window: usize) -> KvPolicy {
    let mode = KvMode::Residual {
        k: Bits::B2,
        v: Bits::B2,
    };
    KvPolicy {
        global: Some(LayerRule {
            window: Some(64),
            ..LayerRule::default()
        }),
        sliding: Some(LayerRule {
            keep: Some(Keep::Residual),
            ..LayerRule::default()
        }),
        ..common::f32_kv(policy(mode, sink, window))
    }
}

#[test]
fn residual_with_a_perfect_predictor_equals_full() {
    let v = verifier();
    let d = drafter(&v, 4);
    let random = random_f_theta_restorer(&v, &d);
    for (i, len) in [(0, 37), (1, 90), (2, 420)] {
        let p = prompt(i, len);
        let native = KvSetup::new(common::f32_kv(KvPolicy::new(KvMode::Full)));
        let full = plain(&v, native, &p, 40);
        let mut seq = p.clone();
        seq.extend(&full.tokens);
        let o = oracle_restorer(&v, &seq);
        let reference = trace(&v, native, &p, &full.tokens);
        for (sink, window) in [(2, 4), (0, 1), (4, 9)] {
            // The oracle predicts every position exactly: the 2-bit residuals are of
            // (nearly) nothing.
            let s = KvSetup::new(residual_everywhere(sink, window)).restorer(&o);
            let got = plain(&v, s, &p, 40);
            assert_eq!(got.tokens, full.tokens, "sink {sink}, window {window}");
            let diff = max_diff(&trace(&v, s, &p, &full.tokens), &reference);
            assert!(
                diff <= 1e-5,
                "sink {sink}, window {window}: max |Δlogit| {diff}"
            );
            // A poor predictor leaves 2-bit residuals of the whole signal: the test can tell.
            let s = setup(residual_everywhere(sink, window), &d, &random);
            let diff = max_diff(&trace(&v, s, &p, &full.tokens), &reference);
            assert!(diff > 1e-3, "sink {sink}, window {window}: {diff}");
        }
    }
}

#[test]
fn every_mode_decodes_speculatively_as_it_does_plainly() {
    let v = verifier();
    for block in [4, 8, 16] {
        let d = drafter(&v, block);
        let r = random_f_theta_restorer(&v, &d);
        for mode in KvMode::all() {
            let s = setup(policy(mode, 2, 16), &d, &r);
            for i in 0..2 + usize::from(block == 8) {
                // 30–45 prompt tokens + 40 generated: the 16-position windows wrap many times,
                // and mid-block; with block 8 also 300 (the evicted tier read in two tiles).
                let p = prompt(i, [30, 45, 300][i]);
                let want = plain(&v, s, &p, 40);
                let got = spec(&v, s, &mut DFlashProposer::new(&d), &p, 40, block);
                assert_eq!(got.tokens, want.tokens, "{mode}, block {block}, prompt {i}");
                assert_eq!(got.stats.kv_mode, Some(mode));
                if block == 4 && i == 0 {
                    // The evicted tiers are in play: every mode but `full` computes other logits.
                    let full = plain(&v, KvSetup::full(0), &p, 40);
                    let diff = max_diff(
                        &trace(&v, s, &p, &full.tokens),
                        &trace(&v, KvSetup::full(0), &p, &full.tokens),
                    );
                    assert_eq!(diff > 0.0, mode != KvMode::Full, "{mode}: |Δlogit| {diff}");
                }
            }
        }
    }
}

#[test]
fn rollback_under_random_accept_counts_never_needs_a_demoted_position() {
    let v = verifier();
    let d = drafter(&v, 16);
    let r = random_f_theta_restorer(&v, &d);
    let mut seed = 1u64;
    for mode in KvMode::all().into_iter().filter(|m| *m != KvMode::Full) {
        for (block, window) in [(4, 4), (8, 9), (16, 16)] {
            seed += 1;
            let s = setup(policy(mode, 2, window), &d, &r);
            let p = prompt(seed as usize, 31);
            let want = plain(&v, s, &p, 60);
            let mut prop = NoisyReplay::new(&p, &want.tokens, 0.25, seed * 7919);
            let got = spec(&v, s, &mut prop, &p, 60, block);
            let st = got.spec.unwrap();
            assert!(
                st.accepted > 0 && st.accepted < st.drafted,
                "{mode}: accept counts vary ({} of {})",
                st.accepted,
                st.drafted
            );
            assert_eq!(
                got.tokens, want.tokens,
                "{mode}, block {block}, window {window}"
            );
        }
    }
}

#[test]
fn rolling_back_past_the_slack_is_refused_not_wrong() {
    let v = verifier();
    for mode in [KvMode::SinkWindow, KvMode::Quant4, KvMode::Quant8All] {
        let p = prompt(3, 40);
        let setup = KvSetup {
            slack: 1,
            ..KvSetup::new(policy(mode, 2, 8))
        };
        let mut s = Session::with_kv(&v, setup).unwrap();
        s.run(&p, 16).unwrap();
        for t in [5, 6, 7] {
            s.run(&[t], 1).unwrap();
        }
        // Rolling back the last forward is exact; going further than the window's slack is not
        // possible for windowed modes and must be refused.
        s.truncate(42).unwrap();
        let r = s.truncate(20);
        if mode.windowed() {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("roll back"), "{mode}: {e}");
        } else {
            r.unwrap();
        }
    }
}

#[test]
fn bytes_are_measured_and_bounded_modes_hold_less() {
    let v = verifier();
    let d = drafter(&v, 4);
    let r = random_f_theta_restorer(&v, &d);
    let p = prompt(2, 150);
    let full = plain(&v, KvSetup::full(0), &p, 20).stats.kv;
    assert_eq!(full.total, full.exact, "full holds only exact K/V");
    // Full holds 16-bit K/V: the reference's bytes, plus less than a 64-position block per
    // layer (169 positions sit in 192 slots of the global layer; the rings hold their window).
    assert!(full.exact >= full.full_f16, "{full:?}");
    let block: usize = (0..v.config.num_hidden_layers)
        .map(|i| kakeya_runtime::kv::KV_BLOCK * v.config.kv_width_of(i) * 2 * 2)
        .sum();
    assert!(full.exact < full.full_f16 + block, "{full:?}");
    for mode in KvMode::all().into_iter().filter(|m| *m != KvMode::Full) {
        let kv = plain(&v, setup(policy(mode, 4, 16), &d, &r), &p, 20)
            .stats
            .kv;
        assert_eq!(
            kv.total,
            kv.exact + kv.quantised + kv.store + kv.transient_peak,
            "{mode}: parts add up"
        );
        assert_eq!(kv.full_f16, full.full_f16, "{mode}: same reference");
        assert!(kv.store > 0, "{mode}: the drafter's store is counted");
        match mode {
            KvMode::Quant8All | KvMode::Quant4All => assert_eq!(kv.exact, 0, "{mode}"),
            _ => assert!(
                kv.exact > 0 && kv.exact < full.exact,
                "{mode}: exact {}",
                kv.exact
            ),
        }
        let quantises = matches!(
            mode,
            KvMode::Quant8
                | KvMode::Quant4
                | KvMode::Quant8All
                | KvMode::Quant4All
                | KvMode::Bounded { .. }
                | KvMode::Residual { .. }
        );
        assert_eq!(kv.quantised > 0, quantises, "{mode}: quantised tier");
        assert!(
            kv.transient_peak > 0 || mode == KvMode::SinkWindow || mode == KvMode::ExactGlobal,
            "{mode}"
        );
    }
    // 4-bit holds less than 8-bit; a quantised store less than an f32 one.
    let q = |m| plain(&v, setup(policy(m, 4, 16), &d, &r), &p, 20).stats.kv;
    assert!(q(KvMode::Quant4All).quantised < q(KvMode::Quant8All).quantised);
    assert!(q(KvMode::RestoredQ4).store < q(KvMode::RestoredQ8).store);
    assert!(q(KvMode::RestoredQ8).store < q(KvMode::Restored).store);
}

#[test]
fn bad_settings_are_refused() {
    let v = verifier();
    let d = drafter(&v, 8);
    let err = |s: KvSetup<'_>, block: usize| Verifier::new(&v, s, block).unwrap_err().to_string();
    let e = err(KvSetup::new(policy(KvMode::SinkWindow, 4, 4)), 8);
    assert!(
        e.contains("block size 8 is larger than the global layers' exact window of 4"),
        "{e}"
    );
    let e = err(KvSetup::new(policy(KvMode::Quant4, 500, 64)), 1);
    assert!(e.contains("larger than the model's context"), "{e}");
    let e = err(KvSetup::new(policy(KvMode::SinkWindow, 4, 0)), 1);
    assert!(e.contains("at least 1 position"), "{e}");
    let e = err(KvSetup::new(policy(KvMode::Restored, 4, 16)), 1);
    assert!(e.contains("needs an f_θ"), "{e}");
    let r = random_f_theta_restorer(&v, &d);
    let e = err(
        KvSetup::new(policy(KvMode::RestoredQ4, 4, 16)).restorer(&r),
        1,
    );
    assert!(e.contains("needs the drafter"), "{e}");
    // The residual modes need f_θ and the drafter's store as the restored ones do; a policy
    // file's residual rule needs a residual mode.
    let residual = "residual-k4v3".parse::<KvMode>().unwrap();
    let e = err(KvSetup::new(policy(residual, 4, 16)), 1);
    assert!(e.contains("needs an f_θ"), "{e}");
    let e = err(KvSetup::new(policy(residual, 4, 16)).restorer(&r), 1);
    assert!(e.contains("needs the drafter"), "{e}");
    let rule = KvPolicy {
        global: Some(LayerRule {
            keep: Some(Keep::Residual),
            ..LayerRule::default()
        }),
        ..policy(KvMode::RECOMMENDED, 4, 16)
    };
    let e = err(setup(rule, &d, &r), 1);
    assert!(e.contains("keep residuals of f_θ's prediction"), "{e}");
    let rule = KvPolicy {
        global: Some(LayerRule {
            k_groups: Some(kakeya_runtime::kv::policy::KeyGroups::Token),
            ..LayerRule::default()
        }),
        ..policy("bounded-k3v2-mixed".parse().unwrap(), 4, 16)
    };
    let e = err(KvSetup::new(rule), 1);
    assert!(e.contains("needs keys grouped per channel"), "{e}");
    assert!(
        "quant3"
            .parse::<KvMode>()
            .unwrap_err()
            .to_string()
            .contains("quant4-all")
    );
    for (name, why) in [
        ("bounded-k9v2", "unsupported key bit width 9"),
        ("bounded-k4v1", "unsupported value bit width 1"),
        ("bounded-k4", "expected k<K>v<V>"),
        ("bounded-kxv2", "not a number"),
        ("bounded-k9v2-mixed", "unsupported key bit width 9"),
        ("bounded-k3v2-mix", "not a number"),
        ("residual-k9v2", "unsupported key bit width 9"),
        ("residual-k3", "expected k<K>v<V>"),
    ] {
        let e = name.parse::<KvMode>().unwrap_err().to_string();
        assert!(e.contains(why) && e.contains(name), "{name}: {e}");
    }
    // Per-channel keys: a window shorter than a block, a verified block longer than one.
    let bounded = KvMode::Bounded {
        k: Bits::B4,
        v: Bits::new(2).unwrap(),
        mixed: false,
    };
    let short = KvPolicy {
        global: Some(LayerRule {
            window: Some(32),
            ..LayerRule::default()
        }),
        ..policy(bounded, 4, 16)
    };
    let e = err(KvSetup::new(short), 1);
    assert!(e.contains("must hold at least 64 (it is 32)"), "{e}");
    let e = err(KvSetup::new(policy(bounded, 4, 200)), 100);
    assert!(e.contains("over the 64-position slack"), "{e}");
}

/// Every `bounded-*` (uniform and mixed) and `residual-*` preset over positions far past its
/// 128-position global window: the
/// per-channel key blocks complete inside verified blocks and rollbacks reopen them; plain
/// and speculative decoding (blocks 4/8/16, random accept counts) give the same tokens, and
/// the quantised tier is read (the logits differ from `full`).
#[test]
fn bounded_and_residual_presets_decode_speculatively_as_they_do_plainly() {
    let v = verifier();
    let d = drafter(&v, 16);
    let r = random_f_theta_restorer(&v, &d);
    let mut seed = 40u64;
    let bits = |n| Bits::new(n).unwrap();
    let presets = kakeya_runtime::BOUNDED_PRESETS
        .map(|(k, v)| KvMode::Bounded {
            k: bits(k),
            v: bits(v),
            mixed: false,
        })
        .into_iter()
        .chain(kakeya_runtime::MIXED_PRESETS.map(|(k, v)| KvMode::Bounded {
            k: bits(k),
            v: bits(v),
            mixed: true,
        }))
        .chain(
            kakeya_runtime::RESIDUAL_PRESETS.map(|(k, v)| KvMode::Residual {
                k: bits(k),
                v: bits(v),
            }),
        );
    for mode in presets {
        let s = setup(policy(mode, 2, 16), &d, &r);
        let p = prompt(seed as usize, 170);
        let want = plain(&v, s, &p, 60);
        for block in [4, 8, 16] {
            seed += 1;
            let got = spec(&v, s, &mut DFlashProposer::new(&d), &p, 60, block);
            assert_eq!(got.tokens, want.tokens, "{mode}, block {block}");
            let mut prop = NoisyReplay::new(&p, &want.tokens, 0.3, seed * 7919);
            let got = spec(&v, s, &mut prop, &p, 60, block);
            let st = got.spec.unwrap();
            assert!(st.accepted > 0 && st.accepted < st.drafted, "{mode}");
            assert_eq!(got.tokens, want.tokens, "{mode}, block {block}, noisy");
        }
        let full = plain(&v, KvSetup::full(0), &p, 60);
        let diff = max_diff(
            &trace(&v, s, &p, &full.tokens),
            &trace(&v, KvSetup::full(0), &p, &full.tokens),
        );
        assert!(diff > 0.0, "{mode}: the quantised tier is read");
    }
}

/// A preset's plan per kind of layer, and `[global]` / `[sliding]` rules over it.
#[test]
fn per_layer_rules_shape_the_plan() {
    use kakeya_runtime::kv::{Evicted, LayerPlan, QuantFormat, Ranges};
    let bounded = KvMode::Bounded {
        k: Bits::B4,
        v: Bits::new(2).unwrap(),
        mixed: false,
    };
    let p = policy(bounded, 4, 64);
    let global = kakeya_models::CacheSpec::Full;
    let sliding = kakeya_models::CacheSpec::Sliding { window: 512 };
    assert_eq!(
        p.plan(global),
        LayerPlan::Bounded {
            evicted: Evicted::Quantise(QuantFormat {
                k_bits: Bits::B4,
                v_bits: Bits::new(2).unwrap(),
                k_per_channel: true,
                rotate: true,
                ranges: Ranges::Fitted,
                k_mixed: false,
            }),
            sink: 4,
            window: 128,
        }
    );
    // `-mixed` shares the key bits among each block's channels, and says so in its name.
    let mixed: KvMode = "bounded-k3v2-mixed".parse().unwrap();
    assert_eq!(mixed.name(), "bounded-k3v2-mixed");
    match policy(mixed, 4, 64).plan(global) {
        LayerPlan::Bounded {
            evicted: Evicted::Quantise(f),
            ..
        } => assert!(
            f.k_mixed && f.k_per_channel && f.k_bits == Bits::B3,
            "{f:?}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        p.plan(sliding),
        LayerPlan::Bounded {
            evicted: Evicted::Drop,
            sink: 4,
            window: 64
        }
    );
    let ruled = KvPolicy {
        global: Some(LayerRule {
            k_bits: Some(8),
            k_groups: Some(kakeya_runtime::kv::policy::KeyGroups::Token),
            rotate: Some(false),
            ranges: Some(Ranges::MinMax),
            window: Some(256),
            ..LayerRule::default()
        }),
        sliding: Some(LayerRule {
            keep: Some(kakeya_runtime::kv::policy::Keep::Native),
            ..LayerRule::default()
        }),
        ..p
    };
    assert_eq!(
        ruled.plan(global),
        LayerPlan::Bounded {
            evicted: Evicted::Quantise(QuantFormat {
                k_bits: Bits::B8,
                v_bits: Bits::new(2).unwrap(),
                k_per_channel: false,
                rotate: false,
                ranges: Ranges::MinMax,
                k_mixed: false,
            }),
            sink: 4,
            window: 256,
        }
    );
    assert_eq!(ruled.plan(sliding), LayerPlan::Native);
}

#[test]
fn drafts_from_a_short_window_decode_as_plain_decoding_and_the_store_stays_bounded() {
    let v = verifier();
    let d = drafter(&v, 8);
    let p = prompt(3, 200);
    for mode in [KvMode::Full, KvMode::RECOMMENDED] {
        let store_of = |draft_window| {
            let s = KvSetup::new(KvPolicy {
                draft_window,
                ..policy(mode, 2, 16)
            })
            .drafter(&d);
            let want = plain(&v, s, &p, 40);
            let got = spec(&v, s, &mut DFlashProposer::new(&d), &p, 40, 8);
            assert_eq!(
                got.tokens, want.tokens,
                "{mode}, draft window {draft_window}"
            );
            got.stats.kv.store
        };
        let whole = store_of(10_000);
        for window in [1, 8, 40] {
            let store = store_of(window);
            assert!(store < whole, "{mode}, window {window}: {store} vs {whole}");
        }
    }
}
