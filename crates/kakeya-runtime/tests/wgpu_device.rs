//! The tiny-model equivalences on the wgpu device (Vulkan, Metal, DX12 — run here on Mesa's
//! lavapipe, a Vulkan driver on the CPU, by `scripts/test_wgpu.sh`; built only with
//! `--features wgpu`): the tiny Gemma 3 (dense and quantised weights) against the CPU path, the
//! Gemma 4 fixtures against transformers, and speculative decoding against plain decoding on the
//! device, in the native caches and in the bounded KV modes (recorded forwards:
//! `wgpu_replay.rs`). A verify block's rows are bit for
//! bit the single decode steps they stand for: blocks of up to 16 rows take the GPU kernels
//! (`kakeya_models::gpu`), whose sums do not depend on the row count (Burn's matmuls, which
//! longer inputs take, are not batch-invariant).
//! Built with `--features cuda` instead and run with `KAKEYA_TEST_DEVICE=cuda`, the same checks
//! run on a CUDA GPU (scripts/device/).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

mod common;

use burn::tensor::{Device, Tensor};
use common::{gpu, host, max_diff, tiny_prompt};
use kakeya_models::testing::{
    drafter_config, random_checkpoint, random_drafter, random_quantized_checkpoint, tiny_config,
};
use kakeya_models::{DFlashDrafter, DraftContext, ForwardRequest, GemmaModel, Logits};
use kakeya_runtime::kv::{KvMode, KvPolicy};
use kakeya_runtime::{
    DFlashProposer, KvCache, KvSetup, Session, SpecConfig, Verifier, generate, speculative_generate,
};
use kakeya_weights::{Checkpoint, GemmaConfig};
use serde_json::Value;

/// Largest absolute logit difference allowed between the device and the CPU, or transformers
/// (f32 everywhere; the sums run in other orders).
const TOL: f32 = 1e-4;

fn rows(t: Tensor<2>) -> Vec<Vec<f32>> {
    let [n, v] = t.dims();
    let flat = t.into_data().try_into_vec::<f32>().unwrap();
    (0..n).map(|i| flat[i * v..(i + 1) * v].to_vec()).collect()
}

/// Logits of every position of `toks` from one forward.
fn forward_all(m: &GemmaModel, toks: &[u32]) -> Vec<Vec<f32>> {
    let mut caches = KvCache::for_specs(&m.cache_specs(), 0, kakeya_runtime::KvDtype::default());
    rows(
        m.forward(&ForwardRequest::new(toks, 0, Logits::All), &mut caches)
            .unwrap()
            .logits
            .unwrap(),
    )
}

fn tiny() -> GemmaConfig {
    tiny_config(8)
}

#[test]
fn tiny_gemma3_on_wgpu_matches_the_cpu() {
    for (what, ck) in [
        ("dense", random_checkpoint(&tiny(), 11) as Checkpoint),
        ("quantised", random_quantized_checkpoint(&tiny(), 11)),
    ] {
        let cpu = GemmaModel::from_checkpoint(ck.clone(), &Device::flex()).unwrap();
        let dev = GemmaModel::from_checkpoint(ck, &gpu()).unwrap();
        let p = tiny_prompt(1, 30);
        let d = max_diff(&forward_all(&dev, &p), &forward_all(&cpu, &p));
        eprintln!("{what}: full forward, max |Δlogit| wgpu vs CPU {d:.2e}");
        assert!(d <= TOL, "{what}: {d}");
        let cfg = kakeya_runtime::GenerationConfig::greedy(40, 7);
        let a = generate(&mut Session::new(&dev, 0), &p, &cfg, &mut |_| {}).unwrap();
        let b = generate(&mut Session::new(&cpu, 0), &p, &cfg, &mut |_| {}).unwrap();
        assert_eq!(a.tokens, b.tokens, "{what}: greedy decoding, wgpu vs CPU");
    }
}

#[test]
fn gemma4_fixtures_on_wgpu_match_transformers() {
    let root =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gemma4");
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("gemma4.json")).unwrap()).unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let prompt = ids(&r["prompt"]);
    for name in ["dense", "dense-kv", "moe"] {
        let want = &r["configs"][name];
        let m = GemmaModel::from_checkpoint(Checkpoint::load(root.join(name)).unwrap(), &gpu())
            .unwrap();
        let got = forward_all(&m, &prompt);
        let want_logits: Vec<Vec<f32>> = want["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| {
                w.as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect()
            })
            .collect();
        assert_eq!(got.len(), want_logits.len(), "{name}: one row per position");
        let worst = max_diff(&got, &want_logits);
        eprintln!("{name}: max |Δlogit| wgpu vs transformers {worst:.2e}");
        assert!(worst <= TOL, "{name}: {worst}");
        let n = want["greedy"].as_array().unwrap().len();
        let out = generate(
            &mut Session::new(&m, 0),
            &prompt,
            &kakeya_runtime::GenerationConfig::greedy(n, 5),
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(
            out.tokens,
            ids(&want["greedy"]),
            "{name}: greedy continuation"
        );
    }
}

/// How far a verify block's rows are from the single decode steps they stand for, on `m`'s
/// device: the largest |Δlogit| over blocks of 2, 4 and 8 rows after a 9-token prompt. Both
/// run as speculative decoding runs them: the prompt's forward fills a cache, then either one
/// forward per token or one forward of the block's rows over it.
fn block_drift(m: &GemmaModel) -> f32 {
    let prompt = tiny_prompt(2, 9);
    let block: Vec<u32> = (0..8u32).map(|j| (j * 29 + 11) % 90).collect();
    let prefilled = || {
        let mut caches =
            KvCache::for_specs(&m.cache_specs(), 0, kakeya_runtime::KvDtype::default());
        m.forward(&ForwardRequest::new(&prompt, 0, Logits::Last), &mut caches)
            .unwrap();
        caches
    };
    let logits = |toks: &[u32], start: usize, caches: &mut Vec<KvCache>| {
        rows(
            m.forward(&ForwardRequest::new(toks, start, Logits::All), caches)
                .unwrap()
                .logits
                .unwrap(),
        )
    };
    let mut worst: f32 = 0.0;
    for b in [2, 4, 8] {
        let mut caches = prefilled();
        let singles: Vec<Vec<f32>> = (0..b)
            .flat_map(|j| logits(&block[j..j + 1], prompt.len() + j, &mut caches))
            .collect();
        let rows = logits(&block[..b], prompt.len(), &mut prefilled());
        worst = worst.max(max_diff(&singles, &rows));
    }
    worst
}

#[test]
fn speculative_decoding_on_wgpu_equals_plain_decoding() {
    let v = GemmaModel::from_checkpoint(random_checkpoint(&tiny(), 11), &gpu()).unwrap();
    let drift = block_drift(&v);
    eprintln!("verify block rows vs single decode steps on the device: max |Δlogit| {drift:.2e}");
    assert_eq!(
        drift, 0.0,
        "a verify block's rows must be the decode steps' bits"
    );
    for block in [4, 8] {
        let d = DFlashDrafter::from_checkpoint(
            random_drafter(&drafter_config(&v.config, 2, block), 5),
            &v,
        )
        .unwrap();
        for i in 0..2 {
            let p = tiny_prompt(i, 20 + 15 * i);
            let cfg = kakeya_runtime::GenerationConfig::greedy(40, 16);
            // Plain decoding issued kernel by kernel; the verify blocks below are replayed.
            let mut plain = v.clone();
            plain.record_decode = false;
            let want = generate(&mut Session::new(&plain, 0), &p, &cfg, &mut |_| {}).unwrap();
            // Speculative decoding on `model`: its tokens and the drafter's store rows.
            let speculate = |model: &GemmaModel| {
                let mut ver = Verifier::new(model, KvSetup::full(0).drafter(&d), block).unwrap();
                let g = speculative_generate(
                    &mut ver,
                    &mut DFlashProposer::new(&d),
                    &p,
                    &cfg,
                    SpecConfig::fixed(block),
                    &mut |_| {},
                )
                .unwrap();
                let store = ver.store_mut().unwrap().expect("the drafter's store");
                let (k, v) = store.read(0..store.len()).unwrap();
                (g.tokens, host(k), host(v))
            };
            let replays_before = v.replay_stats().replayed;
            let got = speculate(&v);
            assert_eq!(got.0, want.tokens, "block {block}, prompt {i}");
            let st = v.replay_stats();
            eprintln!("block {block}, prompt {i}: forwards so far {st:?}");
            assert!(
                st.replayed > replays_before,
                "verify blocks replayed: {st:?}"
            );
            // The replayed blocks' hidden states fed the drafter's store as the issued
            // blocks' do: the same rows, bit for bit.
            let issued = speculate(&plain);
            assert_eq!(issued.0, want.tokens);
            assert!(
                got.1 == issued.1 && got.2 == issued.2,
                "store rows, replayed vs issued"
            );
        }
    }
}

#[test]
fn bounded_kv_modes_on_wgpu_decode_speculatively_as_plainly() {
    let v = GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(24), 11), &gpu()).unwrap();
    let d = DFlashDrafter::from_checkpoint(random_drafter(&drafter_config(&v.config, 2, 4), 5), &v)
        .unwrap();
    let r = common::random_f_theta_restorer(&v, &d);
    for mode in KvMode::all() {
        let s = KvSetup::new(KvPolicy {
            mode,
            sink: 2,
            window: 8,
            ..KvPolicy::new(mode)
        })
        .drafter(&d)
        .restorer(&r);
        let p = tiny_prompt(0, 40);
        let cfg = kakeya_runtime::GenerationConfig::greedy(30, 16);
        let want = generate(&mut Session::with_kv(&v, s).unwrap(), &p, &cfg, &mut |_| {}).unwrap();
        let mut ver = Verifier::new(&v, s, 4).unwrap();
        let got = speculative_generate(
            &mut ver,
            &mut DFlashProposer::new(&d),
            &p,
            &cfg,
            SpecConfig::fixed(4),
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(got.tokens, want.tokens, "{mode}");
    }
}

/// Sequences decoded together in stacked forwards (each chunk written and attended in place in
/// its own cache, `gpu::span_attention`; the steps recorded once and replayed) give each
/// sequence's tokens alone (issued kernel by kernel), with prompts of different lengths and
/// the sliding layers' rings wrapping (window 8, two KV heads).
#[test]
fn batched_decoding_on_wgpu_equals_each_sequence_alone() {
    let m = GemmaModel::from_checkpoint(random_checkpoint(&tiny(), 11), &gpu()).unwrap();
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| tiny_prompt(i, 5 + 3 * i)).collect();
    let prompts: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let cfg = kakeya_runtime::GenerationConfig::greedy(20, 512);
    let mut sessions: Vec<Session> = (0..prompts.len()).map(|_| Session::new(&m, 0)).collect();
    let together = kakeya_runtime::generate_batch(&mut sessions, &prompts, &cfg).unwrap();
    // The batched steps of one set of sequences: recorded once, then replayed.
    let st = m.replay_stats();
    eprintln!("batched steps: {st:?}");
    assert!(st.recorded >= 1 && st.replayed >= 15, "{st:?}");
    // Each sequence alone, issued kernel by kernel.
    let mut plain = m.clone();
    plain.record_decode = false;
    for (i, (p, g)) in prompts.iter().zip(&together).enumerate() {
        let alone = generate(&mut Session::new(&plain, 0), p, &cfg, &mut |_| {}).unwrap();
        assert_eq!(g.tokens, alone.tokens, "sequence {i}");
    }
}

/// Greedy decode steps recorded once and replayed give the tokens of the steps issued kernel
/// by kernel: a key recorded at its second sighting, one recording per cache layout (the
/// full caches doubling past 64 slots; the sliding layers' rings of window 8 are full after
/// the prompt), every other step a replay that reads its token and position from the
/// recorded buffer.
/// The drafter's compact store on the device (f32 on a GPU: rows appended and read there)
/// holds what the host's store holds: appends across its growth by doubling, rollbacks, reads
/// of any range, and a fork (a prefix-cache copy) that appends without changing the original.
#[test]
fn the_compact_store_on_the_device_holds_what_the_hosts_holds() {
    use kakeya_models::{DraftContext, KvPart};
    use kakeya_runtime::CompactStore;
    let (w, d) = (24, gpu());
    let mut dev = CompactStore::new(w, None, &d);
    let mut cpu = CompactStore::new(w, None, &Device::flex());
    let rows = |n: usize, seed: usize, device: &Device| {
        let vals: Vec<f32> = (0..n * w)
            .map(|i| ((i * 7 + seed * 131) % 97) as f32 / 13.0 - 3.0)
            .collect();
        Tensor::<2>::from_data(burn::tensor::TensorData::new(vals, [n, w]), device)
    };
    let append = |s: &mut CompactStore, n: usize, seed: usize, device: &Device| {
        s.append(rows(n, seed, device), rows(n, seed + 1, device))
            .unwrap()
    };
    let same = |a: &CompactStore, b: &CompactStore, what: &str| {
        assert_eq!(a.len(), b.len(), "{what}: length");
        for r in [0..a.len(), 0..1.min(a.len()), a.len() / 3..a.len()] {
            let ((ak, av), (bk, bv)) = (a.read(r.clone()).unwrap(), b.read(r.clone()).unwrap());
            assert_eq!(host(ak), host(bk), "{what}: K {r:?}");
            assert_eq!(host(av), host(bv), "{what}: V {r:?}");
            let part = a.read_part(r.clone(), KvPart::V).unwrap();
            assert_eq!(host(part), host(b.read_part(r.clone(), KvPart::V).unwrap()));
        }
    };
    for (step, n) in [3usize, 70, 1, 100, 5].into_iter().enumerate() {
        append(&mut dev, n, step, &d);
        append(&mut cpu, n, step, &Device::flex());
        same(&dev, &cpu, &format!("after appending {n}"));
        if step == 2 {
            dev.truncate(50);
            cpu.truncate(50);
            same(&dev, &cpu, "rolled back to 50");
        }
    }
    // 50 + 100 + 5 rows: the buffers grew to 256 rows each.
    assert_eq!(dev.len(), 155);
    assert_eq!(
        dev.nbytes(),
        2 * 256 * w * 4,
        "bytes held: both buffers as allocated"
    );
    let (mut fork, before) = (dev.clone(), host(dev.read(0..dev.len()).unwrap().0));
    fork.truncate(10);
    append(&mut fork, 30, 9, &d);
    assert_eq!(
        host(dev.read(0..dev.len()).unwrap().0),
        before,
        "the original after a fork's write"
    );
    let mut cpu_fork = cpu.clone();
    cpu_fork.truncate(10);
    append(&mut cpu_fork, 30, 9, &Device::flex());
    same(&fork, &cpu_fork, "the fork");
    // Rows written in place (a recorded append: `gpu::put_rows` from the length) into a fork
    // that still shares the original's buffers: the fork's own copies, the original unchanged.
    let mut fork = dev.clone();
    fork.truncate(20);
    let (k, v) = fork.reserve_on_device(7).expect("a device store");
    let at = Tensor::<1>::from_data(burn::tensor::TensorData::new(vec![20.0f32], [1]), &d);
    kakeya_models::gpu::put_rows(&k, &rows(7, 4, &d), &at, 0).unwrap();
    kakeya_models::gpu::put_rows(&v, &rows(7, 5, &d), &at, 0).unwrap();
    drop((k, v));
    fork.written_in_place(7).unwrap();
    assert!(
        host(dev.read(0..dev.len()).unwrap().0) == before,
        "the original after a fork's write in place"
    );
    let mut cpu_fork = cpu.clone();
    cpu_fork.truncate(20);
    append(&mut cpu_fork, 7, 4, &Device::flex());
    same(&fork, &cpu_fork, "the fork written in place");
    assert!(
        fork.written_in_place(1000).is_err(),
        "past the reserved rows"
    );
}
