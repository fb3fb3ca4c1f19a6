//! Drafter training on a tiny random verifier: the training forward is the runtime drafter's
//! math, the drafter learns the verifier's continuations (held-out acceptance rises well
//! above 1), only drafter weights move, resuming is bit-for-bit, bad datasets are refused
//! before training.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_capture::schema::ModelInfo;
use kakeya_capture::{CaptureConfig, Models, RunOptions};
use kakeya_models::testing::Scratch;
use kakeya_models::testing::{random_checkpoint, tiny_config, word_level_tokenizer_json};
use kakeya_models::{CacheSpec, DFlashDrafter, DraftRequest, Gemma3Model};
use kakeya_runtime::KvCache;
use kakeya_train::data::{self, Sequence};
use kakeya_train::drafter::{Batch, DrafterParams, Frozen, greedy};
use kakeya_train::{DrafterTrainConfig, TrainError, TrainOptions, prepare, train_drafter};
use kakeya_weights::{DraftCheckpoint, Tokenizer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const SHA: &str = "5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5";

fn verifier() -> Gemma3Model {
    Gemma3Model::from_checkpoint(random_checkpoint(&tiny_config(64), 11), &Device::flex()).unwrap()
}

/// Captures `n` random-word prompts continued greedily by `v` (aux layers 1, 3, 4; f32).
fn capture(dir: &Path, v: &Gemma3Model, n: usize, gen_len: usize, aux: &str) -> PathBuf {
    std::fs::write(dir.join("tokenizer.json"), word_level_tokenizer_json(97)).unwrap();
    let tok = Tokenizer::load(&dir.join("tokenizer.json"), 97).unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    let mut lines = String::new();
    for _ in 0..n {
        let len = rng.random_range(2..7);
        let words: Vec<String> = (0..len)
            .map(|_| format!("w{}", rng.random_range(5..97)))
            .collect();
        lines.push_str(&format!("{{\"text\": \"{}\"}}\n", words.join(" ")));
    }
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(&prompts, lines).unwrap();
    let out = dir.join(format!("ds-{}", aux.replace([',', ' '], "")));
    let cfg: CaptureConfig = toml::from_str(&format!(
        r#"
[model]
verifier = "tiny"
[output]
dir = "{}"
dtype = "f32"
sequences_per_shard = 16
[generation]
gen_len = {gen_len}
max_prompt_tokens = 64
chunk = 64
[tensors]
verifier = []
aux_layers = [{aux}]
[[sources]]
kind = "jsonl"
path = "{}"
"#,
        out.display(),
        prompts.display()
    ))
    .unwrap();
    let info = |s: &str| ModelInfo {
        path: "tiny".into(),
        sha256: s.into(),
    };
    let models = Models {
        verifier: v,
        tokenizer: &tok,
        drafter: None,
        verifier_info: info(SHA),
        tokenizer_info: info(SHA),
        drafter_info: None,
    };
    kakeya_capture::run(
        &cfg,
        Path::new("capture.toml"),
        &models,
        RunOptions {
            shard: (0, 1),
            resume: false,
        },
        &mut |_| {},
    )
    .unwrap();
    out
}

fn train_config(dataset: &Path, run: &Path, steps: usize, vocab: usize) -> DrafterTrainConfig {
    DrafterTrainConfig::parse(
        Path::new("train.toml"),
        &format!(
            r#"
[data]
dataset = "{}"
heldout_every = 5
[model]
verifier = "tiny"
layers = 1
heads = 4
kv_heads = 2
head_dim = 8
intermediate = 64
block_size = 4
target_layers = [1, 3, 4]
draft_vocab = {vocab}
mask_token = 4
[train]
steps = {steps}
sequences_per_step = 4
anchors_per_sequence = 8
lr = 3e-3
min_lr = 3e-4
warmup_steps = 10
weight_decay = 0.01
grad_clip = 1.0
gamma = 4.0
seed = 3
[output]
dir = "{}"
export = "{}"
checkpoint_every = 4
eval_every = 20
eval_anchors = 200
"#,
            dataset.display(),
            run.display(),
            run.join("drafter").display()
        ),
    )
    .unwrap()
}

fn opts() -> TrainOptions {
    TrainOptions {
        resume: false,
        device: Device::flex(),
        stop_after: None,
    }
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_into_vec::<f32>().unwrap()
}

#[test]
fn training_forward_equals_the_runtime_drafter_block_by_block() {
    let s = Scratch::new("train-fwd");
    let v = verifier();
    let ds = capture(&s.0, &v, 6, 10, "1, 3, 4");
    let cfg = train_config(&ds, &s.0.join("run"), 1, 40);
    let prep = prepare(&cfg, &v, SHA).unwrap();
    let d2t = prep.d2t.clone().unwrap();
    let mut params = DrafterParams::init(prep.config.clone(), 9, &Device::flex());
    // Norm multipliers away from 1 so that a swapped norm cannot pass.
    let mut rng = StdRng::seed_from_u64(1);
    for (_, shape, t) in &mut params.tensors {
        if shape.len() == 1 {
            let n = shape[0];
            let d: Vec<f32> = (0..n).map(|_| rng.random_range(0.5..1.5)).collect();
            *t = Tensor::from_data(TensorData::new(d, [1, n]), &Device::flex());
        }
    }
    let frozen = Frozen::new(v.embed.clone(), v.config.hidden_size, Some(&d2t));
    let seqs: Vec<&Sequence> = prep.data.train.iter().take(2).collect();
    let picks: Vec<(&Sequence, Vec<usize>)> = seqs
        .iter()
        .map(|s| {
            let r = s.anchor_range();
            (*s, vec![r.start, (r.start + r.end) / 2, r.end - 1])
        })
        .collect();
    let batch = Batch::build(prep.data.width, 4, &picks);
    let weights: Vec<Tensor<2>> = params.tensors.iter().map(|(_, _, t)| t.clone()).collect();
    let got = host(params.forward(&weights, &frozen, &batch).0);
    // The runtime drafter takes raw aux states; training saw them divided per channel.
    let scales = prep.data.scales.clone();
    assert!(
        scales.iter().any(|&s| (s - 1.0).abs() > 0.1),
        "scales are not trivial"
    );
    let ck = params.to_checkpoint(Some(d2t.clone()), &scales);
    let drafter = DFlashDrafter::from_checkpoint(ck, &v).unwrap();
    let vd = d2t.len();
    let mut block_index = 0;
    let mut worst = 0f32;
    for (s, anchors) in &picks {
        for &a in anchors {
            let width = prep.data.width;
            let raw: Vec<f32> = s.aux[..a * width]
                .iter()
                .enumerate()
                .map(|(i, v)| v * scales[i % width])
                .collect();
            let ctx = Tensor::<2>::from_data(TensorData::new(raw, [a, width]), &Device::flex());
            let block = [s.tokens[a], 4, 4, 4];
            let mut caches = KvCache::for_specs(&[CacheSpec::Full; 1], 0);
            let out = drafter
                .forward(
                    &DraftRequest {
                        context: ctx,
                        block: &block,
                        capture_context: false,
                    },
                    &mut caches,
                )
                .unwrap();
            let want = host(drafter.logits(out.hidden.slice([1..4, 0..32])));
            let got_b = &got[block_index * 3 * vd..(block_index + 1) * 3 * vd];
            for (x, y) in got_b.iter().zip(&want) {
                worst = worst.max((x - y).abs());
            }
            block_index += 1;
        }
    }
    assert!(worst < 1e-4, "training vs runtime logits differ by {worst}");
}

#[test]
fn drafter_learns_the_verifiers_continuations_and_only_drafter_weights_move() {
    let s = Scratch::new("train-learn");
    let v = verifier();
    let embed_before = host(v.embed.clone());
    let ds = capture(&s.0, &v, 60, 24, "1, 3, 4");
    let cfg = train_config(&ds, &s.0.join("run"), 400, 0);
    let prep = prepare(&cfg, &v, SHA).unwrap();
    let names: Vec<String> = prep
        .config
        .expected_tensors()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let report = train_drafter(&cfg, &v, prep, &opts(), &mut |_| {}).unwrap();
    let first = &report.evals[0];
    let last = report.evals.last().unwrap();
    eprintln!(
        "held-out acceptance {:.3} -> {:.3}, loss {:.3} -> {:.3}",
        first.acceptance_length, last.acceptance_length, first.loss, last.loss
    );
    assert!(last.acceptance_length >= 2.0, "{last:?}");
    assert!(last.acceptance_length > first.acceptance_length + 0.7);
    assert!(last.loss < first.loss * 0.5);
    // The verifier's embedding (= its tied head) is untouched.
    assert_eq!(host(v.embed.clone()), embed_before);
    // The exported drafter holds only drafter tensors, and each of them moved from its init.
    let ck = DraftCheckpoint::load(&cfg.output.export).unwrap();
    let mut exported: Vec<&String> = ck.tensors.keys().collect();
    exported.sort();
    let mut expected: Vec<&String> = names.iter().collect();
    expected.sort();
    assert_eq!(exported, expected);
    let init = DrafterParams::init(ck.config.clone(), cfg.train.seed, &Device::flex());
    let init = init.to_checkpoint(None, &report_scales(&s.0.join("run/report.json")));
    for (name, t0) in init.tensors {
        let before = t0.data;
        let after = &ck.tensors[&name].data;
        let moved = before
            .iter()
            .zip(after)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(moved > 1e-4, "{name} did not train (max change {moved})");
    }
    // Greedy drafts through the runtime drafter agree with the held-out metric's direction.
    assert!(s.0.join("run/report.json").is_file() && s.0.join("run/curves.png").is_file());
}

/// The input scales a run folded into its exported `fc` (from its report).
fn report_scales(path: &Path) -> Vec<f32> {
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    r["input_scales"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn resuming_after_an_interruption_is_bit_for_bit() {
    let s = Scratch::new("train-resume");
    let v = verifier();
    let ds = capture(&s.0, &v, 12, 12, "1, 3, 4");
    let straight = train_config(&ds, &s.0.join("a"), 10, 30);
    train_drafter(
        &straight,
        &v,
        prepare(&straight, &v, SHA).unwrap(),
        &opts(),
        &mut |_| {},
    )
    .unwrap();
    let split = train_config(&ds, &s.0.join("b"), 10, 30);
    let stop = TrainOptions {
        stop_after: Some(5),
        ..opts()
    };
    let e = train_drafter(
        &split,
        &v,
        prepare(&split, &v, SHA).unwrap(),
        &stop,
        &mut |_| {},
    )
    .unwrap_err();
    assert!(matches!(e, TrainError::Interrupted(5)), "{e}");
    assert!(!split.output.export.exists());
    // Without --resume an existing state is refused.
    let e = train_drafter(
        &split,
        &v,
        prepare(&split, &v, SHA).unwrap(),
        &opts(),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("--resume"), "{e}");
    let resume = TrainOptions {
        resume: true,
        ..opts()
    };
    let mut first_step = None;
    train_drafter(
        &split,
        &v,
        prepare(&split, &v, SHA).unwrap(),
        &resume,
        &mut |ev| {
            if let kakeya_train::Event::Started { start, .. } = ev {
                first_step = Some(start);
            }
        },
    )
    .unwrap();
    assert_eq!(first_step, Some(5));
    let a = DraftCheckpoint::load(&straight.output.export).unwrap();
    let b = DraftCheckpoint::load(&split.output.export).unwrap();
    assert_eq!(a.d2t, b.d2t);
    for (name, t) in &a.tensors {
        assert_eq!(t.data, b.tensors[name].data, "{name} differs after resume");
    }
}

#[test]
fn datasets_without_the_aux_columns_or_from_another_verifier_are_refused() {
    let s = Scratch::new("train-bad");
    let v = verifier();
    let ds = capture(&s.0, &v, 4, 6, "1, 3");
    let cfg = train_config(&ds, &s.0.join("run"), 5, 0);
    let e = prepare(&cfg, &v, SHA).err().unwrap().to_string();
    assert!(
        e.contains(&ds.display().to_string()) && e.contains("[4]"),
        "{e}"
    );
    let mut cfg2 = cfg.clone();
    cfg2.model.target_layers = Some(vec![1, 3]);
    let e = prepare(&cfg2, &v, &"0".repeat(64))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("recapture with this verifier"), "{e}");
    assert!(!s.0.join("run").exists());
}

#[test]
fn draft_vocab_is_built_from_the_training_continuations() {
    let s = Scratch::new("train-vocab");
    let v = verifier();
    let ds = capture(&s.0, &v, 10, 8, "1, 3, 4");
    let cfg = train_config(&ds, &s.0.join("run"), 1, 20);
    let prep = prepare(&cfg, &v, SHA).unwrap();
    let d2t = prep.d2t.unwrap();
    assert_eq!(d2t.len(), 20);
    assert!(d2t.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(d2t, data::draft_vocab(&prep.data.train, 20, 97));
    let _ = greedy;
}
