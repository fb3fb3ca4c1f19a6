//! Tiny random-weight Gemma 3 tests: incremental decoding equals one full forward, the ring
//! cache is exact across wraps and truncation, externally supplied K/V reproduce the cache.

mod common;

use burn::tensor::{Device, Tensor};
use kakeya_models::testing::{random_checkpoint, tiny_config};
use kakeya_models::{
    Choice, ForwardRequest, GemmaModel, KvSegment, LayerCache, Logits, Reach, SegmentKv,
};
use kakeya_runtime::{FullCache, KvCache, KvDtype, KvMode, KvPolicy, KvSetup, Session};

/// Tolerance of f32 comparisons between differently-chunked computations of the same values.
const TOL: f32 = 1e-4;

fn model(window: usize) -> GemmaModel {
    GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(window), 11), &Device::flex())
        .unwrap()
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 31 + 7) % 97) as u32).collect()
}

fn rows(t: Tensor<2>) -> Vec<Vec<f32>> {
    let [n, v] = t.dims();
    let flat = t.into_data().try_into_vec::<f32>().unwrap();
    (0..n).map(|i| flat[i * v..(i + 1) * v].to_vec()).collect()
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(d <= TOL, "{what}: max abs diff {d} > {TOL}");
}

/// Logits of every position from one forward over the whole sequence (f32 caches: the tests
/// compare paths that are not bit for bit the same, within a tolerance that 16-bit rounding
/// would swamp).
fn full_forward(m: &GemmaModel, toks: &[u32]) -> Vec<Vec<f32>> {
    let mut caches = KvCache::for_specs(&m.cache_specs(), 0, KvDtype::F32);
    rows(
        m.forward(&ForwardRequest::new(toks, 0, Logits::All), &mut caches)
            .unwrap()
            .logits
            .unwrap(),
    )
}

#[test]
fn prefill_then_decode_equals_one_full_forward() {
    let m = model(4);
    let toks = tokens(24);
    let full = full_forward(&m, &toks);
    let policy = KvPolicy {
        dtype: KvDtype::F32,
        ..KvPolicy::new(KvMode::Full)
    };
    let mut s = Session::with_kv(&m, KvSetup::new(policy)).unwrap();
    let first = s.run(&toks[..7], 3).unwrap();
    assert_close(&first, &full[6], "prefill last row");
    for (i, &t) in toks.iter().enumerate().skip(7) {
        let row = s.run(&[t], 1).unwrap();
        assert_close(&row, &full[i], &format!("decode position {i}"));
    }
}

#[test]
fn sliding_ring_matches_a_never_evicting_cache_across_wraps() {
    let m = model(5);
    let toks = tokens(30); // the ring (capacity 4) wraps 7 times
    let mut ring = KvCache::for_specs(&m.cache_specs(), 0, KvDtype::F32);
    let mut keep_all: Vec<KvCache> = m
        .cache_specs()
        .iter()
        .map(|_| KvCache::Full(FullCache::new(KvDtype::F32)))
        .collect();
    for (i, t) in toks.iter().enumerate() {
        let req = ForwardRequest::new(std::slice::from_ref(t), i, Logits::Last);
        let a = rows(m.forward(&req, &mut ring).unwrap().logits.unwrap());
        let b = rows(m.forward(&req, &mut keep_all).unwrap().logits.unwrap());
        assert_close(&a[0], &b[0], &format!("position {i}"));
    }
    let ring_bytes: usize = ring.iter().map(KvCache::nbytes).sum();
    let all_bytes: usize = keep_all.iter().map(KvCache::nbytes).sum();
    assert!(
        ring_bytes < all_bytes,
        "ring should hold less: {ring_bytes} vs {all_bytes}"
    );
}

#[test]
fn truncate_after_wrap_equals_never_having_appended() {
    let m = model(4);
    let toks = tokens(26);
    let junk = [5u32, 6, 9, 90];
    // Reference: never sees the junk.
    let mut reference = Session::new(&m, 4);
    reference.run(&toks[..15], 15).unwrap();
    // Sees the junk after the ring has wrapped, then rolls it back.
    let mut rolled = Session::new(&m, 4);
    rolled.run(&toks[..15], 15).unwrap();
    for &j in &junk {
        rolled.run(&[j], 1).unwrap();
    }
    rolled.truncate(15).unwrap();
    for &t in &toks[15..] {
        let a = reference.run(&[t], 1).unwrap();
        let b = rolled.run(&[t], 1).unwrap();
        assert_eq!(a, b, "rollback must be exact (bit-identical)");
    }
    // Rolling back further than the ring holds is refused (slack 1, plus the native ring's
    // spare slot: two positions back is the most).
    let mut s = Session::new(&m, 1);
    s.run(&toks[..12], 12).unwrap();
    assert!(s.truncate(9).is_err());
    s.truncate(10).unwrap();
}

/// A cache that stores nothing and hands attention given raw K/V for the positions before the
/// chunk (as a restorer would), plus the chunk.
struct RawPrefix {
    k_raw: Tensor<2>,
    v_raw: Tensor<2>,
}

impl LayerCache for RawPrefix {
    fn update(
        &mut self,
        k: Tensor<3>,
        v: Tensor<3>,
        start: usize,
    ) -> kakeya_models::Result<Vec<KvSegment>> {
        let t = k.dims()[1];
        let n = self.k_raw.dims()[0];
        Ok(vec![
            KvSegment {
                kv: SegmentKv::Raw {
                    k: self.k_raw.clone(),
                    v: self.v_raw.clone(),
                },
                positions: (0..n).collect(),
                reach: Reach::Always,
            },
            KvSegment::ready(k, v, (start..start + t).collect(), Reach::Always),
        ])
    }
    fn len(&self) -> usize {
        0
    }
    fn truncate(&mut self, _len: usize) -> kakeya_models::Result<()> {
        Ok(())
    }
    fn nbytes(&self) -> usize {
        0
    }
}

#[test]
fn raw_kv_segments_reproduce_the_cached_computation() {
    let m = model(64); // windows wider than the sequence: every layer sees every position
    let toks = tokens(12);
    let split = 8;
    let mut caches = KvCache::for_specs(&m.cache_specs(), 0, KvDtype::F32);
    let req = ForwardRequest {
        capture_attention: true,
        ..ForwardRequest::new(&toks, 0, Logits::All)
    };
    let out = m.forward(&req, &mut caches).unwrap();
    let full = rows(out.logits.unwrap());
    let kv = m.config.num_key_value_heads * m.config.head_dim;
    let mut raw: Vec<RawPrefix> = out
        .attention
        .iter()
        .map(|cap| RawPrefix {
            k_raw: cap.k_raw.clone().slice([0..split, 0..kv]),
            v_raw: cap.v_raw.clone().slice([0..split, 0..kv]),
        })
        .collect();
    let req = ForwardRequest::new(&toks[split..], split, Logits::All);
    let tail = rows(m.forward(&req, &mut raw).unwrap().logits.unwrap());
    for (i, row) in tail.iter().enumerate() {
        assert_close(row, &full[split + i], &format!("position {}", split + i));
    }
}

#[test]
fn hidden_states_and_captures_have_documented_shapes() {
    let m = model(4);
    let toks = tokens(5);
    let mut caches = KvCache::for_specs(&m.cache_specs(), 0, KvDtype::F32);
    let req = ForwardRequest {
        hidden_after: &[1, 4],
        capture_attention: true,
        ..ForwardRequest::new(&toks, 0, Logits::Last)
    };
    let out = m.forward(&req, &mut caches).unwrap();
    assert_eq!(out.logits.unwrap().dims(), [1, 97]);
    assert_eq!(out.hidden.len(), 2);
    assert_eq!(out.hidden[0].dims(), [5, 32]);
    assert_eq!(out.attention.len(), 6);
    assert_eq!(out.attention[0].q_raw.dims(), [5, 64]);
    assert_eq!(out.attention[0].k_raw.dims(), [5, 32]);
    assert_eq!(out.attention[0].out.dims(), [5, 32]);
}

#[test]
fn greedy_choices_equal_the_argmax_of_the_logits() {
    // The quantised head's certified search (blocks of up to 16 rows) and the host search of
    // the logits (longer chunks; a dense head) give the logits' own first largest entry, and
    // a batch that mixes greedy and logits requests gives each what it gives alone.
    use kakeya_models::testing::random_quantized_checkpoint;
    use kakeya_runtime::sampler::argmax;
    for quantised in [true, false] {
        let ck = if quantised {
            random_quantized_checkpoint(&tiny_config(4), 5)
        } else {
            random_checkpoint(&tiny_config(4), 5)
        };
        let m = GemmaModel::from_checkpoint(ck, &Device::flex()).unwrap();
        assert_eq!(m.head.quant_matrix().is_some(), quantised);
        for n in [1, 2, 5, 8, 16, 17, 30] {
            let toks = tokens(n);
            let run = |logits: Logits, choice: Option<Choice>| {
                let mut caches = KvCache::for_specs(&m.cache_specs(), 0, KvDtype::F32);
                let mut req = ForwardRequest::new(&toks, 0, logits);
                req.choice = choice;
                m.forward(&req, &mut caches).unwrap()
            };
            let all = rows(run(Logits::All, None).logits.unwrap());
            let want: Vec<u32> = all.iter().map(|r| argmax(r).unwrap() as u32).collect();
            let got = run(Logits::All, Some(Choice::Greedy));
            assert!(got.logits.is_none());
            assert_eq!(got.chosen.unwrap(), want, "n={n} quantised={quantised}");
            let last = run(Logits::Last, Some(Choice::Greedy)).chosen.unwrap();
            assert_eq!(last, vec![*want.last().unwrap()], "n={n}");
        }
        // Mixed batch: one greedy and one logits request in one forward.
        let (a, b) = (tokens(3), tokens(4));
        let mut ca = KvCache::for_specs(&m.cache_specs(), 0, KvDtype::F32);
        let mut cb = KvCache::for_specs(&m.cache_specs(), 0, KvDtype::F32);
        let outs = m
            .forward_batch(
                &[
                    ForwardRequest::new(&a, 0, Logits::All).choose(Choice::Greedy),
                    ForwardRequest::new(&b, 0, Logits::Last),
                ],
                &mut [&mut ca, &mut cb],
            )
            .unwrap();
        let alone_a = full_forward(&m, &a);
        let want: Vec<u32> = alone_a.iter().map(|r| argmax(r).unwrap() as u32).collect();
        assert_eq!(outs[0].chosen.as_deref(), Some(&want[..]));
        assert!(outs[0].logits.is_none() && outs[1].chosen.is_none());
        let lb = rows(outs[1].logits.clone().unwrap());
        assert_close(
            &lb[0],
            full_forward(&m, &b).last().unwrap(),
            "mixed batch logits",
        );
    }
}

/// A verify block's rows are bit for bit single decode steps — the tiny Gemma 3 with GGUF
/// blocks (the block kernel) and with dense f32 weights (the row-order kernel), windows that
/// wrap within the block and one that does not.
#[test]
fn a_blocks_rows_equal_single_steps_bit_for_bit() {
    use kakeya_models::testing::random_quantized_checkpoint;
    for window in [4, 64] {
        let q = GemmaModel::from_checkpoint(
            random_quantized_checkpoint(&tiny_config(window), 3),
            &Device::flex(),
        )
        .unwrap();
        common::assert_blocks_equal_steps(&q, &format!("quantised, window {window}"));
        common::assert_blocks_equal_steps(&model(window), &format!("dense, window {window}"));
    }
}

/// Past `KEY_SPAN` keys the rows of a verify block (and of a prompt chunk) that share their
/// keys run together, each tile of keys and values read once for them all: a block's rows are
/// still bit for bit single steps; a 40-row chunk (whose weight products run as one GEMM, not
/// row by row) within 1e-4 of them.
#[test]
fn rows_sharing_keys_at_depth_equal_single_steps() {
    let mut config = tiny_config(64);
    config.max_position_embeddings = 2048;
    let m = GemmaModel::from_checkpoint(random_checkpoint(&config, 13), &Device::flex()).unwrap();
    let depth = kakeya_models::host_attention::KEY_SPAN as u32 + 100;
    common::assert_blocks_equal_steps_after(&m, "dense, at depth", depth, 256);
    // A prompt chunk's rows (three blocks of shared keys) against the same positions decoded
    // one by one.
    let toks: Vec<u32> = (0..depth + 40).map(|j| (j * 11 + 3) % 90).collect();
    let mut chunked = kakeya_runtime::Session::new(&m, 0);
    chunked.run(&toks[..depth as usize], 256).unwrap();
    let rows = chunked
        .forward(
            &toks[depth as usize..],
            kakeya_models::Logits::All,
            None,
            &[],
        )
        .unwrap()
        .logits
        .unwrap()
        .into_data()
        .try_into_vec::<f32>()
        .unwrap();
    let mut steps = kakeya_runtime::Session::new(&m, 0);
    steps.run(&toks[..depth as usize], 256).unwrap();
    let vocab = config.vocab_size;
    for (i, &t) in toks[depth as usize..].iter().enumerate() {
        let want = steps.run(&[t], 1).unwrap();
        assert_close(
            &rows[i * vocab..(i + 1) * vocab],
            &want,
            &format!("row {i} of a 40-row chunk"),
        );
    }
}

/// The int8 kernel (`--kernel int8`) rounds each input row on its own, so a verify block's
/// rows stay bit for bit single steps, and speculation with it commits exactly what plain
/// decoding with it commits (drafts replayed from that decoding, some corrupted) — while its
/// logits do differ from the exact kernel's (so these checks see the int8 path).
#[test]
fn the_int8_kernel_keeps_blocks_bit_for_bit_and_speculation_lossless() {
    use kakeya_models::linear::Kernel;
    use kakeya_models::testing::random_quantized_checkpoint;
    use kakeya_runtime::{KvSetup, SpecConfig, Verifier, generate, speculative_generate};
    let exact = GemmaModel::from_checkpoint(
        random_quantized_checkpoint(&tiny_config(4), 3),
        &Device::flex(),
    )
    .unwrap();
    let mut q = exact.clone();
    assert!(
        q.set_kernel(Kernel::Int8) > 0,
        "the tiny model has quantised weights"
    );
    let p = common::tiny_prompt(1, 9);
    let (a, b) = (
        Session::new(&exact, 0).run(&p, 4).unwrap(),
        Session::new(&q, 0).run(&p, 4).unwrap(),
    );
    let moved = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    let scale = a.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
    assert!(
        moved > 0.0 && moved < 0.1 * scale,
        "int8 logits move by {moved} (scale {scale}): neither zero nor far off"
    );
    common::assert_blocks_equal_steps(&q, "int8 kernel, window 4");
    let cfg = kakeya_runtime::GenerationConfig::greedy(40, 4);
    for i in 0..6 {
        let p = common::tiny_prompt(i, 3 + 5 * i);
        let want = generate(&mut Session::new(&q, 0), &p, &cfg, &mut |_| {})
            .unwrap()
            .tokens;
        let mut cont = want.clone();
        cont.extend(std::iter::repeat_n(0, 16));
        for block in [2, 8] {
            let mut ver = Verifier::new(&q, KvSetup::full(0), block).unwrap();
            let mut prop = common::NoisyReplay::new(&p, &cont, 0.3, i as u64);
            let g = speculative_generate(
                &mut ver,
                &mut prop,
                &p,
                &cfg,
                SpecConfig::fixed(block),
                &mut |_| {},
            )
            .unwrap();
            assert_eq!(g.tokens, want, "prompt {i}, block {block}");
        }
    }
}

/// A prompt chunk run in the same forward as other sessions' decode steps
/// ([`Session::run_batch`], the server's continuous batching) gives every session exactly
/// the scores and caches its own forward gives, with either kernel of the GGUF blocks, at
/// any row count (here 3 + 12 and 3 + 20 rows: the latter in two passes of the kernel).
#[test]
fn a_prompt_chunk_beside_decode_steps_is_bit_for_bit_its_own_forward() {
    use kakeya_models::linear::Kernel;
    use kakeya_models::testing::random_quantized_checkpoint;
    use kakeya_runtime::{Sampler, Sampling, Scores, Verified, Want};
    let exact = GemmaModel::from_checkpoint(
        random_quantized_checkpoint(&tiny_config(4), 9),
        &Device::flex(),
    )
    .unwrap();
    let mut int8 = exact.clone();
    int8.set_kernel(Kernel::Int8);
    assert!(exact.rows_invariant_at_any_count() && int8.rows_invariant_at_any_count());
    // A sampling sampler asks for the whole row of logits (a greedy one only for the choice).
    let logits = Sampler::new(Sampling::Sample {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    });
    let flat = |v: Verified| match v.into_scores().expect("a chunk's scores") {
        Scores::Logits(l) => l.iter().map(|v| v.to_bits()).collect::<Vec<u32>>(),
        Scores::Greedy(id) | Scores::Drawn(id) => vec![id],
    };
    let next = Want::Next(&logits);
    for (m, prompt_len, what) in [
        (&exact, 12, "exact, 15 rows"),
        (&exact, 20, "exact, 23 rows"),
        (&int8, 20, "int8, 23 rows"),
    ] {
        let prompts: Vec<Vec<u32>> = (0..3).map(|i| common::tiny_prompt(i, 5 + i)).collect();
        let new_prompt = common::tiny_prompt(7, prompt_len);
        // Alone: each decoding session prefills, then steps one token; the new one prefills.
        let mut alone = Vec::new();
        for p in &prompts {
            let mut s = Session::new(m, 0);
            s.run(p, 4).unwrap();
            alone.push(flat(
                Session::run_batch(&mut [&mut s], &[&[3u32][..]], &[next])
                    .unwrap()
                    .remove(0),
            ));
        }
        let mut s = Session::new(m, 0);
        alone.push(flat(
            Session::run_batch(&mut [&mut s], &[&new_prompt[..]], &[next])
                .unwrap()
                .remove(0),
        ));
        // Together: one forward of 3 steps and the prompt; then a step each, still equal.
        let mut sessions: Vec<Session<'_>> = prompts
            .iter()
            .map(|p| {
                let mut s = Session::new(m, 0);
                s.run(p, 4).unwrap();
                s
            })
            .chain([Session::new(m, 0)])
            .collect();
        let chunks: Vec<&[u32]> = vec![&[3], &[3], &[3], &new_prompt];
        let mut refs: Vec<&mut Session<'_>> = sessions.iter_mut().collect();
        let together: Vec<Vec<u32>> = Session::run_batch(&mut refs, &chunks, &[next; 4])
            .unwrap()
            .into_iter()
            .map(flat)
            .collect();
        let differ: Vec<usize> = (0..4).filter(|&i| together[i] != alone[i]).collect();
        assert!(
            differ.is_empty(),
            "{what}: sessions {differ:?} differ from their own forward"
        );
        for (i, s) in sessions.iter_mut().enumerate() {
            let next = s.run(&[5], 1).unwrap();
            let mut own = Session::new(m, 0);
            if i < 3 {
                own.run(&prompts[i], 4).unwrap();
                own.run(&[3], 1).unwrap();
            } else {
                own.run(&new_prompt, 64).unwrap();
            }
            let want = own.run(&[5], 1).unwrap();
            let same = next
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{what}: session {i}'s caches after the merged forward"
            );
        }
    }
}
