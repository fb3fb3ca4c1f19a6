//! Speculative sampling on a tiny random model: token-identical to plain sampling with the
//! same seed (position-keyed draws), whatever the proposer and the block schedule; and over
//! many seeds, the first two tokens follow the model's own sampling distribution, computed
//! from its logits (chi-square goodness of fit at significance 0.001), with drafts both
//! accepted and rejected along the way. The fit test tells a nearby temperature apart.

mod common;

use std::collections::HashMap;

use burn::tensor::Device;
use common::{NoisyReplay, tiny_prompt};
use kakeya_models::GemmaModel;
use kakeya_models::testing::{random_checkpoint, tiny_config};
use kakeya_runtime::{
    GenerationConfig, KvSetup, NgramProposer, Proposer, Sampler, Sampling, Session, SpecConfig,
    Verifier, generate, speculative_generate,
};

/// Runs (seeds) of the distribution test.
const RUNS: u64 = 4000;

fn model() -> GemmaModel {
    GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(8), 41), &Device::flex()).unwrap()
}

/// Top-6 sampling; a nucleus cut of 0.95 when `nucleus`.
fn sampling(temperature: f32, nucleus: bool, seed: u64) -> Sampling {
    Sampling::Sample {
        temperature,
        top_k: 6,
        top_p: if nucleus { 0.95 } else { 1.0 },
        seed,
    }
}

fn cfg(temperature: f32, nucleus: bool, seed: u64, n: usize) -> GenerationConfig {
    GenerationConfig {
        sampling: sampling(temperature, nucleus, seed),
        ..GenerationConfig::greedy(n, 16)
    }
}

fn plain(v: &GemmaModel, p: &[u32], cfg: &GenerationConfig) -> Vec<u32> {
    generate(&mut Session::new(v, 0), p, cfg, &mut |_| {})
        .unwrap()
        .tokens
}

fn spec(
    v: &GemmaModel,
    p: &[u32],
    cfg: &GenerationConfig,
    prop: &mut dyn Proposer,
    sc: SpecConfig,
) -> kakeya_runtime::Generation {
    let mut ver = Verifier::new(v, KvSetup::full(0), sc.block_size).unwrap();
    speculative_generate(&mut ver, prop, p, cfg, sc, &mut |_| {}).unwrap()
}

#[test]
fn speculative_sampling_commits_plain_samplings_tokens() {
    let v = model();
    for i in 0..6 {
        let p = tiny_prompt(i, 5 + 3 * i);
        let greedy = plain(&v, &p, &GenerationConfig::greedy(60, 16));
        for seed in 0..4 {
            let c = cfg(0.3 + 0.2 * seed as f32, seed % 2 == 0, seed, 40);
            let want = plain(&v, &p, &c);
            for sc in [SpecConfig::fixed(4), SpecConfig::adaptive(8)] {
                let mut replay = NoisyReplay::new(&p, &greedy, 0.2, seed);
                let g = spec(&v, &p, &c, &mut replay, sc);
                assert_eq!(g.tokens, want, "prompt {i}, seed {seed}, {sc:?}, replay");
                let g = spec(&v, &p, &c, &mut NgramProposer::default(), sc);
                assert_eq!(g.tokens, want, "prompt {i}, seed {seed}, {sc:?}, ngram");
            }
        }
    }
}

/// The model's sampling probability of each sequence of `k` tokens after `p`.
fn exact(v: &GemmaModel, p: &[u32], temperature: f32, k: usize) -> HashMap<Vec<u32>, f64> {
    let s = Sampler::new(sampling(temperature, false, 0));
    let mut out = HashMap::from([(Vec::new(), 1.0)]);
    for _ in 0..k {
        let mut next = HashMap::new();
        for (prefix, pp) in out {
            // The logits generation sees: the prompt's prefill, then one step per token.
            let mut sess = Session::new(v, 0);
            let mut logits = sess.run(p, 16).unwrap();
            for &t in &prefix {
                logits = sess.run(&[t], 1).unwrap();
            }
            for (t, pt) in s.distribution(&logits) {
                let mut seq = prefix.clone();
                seq.push(t);
                next.insert(seq, pp * pt);
            }
        }
        out = next;
    }
    out
}

/// Chi-square goodness of fit of `samples` to `probs` (cells expecting fewer than 5 pooled;
/// a sample outside the support gives an infinite statistic): (statistic, degrees of freedom).
fn goodness_of_fit(samples: &[Vec<u32>], probs: &HashMap<Vec<u32>, f64>) -> (f64, usize) {
    let n = samples.len() as f64;
    let mut counts: HashMap<&[u32], f64> = HashMap::new();
    for s in samples {
        if !probs.contains_key(s) {
            return (f64::INFINITY, 0); // a sample the model cannot produce
        }
        *counts.entry(s).or_default() += 1.0;
    }
    let (mut stat, mut cells, mut pooled) = (0.0, 0usize, (0.0, 0.0));
    for (k, &pk) in probs {
        let (obs, exp) = (counts.get(k.as_slice()).copied().unwrap_or(0.0), n * pk);
        if exp < 5.0 {
            pooled = (pooled.0 + obs, pooled.1 + exp);
        } else {
            stat += (obs - exp).powi(2) / exp;
            cells += 1;
        }
    }
    if pooled.1 > 0.0 {
        stat += (pooled.0 - pooled.1).powi(2) / pooled.1;
        cells += 1;
    }
    (stat, cells.saturating_sub(1))
}

/// The chi-square critical value at significance 0.001 (Wilson–Hilferty; z = 3.090).
fn critical(df: usize) -> f64 {
    let d = df.max(1) as f64;
    let h = 2.0 / (9.0 * d);
    d * (1.0 - h + 3.090 * h.sqrt()).powi(3)
}

/// Asserts that `got` follows `probs` (chi-square at significance 0.001), with drafts both
/// accepted and rejected along the way (`accepted` of `drafted`, each at least 300 times).
fn assert_law(
    got: &[Vec<u32>],
    probs: &HashMap<Vec<u32>, f64>,
    (accepted, drafted): (usize, usize),
) {
    assert!(
        accepted > 300 && drafted - accepted > 300,
        "both outcomes must occur: {accepted} of {drafted} drafts accepted"
    );
    let (stat, df) = goodness_of_fit(got, probs);
    assert!(
        stat <= critical(df),
        "chi2 {stat:.1} > {:.1} (df {df})",
        critical(df)
    );
}

/// Tokens whose joint distribution is tested: the first from the prefill, the next two from
/// one speculative block with two drafts.
const K: usize = 3;

#[test]
fn speculative_samples_follow_the_models_distribution() {
    let v = model();
    let p = tiny_prompt(3, 9);
    let t = 0.25;
    let probs = exact(&v, &p, t, K);
    // Drafts: the greedy continuation (often the likeliest token, so often accepted).
    let greedy = plain(&v, &p, &GenerationConfig::greedy(10, 16));
    let (mut accepted, mut drafted) = (0, 0);
    let got: Vec<Vec<u32>> = (0..RUNS)
        .map(|seed| {
            let mut prop = NoisyReplay::new(&p, &greedy, 0.0, 1);
            let g = spec(
                &v,
                &p,
                &cfg(t, false, seed, K + 1),
                &mut prop,
                SpecConfig::fixed(K),
            );
            let s = g.spec.unwrap();
            accepted += s.accepted;
            drafted += s.drafted;
            g.tokens[..K].to_vec()
        })
        .collect();
    assert_law(&got, &probs, (accepted, drafted));
    // Power: plain sampling at a nearby temperature (same support: top-6, no nucleus cut)
    // does not fit these probabilities.
    let other: Vec<Vec<u32>> = (0..RUNS)
        .map(|seed| plain(&v, &p, &cfg(0.3, false, seed, K)))
        .collect();
    let (stat, df) = goodness_of_fit(&other, &probs);
    assert!(
        stat > critical(df),
        "T 0.3 fits T 0.25: chi2 {stat:.1} (df {df})"
    );
}

/// Tree verification keeps the law too: trees of three rows (the drafter's top candidates
/// per position, so a node's siblings compete for its position's draw) commit the first
/// tokens with the model's sampling probabilities.
#[test]
fn tree_samples_follow_the_models_distribution() {
    use kakeya_models::testing::{drafter_config, random_drafter};
    let v = model();
    let c = drafter_config(&v.config, 2, K);
    let d = kakeya_models::DFlashDrafter::from_checkpoint(random_drafter(&c, 5), &v).unwrap();
    let p = tiny_prompt(3, 9);
    let t = 0.25;
    let probs = exact(&v, &p, t, K);
    let (mut accepted, mut drafted) = (0, 0);
    let got: Vec<Vec<u32>> = (0..RUNS)
        .map(|seed| {
            let mut ver = Verifier::new(&v, KvSetup::full(0).drafter(&d), K).unwrap();
            let mut drafts = kakeya_runtime::TreeDrafts::new(Some(&d), None, 6);
            let g = kakeya_runtime::speculative_generate_tree(
                &mut ver,
                &mut drafts,
                &p,
                &cfg(t, false, seed, K + 1),
                SpecConfig::fixed(K),
                &mut |_| {},
            )
            .unwrap();
            let s = g.spec.unwrap();
            accepted += s.accepted;
            drafted += s.drafted;
            g.tokens[..K].to_vec()
        })
        .collect();
    assert_law(&got, &probs, (accepted, drafted));
}
