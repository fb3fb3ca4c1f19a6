//! The speculative engine on tiny random verifier/drafter pairs: lossless against plain greedy
//! decoding (with sliding rings that wrap), every draft accepted when the drafts are the
//! verifier's own choices, exact rollback of verifier and drafter caches under random accept
//! counts, and bad settings refused.

mod common;

use burn::tensor::{Device, Tensor};
use common::{NoisyReplay, tiny_prompt};
use kakeya_models::testing::{drafter_config, random_checkpoint, random_drafter, tiny_config};
use kakeya_models::{DFlashDrafter, DraftContext, GemmaModel};
use kakeya_runtime::kv::HeldKv;
use kakeya_runtime::{
    CompactStore, DFlashProposer, GenerationConfig, KvCache, KvDtype, KvMode, KvPolicy, KvSetup,
    Proposer, Result, Session, SpecConfig, Verifier, generate, speculative_generate,
};

/// Sliding window of the tiny verifier: short, so rings wrap many times per generation.
const WINDOW: usize = 8;
/// Tolerance for K/V values computed in differently-shaped forwards.
const TOL: f32 = 1e-4;

fn verifier(seed: u64) -> GemmaModel {
    GemmaModel::from_checkpoint(
        random_checkpoint(&tiny_config(WINDOW), seed),
        &Device::flex(),
    )
    .unwrap()
}

fn drafter(v: &GemmaModel, layers: usize, block: usize, seed: u64) -> DFlashDrafter {
    let c = drafter_config(&v.config, layers, block);
    DFlashDrafter::from_checkpoint(random_drafter(&c, seed), v).unwrap()
}

fn prompt(i: usize) -> Vec<u32> {
    tiny_prompt(i, 2 + (i * 7) % 37)
}

fn cfg(max_tokens: usize) -> GenerationConfig {
    GenerationConfig::greedy(max_tokens, 16)
}

/// Plain greedy decoding: the reference.
fn greedy(v: &GemmaModel, p: &[u32], max_tokens: usize) -> Vec<u32> {
    generate(&mut Session::new(v, 0), p, &cfg(max_tokens), &mut |_| {})
        .unwrap()
        .tokens
}

/// On a mismatch, the position and the reference's top-1/top-2 logit gap there.
fn explain_divergence(v: &GemmaModel, p: &[u32], want: &[u32], got: &[u32]) -> String {
    let i = want.iter().zip(got).take_while(|(a, b)| a == b).count();
    let mut s = Session::new(v, 0);
    let mut logits = s.run(p, 64).unwrap();
    for &t in &want[..i] {
        logits = s.run(&[t], 1).unwrap();
    }
    let mut sorted = logits.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    format!(
        "first divergence at generated token {i}: greedy {} vs speculative {}; reference top-1/top-2 gap {:.3e}",
        want.get(i).copied().unwrap_or(u32::MAX),
        got.get(i).copied().unwrap_or(u32::MAX),
        sorted[0] - sorted[1]
    )
}

/// Drafts the verifier's own greedy continuation (replayed from a plain greedy run),
/// corrupting each draft with probability `noise` (seeded).
fn oracle(v: &GemmaModel, p: &[u32], max_tokens: usize, noise: f64, seed: u64) -> NoisyReplay {
    NoisyReplay::new(p, &greedy(v, p, max_tokens + 16), noise, seed)
}

/// A proposer that records every draft it hands out (with the position it drafts for).
struct Recording<'d> {
    inner: DFlashProposer<'d>,
    drafts: Vec<(usize, Vec<u32>)>,
}

impl Proposer for Recording<'_> {
    fn propose(
        &mut self,
        tokens: &[u32],
        n: usize,
        store: Option<&mut CompactStore>,
    ) -> Result<Vec<u32>> {
        let d = self.inner.propose(tokens, n, store)?;
        self.drafts.push((tokens.len() - 1, d.clone()));
        Ok(d)
    }
}

/// The engine's figures recomputed from the recorded drafts and the greedy output `want`
/// (generated token `j` sits at position `prompt + j`; the block drafting for position `pos`
/// follows `want[pos - prompt]`): accepted = the longest prefix of the drafts equal to the
/// greedy continuation, each block commits that plus one.
fn check_stats(
    s: &kakeya_runtime::SpecStats,
    drafts: &[(usize, Vec<u32>)],
    want: &[u32],
    b: usize,
) {
    let first = drafts.first().map_or(0, |(pos, _)| *pos);
    let (mut accepted, mut drafted) = (0, 0);
    let mut tried = vec![0usize; b - 1];
    let mut hit = vec![0usize; b - 1];
    for (pos, d) in drafts {
        let next = &want[pos - first + 1..];
        let a = d.iter().zip(next).take_while(|(x, y)| x == y).count();
        accepted += a;
        drafted += d.len();
        for k in 0..d.len() {
            tried[k] += 1;
            hit[k] += usize::from(k < a);
        }
    }
    // Only a last block shortened to the one remaining token drafts nothing.
    assert!(
        s.blocks == drafts.len() || s.blocks == drafts.len() + 1,
        "{} blocks for {} drafts",
        s.blocks,
        drafts.len()
    );
    assert_eq!(
        (s.drafted, s.accepted),
        (drafted, accepted),
        "drafted, accepted"
    );
    let mean = (accepted + s.blocks) as f64 / s.blocks as f64;
    assert!(
        (s.mean_acceptance_length - mean).abs() < 1e-12,
        "mean {} vs {mean}",
        s.mean_acceptance_length
    );
    assert_eq!(s.per_position_drafted, tried, "per-position drafted");
    assert_eq!(s.per_position_accepted, hit, "per-position accepted");
    // The blocks together commit exactly the generated tokens after the first (from prefill),
    // except that the last block may commit past max_tokens.
    assert!(
        accepted + s.blocks >= want.len() - 1,
        "blocks committed too little"
    );
    assert!(
        accepted + s.blocks < want.len() - 1 + b,
        "blocks committed too much"
    );
}

#[test]
fn random_drafter_is_lossless_over_prompts_and_block_sizes() {
    let v = verifier(21);
    let max_tokens = 40;
    for block in [4, 8, 16] {
        let d = drafter(&v, 2, block, 5 + block as u64);
        for i in 0..20 {
            let p = prompt(i);
            let want = greedy(&v, &p, max_tokens);
            let mut ver = Verifier::new(&v, KvSetup::full(0).drafter(&d), block).unwrap();
            let mut prop = Recording {
                inner: DFlashProposer::new(&d),
                drafts: Vec::new(),
            };
            let g = speculative_generate(
                &mut ver,
                &mut prop,
                &p,
                &cfg(max_tokens),
                SpecConfig::fixed(block),
                &mut |_| {},
            )
            .unwrap();
            assert!(
                g.tokens == want,
                "block {block}, prompt {i}: {}",
                explain_divergence(&v, &p, &want, &g.tokens)
            );
            check_stats(&g.spec.unwrap(), &prop.drafts, &want, block);
        }
    }
}

#[test]
fn drafts_equal_to_the_target_are_all_accepted() {
    let v = verifier(22);
    for block in [4, 8, 16] {
        for i in 0..4 {
            let p = prompt(i);
            // 1 token from prefill + whole blocks of `block` tokens.
            let max_tokens = 1 + 3 * block;
            let want = greedy(&v, &p, max_tokens);
            let mut ver = Verifier::new(&v, KvSetup::full(0), block).unwrap();
            let mut oracle = oracle(&v, &p, max_tokens, 0.0, 1);
            let g = speculative_generate(
                &mut ver,
                &mut oracle,
                &p,
                &cfg(max_tokens),
                SpecConfig::fixed(block),
                &mut |_| {},
            )
            .unwrap();
            assert!(
                g.tokens == want,
                "{}",
                explain_divergence(&v, &p, &want, &g.tokens)
            );
            let s = g.spec.unwrap();
            assert_eq!(s.blocks, 3, "block {block}: 3 blocks of {block} tokens");
            assert_eq!(s.accepted, 3 * (block - 1), "every draft accepted");
            assert_eq!(s.mean_acceptance_length, block as f64);
            assert!(s.per_position_acceptance.iter().all(|&r| r == 1.0));
        }
    }
}

fn assert_kv_close(a: &Tensor<3>, b: &Tensor<3>, what: &str) {
    let x = a.clone().into_data().try_into_vec::<f32>().unwrap();
    let y = b.clone().into_data().try_into_vec::<f32>().unwrap();
    assert_eq!(x.len(), y.len(), "{what}: sizes");
    let d = x
        .iter()
        .zip(&y)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0f32, f32::max);
    assert!(d <= TOL, "{what}: max |Δ| {d} > {TOL}");
}

/// The positions both caches hold must agree, and both must hold what the next query needs.
fn assert_same_cache(a: &KvCache, b: &KvCache, need_from: usize, what: &str) {
    let (ha, hb) = (a.held().unwrap(), b.held().unwrap());
    let lo = ha.positions[0].max(hb.positions[0]);
    assert!(
        lo <= need_from,
        "{what}: positions from {need_from} must be held"
    );
    let hi = *ha.positions.last().unwrap();
    assert_eq!(hi, *hb.positions.last().unwrap(), "{what}: same length");
    let cut = |c: &HeldKv| {
        let off = lo - c.positions[0];
        let n = hi + 1 - lo;
        let [h, _, d] = c.k.dims();
        (
            c.k.clone().slice([0..h, off..off + n, 0..d]),
            c.v.clone().slice([0..h, off..off + n, 0..d]),
        )
    };
    let ((ka, va), (kb, vb)) = (cut(&ha), cut(&hb));
    assert_kv_close(&ka, &kb, &format!("{what} K"));
    assert_kv_close(&va, &vb, &format!("{what} V"));
}

#[test]
fn random_accept_counts_leave_caches_as_if_only_committed_tokens_were_seen() {
    let v = verifier(23);
    for (block, noise, seed) in [(4, 0.3, 3u64), (8, 0.15, 4), (16, 0.1, 5)] {
        let d = drafter(&v, 2, block, 40);
        let p = prompt(seed as usize);
        let max_tokens = 90;
        // f32 caches: the comparison below is within a tolerance of two computations that are
        // not bit for bit the same (a prefill against verified blocks), and rounding to f16
        // would turn a difference of 1e-7 at a rounding boundary into one f16 step.
        let f32_kv = KvSetup::new(KvPolicy {
            dtype: KvDtype::F32,
            ..KvPolicy::new(KvMode::Full)
        });
        let mut ver = Verifier::new(&v, f32_kv.drafter(&d), block).unwrap();
        let mut oracle = oracle(&v, &p, max_tokens, noise, seed * 7919);
        let g = speculative_generate(
            &mut ver,
            &mut oracle,
            &p,
            &cfg(max_tokens),
            SpecConfig::fixed(block),
            &mut |_| {},
        )
        .unwrap();
        let s = g.spec.clone().unwrap();
        assert!(
            s.accepted > 0 && s.accepted < s.drafted,
            "block {block}: accept counts vary ({} of {} drafts)",
            s.accepted,
            s.drafted
        );
        assert_eq!(g.tokens, greedy(&v, &p, max_tokens), "block {block}");

        // Reference: a verifier that only ever saw the committed sequence.
        let mut seq = p.clone();
        seq.extend(&g.tokens[..g.tokens.len() - 1]);
        let held = ver.len();
        let mut reference = Session::with_kv(&v, f32_kv).unwrap();
        reference.run(&seq[..held], 5).unwrap();
        for l in 0..v.layers.len() {
            let a = ver.session().kv().native(l).unwrap();
            let b = reference.kv().native(l).unwrap();
            let need = (held + 1).saturating_sub(WINDOW);
            let need = if matches!(a, KvCache::Full(_)) {
                0
            } else {
                need
            };
            assert_same_cache(a, b, need, &format!("block {block}, verifier layer {l}"));
        }

        // The compact store: exactly the committed positions, the same rows as one drafter
        // projection of their aux hidden states.
        let store = ver.store_mut().unwrap().unwrap();
        let ctx_len = store.len();
        assert_eq!(ctx_len, held, "the store holds every committed position");
        let (sk, sv) = store.read(0..ctx_len).unwrap();
        let mut full = Session::with_kv(&v, f32_kv).unwrap();
        let aux = full
            .forward(
                &seq[..ctx_len],
                kakeya_models::Logits::None,
                None,
                &d.config.target_layer_ids,
            )
            .unwrap()
            .hidden;
        let (fk, fv) = d.context_rows(Tensor::cat(aux, 1)).unwrap();
        let as3 = |t: Tensor<2>| t.unsqueeze::<3>();
        assert_kv_close(&as3(sk), &as3(fk), &format!("block {block}, store K"));
        assert_kv_close(&as3(sv), &as3(fv), &format!("block {block}, store V"));
    }
}

#[test]
fn bad_block_sizes_are_refused() {
    let v = verifier(24);
    let d = drafter(&v, 1, 4, 1);
    for block in [0, v.config.max_position_embeddings + 1] {
        let mut ver = Verifier::new(&v, KvSetup::full(0).drafter(&d), 4).unwrap();
        let mut prop = DFlashProposer::new(&d);
        let err = speculative_generate(
            &mut ver,
            &mut prop,
            &prompt(1),
            &cfg(8),
            SpecConfig::fixed(block),
            &mut |_| {},
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("block size"), "{err}");
    }
}
