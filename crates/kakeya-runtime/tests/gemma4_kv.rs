//! The bounded KV modes on Gemma 4 (tests/fixtures/gemma4: transformers' tiny dense model with
//! full layers of their own K/V width and KV sharing, the same without k_eq_v, and the MoE
//! model): a window covering the context equals the native caches; with windows that evict,
//! speculative decoding equals plain decoding in the same mode and the evicted tiers change
//! the logits; every layer's bytes are measured (a sharing layer holds none). The modes that
//! rebuild K/V through f_θ: with an oracle restorer (the verifier's own raw K/V) they equal the
//! native caches — a sharing layer reads its source's rebuilt keys through the source's k_norm
//! — and with a random f_θ of the model's per-layer widths speculative decoding equals plain.

mod common;

use common::{gemma4, max_diff, oracle_restorer, random_f_theta_restorer, tiny_prompt};
use kakeya_models::testing::{drafter_config, random_drafter};
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::kv::{KvMode, KvPolicy, LayerKv};
use kakeya_runtime::{
    DFlashProposer, Generation, KvSetup, Session, SpecConfig, Verifier, generate,
    speculative_generate,
};

const MODELS: [&str; 3] = ["dense", "dense-kv", "moe"];

/// The modes that keep, drop or quantise K/V (no f_θ).
fn modes() -> impl Iterator<Item = KvMode> {
    KvMode::all().into_iter().filter(|m| !m.restores())
}

fn policy(mode: KvMode, sink: usize, window: usize) -> KvPolicy {
    KvPolicy {
        mode,
        sink,
        window,
        ..KvPolicy::new(mode)
    }
}

fn plain(v: &GemmaModel, s: KvSetup<'_>, p: &[u32], n: usize) -> Generation {
    let mut session = Session::with_kv(v, s).unwrap();
    generate(
        &mut session,
        p,
        &kakeya_runtime::GenerationConfig::greedy(n, 5),
        &mut |_| {},
    )
    .unwrap()
}

/// Logits of the prompt's last position and of every step feeding `tokens`.
fn trace(v: &GemmaModel, s: KvSetup<'_>, p: &[u32], tokens: &[u32]) -> Vec<Vec<f32>> {
    common::trace(v, s, 5, p, tokens)
}

#[test]
fn a_window_covering_the_context_equals_the_native_caches() {
    for name in MODELS {
        let v = gemma4(name);
        let p = tiny_prompt(1, 20);
        let full = plain(&v, KvSetup::full(0), &p, 24);
        let reference = trace(&v, KvSetup::full(0), &p, &full.tokens);
        for mode in modes().filter(|m| m.windowed()) {
            let s = KvSetup::new(policy(mode, 2, 100));
            assert_eq!(plain(&v, s, &p, 24).tokens, full.tokens, "{name} {mode}");
            let d = max_diff(&trace(&v, s, &p, &full.tokens), &reference);
            assert!(d <= 1e-5, "{name} {mode}: max |Δlogit| {d}");
        }
    }
}

#[test]
fn bounded_modes_decode_speculatively_as_they_do_plainly() {
    for name in MODELS {
        let v = gemma4(name);
        for block in [4, 8] {
            let d = DFlashDrafter::from_checkpoint(
                random_drafter(&drafter_config(&v.config, 2, block), 7 + block as u64),
                &v,
            )
            .unwrap();
            for mode in modes() {
                // Sink 2 + window 8 of 20–33 prompt tokens + 30 generated: the full layers
                // evict, and the windows wrap mid-block.
                let s = KvSetup::new(policy(mode, 2, 8)).drafter(&d);
                for i in 0..2 {
                    let p = tiny_prompt(i, 20 + 13 * i);
                    let want = plain(&v, s, &p, 30);
                    let mut ver = Verifier::new(&v, s, block).unwrap();
                    let got = speculative_generate(
                        &mut ver,
                        &mut DFlashProposer::new(&d),
                        &p,
                        &kakeya_runtime::GenerationConfig::greedy(30, 5),
                        SpecConfig::fixed(block),
                        &mut |_| {},
                    )
                    .unwrap();
                    assert_eq!(
                        got.tokens, want.tokens,
                        "{name} {mode} block {block} prompt {i}"
                    );
                    assert_eq!(got.stats.kv_mode, Some(mode));
                    if block == 4 && i == 0 {
                        // The evicted tiers are in play: every mode but `full` computes other
                        // logits than the native caches — but `exact-global`: its sliding
                        // layers' own window (4) fits in the kept one (8), so they keep their
                        // native rings, and its full layers are native too.
                        let full = plain(&v, KvSetup::full(0), &p, 30);
                        let diff = max_diff(
                            &trace(&v, s, &p, &full.tokens),
                            &trace(&v, KvSetup::full(0), &p, &full.tokens),
                        );
                        // The `bounded-*` presets too: their global layers keep 128 positions
                        // exactly, more than these prompts hold.
                        let same = matches!(
                            mode,
                            KvMode::Full | KvMode::ExactGlobal | KvMode::Bounded { .. }
                        );
                        assert_eq!(diff > 0.0, !same, "{name} {mode}: {diff}");
                    }
                }
            }
        }
    }
}

#[test]
fn bytes_are_measured_per_layer_and_sharing_layers_hold_none() {
    let v = gemma4("dense");
    let c = &v.config;
    let p = tiny_prompt(2, 200);
    // f32 exact tiers on both sides: at these few positions a quantised tier would not pay
    // against 16-bit ones; what this checks is the accounting per layer.
    let full = plain(
        &v,
        KvSetup::new(common::f32_kv(KvPolicy::new(KvMode::Full))),
        &p,
        20,
    )
    .stats
    .kv;
    assert_eq!(full.total, full.exact);
    // The 16-bit reference counts each layer at its own width: layers 2 (full, 1 head × 32)
    // and 0, 1, 3 (sliding, 2 × 16, window 4); 4 and 5 share.
    let len = p.len() + 20 - 1; // the last token is not fed back
    let w = |i: usize| c.kv_width_of(i);
    assert_eq!((w(0), w(2)), (32, 32));
    let want_f16 = (len * w(2) + 3 * 4 * w(0)) * 2 * 2;
    assert_eq!(full.full_f16, want_f16);
    for mode in modes().filter(|&m| m != KvMode::Full) {
        let mut session =
            Session::with_kv(&v, KvSetup::new(common::f32_kv(policy(mode, 2, 6)))).unwrap();
        generate(
            &mut session,
            &p,
            &kakeya_runtime::GenerationConfig::greedy(20, 5),
            &mut |_| {},
        )
        .unwrap();
        let kv = session.kv_bytes();
        assert_eq!(
            kv.total,
            kv.exact + kv.quantised + kv.store + kv.transient_peak
        );
        assert_eq!(kv.full_f16, full.full_f16, "{mode}: same reference");
        // The sliding layers' own window (4) fits in the kept one (6): they keep their native
        // rings, so `exact-global` holds exactly the native caches and every other mode less.
        // `bounded-*` presets keep 128 positions of their global layers exactly, more than
        // this prompt holds (with quantised copies made on write): nothing to save here.
        if mode == KvMode::ExactGlobal {
            assert_eq!(kv.total, full.total, "{mode}");
        } else if let KvMode::Bounded { .. } = mode {
            assert!(kv.exact > 0 && kv.quantised > 0, "{mode}");
        } else {
            assert!(
                kv.total < full.total,
                "{mode}: {} of {}",
                kv.total,
                full.total
            );
        }
        for (i, layer) in session.kv().layers().iter().enumerate() {
            if c.kv_source(i).is_some() {
                assert!(
                    matches!(layer, LayerKv::Native(kakeya_runtime::KvCache::Shared)),
                    "{mode}: layer {i} shares"
                );
            } else if c.layer_types[i] == kakeya_weights::AttentionKind::Sliding {
                assert!(
                    matches!(layer, LayerKv::Native(_) | LayerKv::QuantAll(_)),
                    "{mode}: sliding layer {i} keeps its native ring"
                );
            }
        }
    }
}

#[test]
fn restored_with_an_oracle_restorer_equals_the_native_caches() {
    for name in MODELS {
        let v = gemma4(name);
        let p = tiny_prompt(3, 26);
        // f32 exact tiers: the oracle's K/V are the exact f32 values.
        let native = KvSetup::new(common::f32_kv(KvPolicy::new(KvMode::Full)));
        let full = plain(&v, native, &p, 24);
        let mut seq = p.clone();
        seq.extend(&full.tokens);
        let o = oracle_restorer(&v, &seq);
        let reference = trace(&v, native, &p, &full.tokens);
        // Window 3 is below the sliding layers' own 4: every layer with K/V of its own evicts
        // into the restored tier, and the sharing layers read their sources' rebuilt keys.
        for (sink, window) in [(2, 3), (0, 1), (1, 6)] {
            let s =
                KvSetup::new(common::f32_kv(policy(KvMode::Restored, sink, window))).restorer(&o);
            assert_eq!(
                plain(&v, s, &p, 24).tokens,
                full.tokens,
                "{name}: sink {sink}, window {window}"
            );
            let d = max_diff(&trace(&v, s, &p, &full.tokens), &reference);
            assert!(
                d <= 1e-5,
                "{name}: sink {sink}, window {window}: max |Δlogit| {d}"
            );
        }
        // The same machinery with the tier dropped differs: the test can tell.
        let dropped = trace(
            &v,
            KvSetup::new(policy(KvMode::SinkWindow, 2, 3)),
            &p,
            &full.tokens,
        );
        assert!(max_diff(&dropped, &reference) > 1e-3, "{name}");
    }
}

#[test]
fn restored_modes_decode_speculatively_as_they_do_plainly() {
    for name in MODELS {
        let v = gemma4(name);
        let c = &v.config;
        for block in [2, 4, 8] {
            let d = DFlashDrafter::from_checkpoint(
                random_drafter(&drafter_config(c, 2, block), 7 + block as u64),
                &v,
            )
            .unwrap();
            let r = random_f_theta_restorer(&v, &d);
            // The exact window holds at least a block; below the sliding layers' own window
            // (4, with block 2) they restore as well, from 4 on they keep their native rings.
            let window = block.max(3);
            for mode in KvMode::all().into_iter().filter(|m| m.restores()) {
                let s = KvSetup::new(policy(mode, 2, window))
                    .drafter(&d)
                    .restorer(&r);
                let p = tiny_prompt(4, 22);
                let want = plain(&v, s, &p, 30);
                let mut ver = Verifier::new(&v, s, block).unwrap();
                let got = speculative_generate(
                    &mut ver,
                    &mut DFlashProposer::new(&d),
                    &p,
                    &kakeya_runtime::GenerationConfig::greedy(30, 5),
                    SpecConfig::fixed(block),
                    &mut |_| {},
                )
                .unwrap();
                assert_eq!(got.tokens, want.tokens, "{name} {mode} block {block}");
                assert_eq!(got.stats.kv_mode, Some(mode));
                if block > 2 {
                    continue;
                }
                let mut session = Session::with_kv(&v, s).unwrap();
                generate(
                    &mut session,
                    &p,
                    &kakeya_runtime::GenerationConfig::greedy(30, 5),
                    &mut |_| {},
                )
                .unwrap();
                for (i, layer) in session.kv().layers().iter().enumerate() {
                    let sliding = c.layer_types[i] == kakeya_weights::AttentionKind::Sliding;
                    if c.kv_source(i).is_some() {
                        assert!(
                            matches!(layer, LayerKv::Native(kakeya_runtime::KvCache::Shared)),
                            "{name} {mode}: layer {i} shares"
                        );
                    } else if sliding || mode != KvMode::RestoredSliding {
                        assert!(
                            matches!(layer, LayerKv::Tiered(_)),
                            "{name} {mode}: layer {i} restores"
                        );
                    }
                }
                // f_θ's rebuilt K/V are in play: the logits differ from the native caches'.
                let full = plain(&v, KvSetup::full(0), &p, 30);
                let diff = max_diff(
                    &trace(&v, s, &p, &full.tokens),
                    &trace(&v, KvSetup::full(0), &p, &full.tokens),
                );
                assert!(diff > 0.0, "{name} {mode}: {diff}");
            }
        }
    }
}
