//! Drafter training on a Gemma 4 verifier (transformers' tiny dense model of
//! tests/fixtures/gemma4: sliding and full layers of different widths, KV sharing, per-layer
//! inputs): captured from the verifier, trained, exported, and the export drafts for it —
//! speculative decoding equal to greedy decoding.

mod tiny_data;

use std::path::Path;

use burn::tensor::Device;
use kakeya_models::testing::Scratch;
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::{
    DFlashProposer, GenerationConfig, KvSetup, Session, SpecConfig, Verifier, generate,
    speculative_generate,
};
use kakeya_train::{TrainOptions, prepare, train_drafter};
use kakeya_weights::{Checkpoint, DraftCheckpoint};
use tiny_data::{SHA, capture, train_config};

#[test]
fn a_drafter_trains_on_a_gemma4_verifier_and_drafts_losslessly_for_it() {
    let s = Scratch::new("train-g4");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let ck = Checkpoint::load(root.join("tests/fixtures/gemma4/dense")).unwrap();
    let v = GemmaModel::from_checkpoint(ck, &Device::flex()).unwrap();
    // Target layers 1, 3 and 4 (4 reads layer 3's K/V).
    let ds = capture(&s.0, &v, 24, 16, "1, 3, 4");
    let cfg = train_config(&ds, &s.0.join("run"), 60, 0);
    let prep = prepare(&cfg, &v, SHA).unwrap();
    assert_eq!(
        prep.config.hidden_size, 64,
        "the drafter takes the verifier's width"
    );
    let opts = TrainOptions {
        resume: false,
        device: kakeya_models::testing::test_device(),
        stop_after: None,
    };
    let report = train_drafter(&cfg, &v, prep, &opts, &mut |_| {}).unwrap();
    let (first, last) = (&report.evals[0], report.evals.last().unwrap());
    assert!(
        last.loss < first.loss,
        "held-out loss {} -> {}",
        first.loss,
        last.loss
    );
    let d = DFlashDrafter::from_checkpoint(DraftCheckpoint::load(&cfg.output.export).unwrap(), &v)
        .unwrap();
    let greedy = GenerationConfig::greedy(24, 0);
    for i in 0..3u32 {
        let p: Vec<u32> = (0..4 + 3 * i)
            .map(|j| (j * 41 + i * 13 + 7) % 120)
            .collect();
        let want = generate(&mut Session::new(&v, 0), &p, &greedy, &mut |_| {})
            .unwrap()
            .tokens;
        let mut ver = Verifier::new(&v, KvSetup::full(0).drafter(&d), 4).unwrap();
        let got = speculative_generate(
            &mut ver,
            &mut DFlashProposer::new(&d),
            &p,
            &greedy,
            SpecConfig::fixed(4),
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(got.tokens, want, "prompt {i}");
    }
}
