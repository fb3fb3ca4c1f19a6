//! Weights larger than one buffer on the device, held in row blocks (`Linear::within`; the
//! 270M model's 640 MiB tied embedding against lavapipe's 128 MiB): the tiny Gemma 3 loaded
//! under a small `KAKEYA_GPU_MAX_BUFFER_BYTES` decodes, plainly and speculatively, as the same
//! model held whole, and a forward asking for more logits than one buffer holds is refused;
//! Gemma 4's per-layer embedding table, larger than one buffer, stays on the host.
//! Run by `scripts/test_wgpu.sh` (lavapipe), or with `--features cuda` and
//! `KAKEYA_TEST_DEVICE=cuda` on a GPU. One test: it sets the environment for its process.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

mod common;

use burn::tensor::Device;
use common::tiny_prompt;
use kakeya_models::testing::{drafter_config, random_checkpoint, random_drafter, tiny_config};
use kakeya_models::{DFlashDrafter, ForwardRequest, GemmaModel, Logits, ModelError};
use kakeya_runtime::{
    DFlashProposer, GenerationConfig, KvCache, KvSetup, Session, SpecConfig, Verifier, generate,
    speculative_generate,
};

fn gpu() -> Device {
    let d = kakeya_models::testing::test_device();
    assert!(
        kakeya_models::gpu::is_gpu(&d),
        "run with KAKEYA_TEST_DEVICE=wgpu (or cuda)"
    );
    d
}

/// Each row's logits, and the error of a forward asking for them, over `rows` tokens.
fn all_logits(m: &GemmaModel, rows: usize) -> Result<Vec<f32>, ModelError> {
    let mut caches = KvCache::for_specs(&m.cache_specs(), 0, kakeya_runtime::KvDtype::default());
    let toks = tiny_prompt(3, rows);
    let out = m.forward(&ForwardRequest::new(&toks, 0, Logits::All), &mut caches)?;
    Ok(out
        .logits
        .expect("asked for")
        .into_data()
        .try_into_vec::<f32>()
        .unwrap())
}

#[test]
#[allow(unsafe_code)] // setting the environment: this binary's only test, before any thread
fn a_vocabulary_in_row_blocks_decodes_as_the_whole_table() {
    let d = gpu();
    let config = tiny_config(8);
    let ck = random_checkpoint(&config, 11);
    let whole = GemmaModel::from_checkpoint(ck.clone(), &d).unwrap();
    assert!(whole.head.row_blocks().is_empty(), "the tiny head fits");
    let cfg = GenerationConfig::greedy(40, 7);
    let p = tiny_prompt(1, 12);
    let want = generate(&mut Session::new(&whole, 0), &p, &cfg, &mut |_| {})
        .unwrap()
        .tokens;
    let want_logits = all_logits(&whole, 10).unwrap();
    // Gemma 4 (the dense fixture: per-layer inputs, shared K/V layers), held whole.
    let whole4 = GemmaModel::from_checkpoint(gemma4_dense(), &d).unwrap();
    let want4 = generate(&mut Session::new(&whole4, 0), &p, &cfg, &mut |_| {})
        .unwrap()
        .tokens;
    let want4_logits = all_logits(&whole4, 6).unwrap();
    // The head is 97 × 32 f32 = 12 416 bytes. 8 192: the head alone in two blocks (every
    // layer weight is at most 64 × 32 f32 = 8 192 bytes); 4 096: nearly every weight in blocks.
    for (limit, head_blocks) in [(8192u64, 2usize), (4096, 4)] {
        // SAFETY: no other thread of this process reads the environment now.
        unsafe { std::env::set_var("KAKEYA_GPU_MAX_BUFFER_BYTES", limit.to_string()) };
        let m = GemmaModel::from_checkpoint(ck.clone(), &d).unwrap();
        assert_eq!(m.head.row_blocks().len(), head_blocks, "limit {limit}");
        assert_eq!(
            m.embed.device(),
            Device::flex(),
            "the whole table on the host"
        );
        // A few rows' logits. The head alone in blocks: the same bits (each output's sum runs
        // in the same order). Layer weights in blocks too: their products leave the joint
        // kernels (q/k/v and gate/up in one launch, the norms read from them) for Burn's
        // composed ops, so within f32 rounding (wgpu_device.rs's 1e-4).
        let got = all_logits(&m, 10).unwrap();
        let diff = got
            .iter()
            .zip(&want_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        eprintln!("limit {limit}: max |Δlogit| against the whole weights {diff:.2e}");
        if head_blocks == 2 {
            assert_eq!(diff, 0.0, "limit {limit}: the head alone in blocks");
        } else {
            assert!(diff <= 1e-4, "limit {limit}: {diff}");
        }
        // More rows' logits than one buffer holds: refused, not a failed allocation.
        let rows = (limit / (97 * 4)) as usize + 1;
        match all_logits(&m, rows) {
            Err(ModelError::Input(msg)) => assert!(msg.contains("more than one buffer"), "{msg}"),
            other => panic!("{rows} rows of logits under {limit} bytes: {other:?}"),
        }
        // Greedy decoding, its steps replayed from recordings over the blocks.
        let g = generate(&mut Session::new(&m, 0), &p, &cfg, &mut |_| {}).unwrap();
        assert_eq!(g.tokens, want, "limit {limit}: greedy decoding");
        let st = m.replay_stats();
        assert!(
            st.replayed > 0 || !m.replays_decode(),
            "limit {limit}: {st:?}"
        );
        // Speculative decoding with a reduced draft vocabulary (its head's rows picked from
        // the table on the host, then moved to the device).
        let mut dc = drafter_config(&config, 2, 4);
        dc.draft_vocab_size = Some(50);
        let drafter = DFlashDrafter::from_checkpoint(random_drafter(&dc, 5), &m).unwrap();
        let mut ver = Verifier::new(&m, KvSetup::full(0).drafter(&drafter), 4).unwrap();
        let s = speculative_generate(
            &mut ver,
            &mut DFlashProposer::new(&drafter),
            &p,
            &cfg,
            SpecConfig::fixed(4),
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(s.tokens, want, "limit {limit}: speculative decoding");
        eprintln!("limit {limit}: {head_blocks} head blocks, {st:?}");
    }
    // Still at 4 096 bytes: Gemma 4's per-layer embedding table (128 × 48 f32 here; 9 GB for
    // E2B) stays on the host, its rows looked up there, and the model decodes as held whole.
    let m4 = GemmaModel::from_checkpoint(gemma4_dense(), &d).unwrap();
    let table = &m4.per_layer.as_ref().expect("per-layer inputs").embed;
    assert_eq!(
        table.device(),
        Device::flex(),
        "the per-layer table on the host"
    );
    let diff = all_logits(&m4, 6)
        .unwrap()
        .iter()
        .zip(&want4_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("Gemma 4 under 4096 bytes: max |Δlogit| against the whole weights {diff:.2e}");
    assert!(diff <= 1e-4, "Gemma 4: {diff}");
    let g = generate(&mut Session::new(&m4, 0), &p, &cfg, &mut |_| {}).unwrap();
    assert_eq!(g.tokens, want4, "Gemma 4: greedy decoding");
    // SAFETY: as above.
    unsafe { std::env::remove_var("KAKEYA_GPU_MAX_BUFFER_BYTES") };
}

/// The dense Gemma 4 fixture (`tests/fixtures/gemma4/dense`).
fn gemma4_dense() -> kakeya_weights::Checkpoint {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gemma4");
    kakeya_weights::Checkpoint::load(root.join("dense")).unwrap()
}
