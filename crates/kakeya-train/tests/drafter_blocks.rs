//! Drafter training where the verifier's vocabulary is larger than one buffer on the device
//! (the 270M model's 640 MiB tied embedding against lavapipe's 128 MiB; here the tiny
//! verifier under a small `KAKEYA_GPU_MAX_BUFFER_BYTES`): the table stays on the host, the
//! whole-vocabulary head is held in row blocks on the device (a reduced one whole), and
//! training gives the losses and held-out figures of the run with everything on the device.
//! A drafter larger than the device allocates stops training with a clear error, not a panic.
//! Run by `scripts/test_wgpu.sh` (lavapipe), or with `--features cuda` and
//! `KAKEYA_TEST_DEVICE=cuda` on a GPU, one test at a time (`--test-threads 1`): the first sets
//! the environment for its process, the second makes the device fail.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

mod tiny_data;

use burn::tensor::Device;
use kakeya_models::GemmaModel;
use kakeya_models::dflash::DraftHead;
use kakeya_models::testing::{Scratch, random_checkpoint, tiny_config};
use kakeya_train::drafter::Frozen;
use kakeya_train::{TrainError, TrainOptions, prepare, train_drafter};
use tiny_data::{SHA, capture, train_config};

/// Per-step losses and the held-out evaluations (loss, acceptance length) of a short run.
fn run(dir: &std::path::Path, v: &GemmaModel, ds: &std::path::Path, vocab: usize) -> Vec<f64> {
    let cfg = train_config(ds, dir, 12, vocab);
    let prep = prepare(&cfg, v, SHA).unwrap();
    let opts = TrainOptions {
        resume: false,
        device: kakeya_models::testing::test_device(),
        stop_after: None,
    };
    let report = train_drafter(&cfg, v, prep, &opts, &mut |_| {}).unwrap();
    let mut out: Vec<f64> = report.steps.iter().map(|s| s.loss).collect();
    for e in &report.evals {
        out.extend([e.loss, e.acceptance_length]);
    }
    out
}

#[test]
#[allow(unsafe_code)] // setting the environment: this binary's only test, before any thread
fn a_vocabulary_larger_than_one_buffer_trains_as_the_whole_table() {
    let gpu = kakeya_models::testing::test_device();
    assert!(
        kakeya_models::gpu::is_gpu(&gpu),
        "run with KAKEYA_TEST_DEVICE=wgpu (or cuda)"
    );
    let s = Scratch::new("drafter-blocks");
    // The verifier on the CPU that captured; the drafter trains on the GPU.
    let v = GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(64), 11), &Device::flex())
        .unwrap();
    let ds = capture(&s.0, &v, 30, 16, "1, 3, 4");
    // The whole vocabulary (0) and a reduced one (40 tokens), each with the table whole on
    // the device, then under a limit of 8 192 bytes (the table is 97 × 32 f32 = 12 416).
    let whole: Vec<Vec<f64>> = [0, 40]
        .iter()
        .map(|&vocab| run(&s.0.join(format!("whole-{vocab}")), &v, &ds, vocab))
        .collect();
    // SAFETY: no other thread of this process reads the environment now.
    unsafe { std::env::set_var("KAKEYA_GPU_MAX_BUFFER_BYTES", "8192") };
    // Where each part lives under the limit.
    let d2t: Vec<u32> = (0..40).collect();
    for reduce in [None, Some(&d2t[..])] {
        let f = Frozen::new(v.embed.clone(), 32, reduce, &gpu);
        assert_eq!(
            f.embed.device(),
            Device::flex(),
            "the table stays on the host"
        );
        match &f.head {
            DraftHead::Verifier(h) => {
                assert_eq!(h.row_blocks().len(), 2, "the whole head in two blocks");
                assert!(h.row_blocks().iter().all(|b| b.device() == gpu));
            }
            DraftHead::Reduced { head, .. } => {
                assert!(head.row_blocks().is_empty(), "40 rows fit one buffer");
                assert_eq!(head.device(), gpu);
            }
        }
    }
    for (vocab, want) in [0, 40].iter().zip(&whole) {
        let got = run(&s.0.join(format!("blocks-{vocab}")), &v, &ds, *vocab);
        assert_eq!(got.len(), want.len());
        let err = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
            .fold(0.0, f64::max);
        eprintln!(
            "draft vocabulary {vocab}: max rel |Δ| {err:e} over {} figures",
            got.len()
        );
        assert!(err <= 1e-4, "vocabulary {vocab}: {got:?} against {want:?}");
    }
    // SAFETY: as above.
    unsafe { std::env::remove_var("KAKEYA_GPU_MAX_BUFFER_BYTES") };
}

/// A drafter whose MLP weight is one row larger than the device's largest buffer (on
/// lavapipe 128 MiB: 1 048 577 × 32 f32): the device cannot allocate it, and training stops
/// with `TrainError::Device` naming the failure, where the first read-back panicked before;
/// nothing is exported. (On a GPU whose buffers hold gigabytes the weight would not fail, so
/// there the test says so and stops.)
#[test]
fn training_a_drafter_larger_than_the_device_allocates_is_an_error_not_a_panic() {
    let gpu = kakeya_models::testing::test_device();
    let Some(max) = kakeya_models::gpu::max_buffer_bytes(&gpu) else {
        panic!("run with KAKEYA_TEST_DEVICE=wgpu (or cuda)");
    };
    if max > 1 << 30 {
        eprintln!("buffers of {max} bytes: a drafter that large does not fit this host either");
        return;
    }
    let s = Scratch::new("drafter-too-large");
    let v = GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(64), 11), &Device::flex())
        .unwrap();
    let ds = capture(&s.0, &v, 10, 8, "1, 3, 4");
    let mut cfg = train_config(&ds, &s.0.join("run"), 2, 40);
    cfg.model.intermediate = (max / (32 * 4)) as usize + 1;
    let prep = prepare(&cfg, &v, SHA).unwrap();
    let opts = TrainOptions {
        resume: false,
        device: gpu,
        stop_after: None,
    };
    match train_drafter(&cfg, &v, prep, &opts, &mut |_| {}) {
        Err(TrainError::Device(msg)) => {
            eprintln!("the device's error: {msg}");
            assert!(!msg.is_empty());
        }
        Err(e) => panic!("another error: {e}"),
        Ok(r) => panic!(
            "trained {} parameters past the device's limit",
            r.parameters
        ),
    }
    assert!(!cfg.output.export.exists(), "nothing exported");
}
