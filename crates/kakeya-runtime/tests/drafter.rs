//! The DFlash drafter against z-lab's reference implementation, and its load-time checks.
//!
//! Fixture: `tests/fixtures/dflash/` (regenerate with `make_dflash.py --dflash-src <z-lab
//! checkout>`, transformers 4.57.1). Two draft steps share the context cache exactly as z-lab's
//! `dflash_generate` uses it (context appended, block cropped away).

use std::path::PathBuf;

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::testing::{drafter_config, random_checkpoint, random_drafter, tiny_config};
use kakeya_models::{DFlashDrafter, DraftContext, DraftRequest, GemmaModel, ModelError};
use kakeya_runtime::CompactStore;
use kakeya_weights::{DraftCheckpoint, HostTensor};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/dflash")
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// A tiny verifier (vocab 97, hidden 32) whose embedding is the fixture's.
fn verifier_with_embedding(embed: Vec<f32>) -> GemmaModel {
    let mut ck = random_checkpoint(&tiny_config(8), 3);
    ck.tensors.insert(
        "model.embed_tokens.weight".into(),
        HostTensor {
            shape: vec![97, 32],
            data: embed,
        },
    );
    GemmaModel::from_checkpoint(ck, &Device::flex()).unwrap()
}

#[test]
fn drafter_logits_match_zlab_reference() {
    let text = std::fs::read_to_string(fixture_dir().join("dflash.json")).unwrap();
    let fx: serde_json::Value = serde_json::from_str(&text).unwrap();
    let tol = fx["tolerance"].as_f64().unwrap() as f32;
    let verifier = verifier_with_embedding(floats(&fx["embed"]));
    let ck = DraftCheckpoint::load(&fixture_dir().join("tiny")).unwrap();
    let drafter = DFlashDrafter::from_checkpoint(ck, &verifier).unwrap();
    let device = Device::flex();
    let mut caches = CompactStore::new(drafter.context_width(), None, &device);
    for (i, step) in fx["steps"].as_array().unwrap().iter().enumerate() {
        let rows = step["context_rows"].as_u64().unwrap() as usize;
        let ctx = floats(&step["context"]);
        let width = ctx.len() / rows;
        let block: Vec<u32> = step["block"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let out = drafter
            .forward(
                &DraftRequest {
                    context: Some(Tensor::from_data(
                        TensorData::new(ctx, [rows, width]),
                        &device,
                    )),
                    block: &block,
                    capture_context: false,
                },
                &mut caches,
            )
            .unwrap();
        let [b, h] = out.hidden.dims();
        let logits = drafter
            .logits(out.hidden.slice([1..b, 0..h]))
            .into_data()
            .try_into_vec::<f32>()
            .unwrap();
        let want = floats(&step["logits"]);
        assert_eq!(logits.len(), want.len());
        let d = logits
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(d <= tol, "step {i}: max |Δlogit| {d} > {tol}");
        eprintln!("step {i}: max |Δlogit| = {d:.2e} (tolerance {tol})");
    }
    assert_eq!(caches.len(), 8, "context cache holds 5 + 3 positions");
}

fn tiny_verifier() -> GemmaModel {
    GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(8), 3), &Device::flex()).unwrap()
}

fn mismatch(ck: DraftCheckpoint, verifier: &GemmaModel) -> String {
    match DFlashDrafter::from_checkpoint(ck, verifier) {
        Err(e @ ModelError::Mismatch { .. }) => e.to_string(),
        Err(other) => panic!("expected a mismatch error, got {other}"),
        Ok(_) => panic!("a mismatched drafter was accepted"),
    }
}

#[test]
fn mismatched_drafters_are_refused_with_the_reason() {
    let v = tiny_verifier();
    let base = drafter_config(&v.config, 1, 4);

    let mut c = base.clone();
    c.hidden_size = 48;
    c.num_attention_heads = 4;
    let e = mismatch(random_drafter(&c, 1), &v);
    assert!(e.contains("hidden_size 48") && e.contains("32"), "{e}");

    let mut c = base.clone();
    c.vocab_size = 200;
    let e = mismatch(random_drafter(&c, 1), &v);
    assert!(e.contains("vocab_size 200"), "{e}");

    let mut c = base.clone();
    c.target_layer_ids = vec![1, 9];
    let e = mismatch(random_drafter(&c, 1), &v);
    assert!(e.contains("target layer 9"), "{e}");

    let mut c = base.clone();
    c.num_target_layers = 18;
    let e = mismatch(random_drafter(&c, 1), &v);
    assert!(e.contains("18-layer"), "{e}");
}

#[test]
fn reduced_vocabulary_drafts_map_back_to_verifier_ids() {
    let v = tiny_verifier();
    let mut c = drafter_config(&v.config, 2, 5);
    c.draft_vocab_size = Some(20);
    let ck = random_drafter(&c, 9);
    let map = ck.d2t.clone().unwrap();
    // The checkpoint round-trips through z-lab's folder layout with its token map.
    let dir = std::env::temp_dir().join(format!("kakeya-drafter-rt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    ck.write_dir(&dir).unwrap();
    let back = DraftCheckpoint::load(&dir).unwrap();
    assert_eq!(back.d2t.as_deref(), Some(&map[..]));
    assert_eq!(back.config, c);
    let drafter = DFlashDrafter::from_checkpoint(back, &v).unwrap();
    assert_eq!(drafter.draft_vocab(), 20);
    let mut caches = CompactStore::new(drafter.context_width(), None, &Device::flex());
    let ctx = Tensor::<2>::ones([3, c.target_layer_ids.len() * 32], &Device::flex());
    let out = drafter
        .forward(
            &DraftRequest {
                context: Some(ctx),
                block: &[10, 4, 4, 4, 4],
                capture_context: false,
            },
            &mut caches,
        )
        .unwrap();
    let drafts = drafter.draft_tokens(out.hidden);
    assert_eq!(drafts.len(), 4);
    assert!(
        drafts.iter().all(|t| map.contains(t)),
        "{drafts:?} not in {map:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
