//! A tiny verifier's captured dataset and a drafter training config for it (shared by the
//! drafter-training tests).

use std::path::{Path, PathBuf};

use kakeya_capture::schema::ModelInfo;
use kakeya_capture::{CaptureConfig, Models, RunOptions};
use kakeya_models::GemmaModel;
use kakeya_models::testing::word_level_tokenizer_json;
use kakeya_train::DrafterTrainConfig;
use kakeya_weights::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The placeholder verifier hash of these tests.
pub const SHA: &str = "5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5ha5";

/// Captures `n` random-word prompts (words of `v`'s vocabulary) continued greedily by `v` (aux layers 1, 3, 4; f32).
pub fn capture(dir: &Path, v: &GemmaModel, n: usize, gen_len: usize, aux: &str) -> PathBuf {
    let vocab = v.config.vocab_size;
    std::fs::write(dir.join("tokenizer.json"), word_level_tokenizer_json(vocab)).unwrap();
    let tok = Tokenizer::load(&dir.join("tokenizer.json"), vocab).unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    let mut lines = String::new();
    for _ in 0..n {
        let len = rng.random_range(2..7);
        let words: Vec<String> = (0..len)
            .map(|_| format!("w{}", rng.random_range(5..vocab)))
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

pub fn train_config(dataset: &Path, run: &Path, steps: usize, vocab: usize) -> DrafterTrainConfig {
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
