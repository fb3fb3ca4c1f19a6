//! Sampling on the device (`kakeya_models::Choice::Draw`): on a GPU, a sampled
//! decode step and a sampled verify block send only token ids to the host, and are recorded
//! once and replayed like greedy ones. On the tiny model over wgpu (Mesa's
//! lavapipe, `scripts/test_wgpu.sh`), or CUDA on a lent GPU:
//! `KAKEYA_TEST_DEVICE=wgpu cargo test -p kakeya-runtime --features wgpu --test wgpu_sampling`.
//!
//! - Each step's device draw equals the host sampler's pick from the same logits copied back,
//!   at temperature alone and under top-k and top-p cuts (the device sums in f32, the host in
//!   f64: they could differ only where a uniform falls within ≈ 1e-6 of a boundary between two
//!   tokens; none does in these draws).
//! - Speculative sampling on the device commits exactly plain sampling's tokens there, drafts
//!   accepted and rejected (its verify rows are the decode steps' bits, and each row's draw
//!   depends only on its row and its position's uniform).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

mod common;

use burn::tensor::Device;
use common::{NoisyReplay, tiny_prompt};
use kakeya_models::testing::{random_checkpoint, test_device, tiny_config};
use kakeya_models::{GemmaModel, gpu};
use kakeya_runtime::{
    GenerationConfig, KvSetup, NgramProposer, Sampler, Sampling, Scores, Session, SpecConfig,
    Verifier, generate, speculative_generate,
};

fn device() -> Device {
    let d = test_device();
    assert!(
        gpu::is_gpu(&d),
        "run with KAKEYA_TEST_DEVICE=wgpu (or cuda): sampling on the device needs a GPU"
    );
    d
}

fn sample(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> Sampling {
    Sampling::Sample {
        temperature,
        top_k,
        top_p,
        seed,
    }
}

#[test]
fn draws_on_the_device_equal_the_hosts_picks_from_the_same_logits() {
    let v = GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(8), 13), &device()).unwrap();
    let mut distinct = std::collections::BTreeSet::new();
    // Temperature alone (id order), then top-k and top-p cuts (most likely first).
    for (i, temperature, top_k, top_p) in [
        (0, 1.0, 0, 1.0),
        (1, 0.6, 0, 1.0),
        (2, 1.5, 0, 1.0),
        (3, 1.0, 8, 1.0),
        (4, 1.2, 0, 0.8),
        (5, 1.0, 20, 0.9),
    ] {
        let sampler = Sampler::new(sample(temperature, top_k, top_p, 5 + i as u64));
        let p = tiny_prompt(i, 9 + 4 * i);
        let (mut on, mut off) = (Session::new(&v, 0), Session::new(&v, 0));
        let mut drawn = on.run_for(&p, 16, &sampler).unwrap();
        let mut logits = off.run(&p, 16).unwrap();
        for step in 0..30 {
            let Scores::Drawn(tok) = drawn else {
                panic!("prompt {i}, step {step}: no draw on the device: {drawn:?}");
            };
            let want = sampler.pick(&logits, on.len());
            assert_eq!(
                tok, want,
                "prompt {i}, step {step}, T {temperature}, top-k {top_k}, top-p {top_p}"
            );
            distinct.insert(tok);
            drawn = on.run_for(&[tok], 1, &sampler).unwrap();
            logits = off.run(&[tok], 1).unwrap();
        }
    }
    assert!(distinct.len() > 20, "draws vary: {} tokens", distinct.len());
    // The sampled steps were recorded once and replayed (their uniforms copied in each time);
    // the picks above come from logits of steps issued kernel by kernel.
    let st = v.replay_stats();
    eprintln!("sampled steps: {st:?}");
    assert!(st.replayed > 100, "sampled steps replayed: {st:?}");
}

#[test]
fn speculative_sampling_on_the_device_commits_plain_samplings_tokens() {
    let v = GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(8), 17), &device()).unwrap();
    let mut accepted = 0;
    for i in 0..2 {
        let p = tiny_prompt(i, 6 + 5 * i);
        for (seed, temperature, top_k, top_p) in
            [(3u64, 1.0f32, 0, 1.0), (4, 0.5, 0, 1.0), (5, 1.0, 6, 0.9)]
        {
            let cfg = GenerationConfig {
                sampling: sample(temperature, top_k, top_p, seed),
                ..GenerationConfig::greedy(32, 16)
            };
            let want = generate(&mut Session::new(&v, 0), &p, &cfg, &mut |_| {})
                .unwrap()
                .tokens;
            for sc in [SpecConfig::fixed(4), SpecConfig::adaptive(8)] {
                let mut ver = Verifier::new(&v, KvSetup::full(0), sc.block_size).unwrap();
                let mut replay = NoisyReplay::new(&p, &want, 0.25, seed);
                let g =
                    speculative_generate(&mut ver, &mut replay, &p, &cfg, sc, &mut |_| {}).unwrap();
                assert_eq!(g.tokens, want, "prompt {i}, seed {seed}, {sc:?}, replay");
                accepted += g.spec.as_ref().expect("speculation figures").accepted;
                let mut ver = Verifier::new(&v, KvSetup::full(0), sc.block_size).unwrap();
                let mut ngram = NgramProposer::default();
                let g =
                    speculative_generate(&mut ver, &mut ngram, &p, &cfg, sc, &mut |_| {}).unwrap();
                assert_eq!(g.tokens, want, "prompt {i}, seed {seed}, {sc:?}, ngram");
            }
        }
    }
    assert!(accepted > 20, "drafts accepted: {accepted}");
}
