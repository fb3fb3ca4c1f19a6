//! A tiny verifier's f_θ capture (drafter context K/V and per-layer attention tensors) and an
//! f_θ training config for it (shared by the f_θ training tests).

use std::path::{Path, PathBuf};

use kakeya_capture::schema::ModelInfo;
use kakeya_capture::{CaptureConfig, Models, RunOptions};
use kakeya_models::testing::{drafter_config, random_drafter, word_level_tokenizer_json};
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_train::TrainOptions;
use kakeya_train::ftheta::FThetaTrainConfig;
use kakeya_weights::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub const VSHA: &str = "7e57ed7e57ed7e57ed7e57ed7e57ed7e57ed7e57ed7e57ed7e57ed7e57ed7e57";
pub const DSHA: &str = "d4af7e4d4af7e4d4af7e4d4af7e4d4af7e4d4af7e4d4af7e4d4af7e4d4af7e4d";

/// Captures `n` random-word prompts (10–30 words) + 8 greedy tokens with `tensors` kept for
/// every verifier layer and, with `drafter`, the context K/V of [`tiny_drafter`].
pub fn capture(dir: &Path, v: &GemmaModel, n: usize, tensors: &str, drafter: bool) -> PathBuf {
    let vocab = v.config.vocab_size;
    std::fs::write(dir.join("tokenizer.json"), word_level_tokenizer_json(vocab)).unwrap();
    let tok = Tokenizer::load(&dir.join("tokenizer.json"), vocab).unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    let mut lines = String::new();
    for _ in 0..n {
        let len = rng.random_range(10..30);
        let words: Vec<String> = (0..len)
            .map(|_| format!("w{}", rng.random_range(5..97)))
            .collect();
        lines.push_str(&format!("{{\"text\": \"{}\"}}\n", words.join(" ")));
    }
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(&prompts, lines).unwrap();
    let out = dir.join(format!("ds-{}-{drafter}", tensors.len()));
    let cfg: CaptureConfig = toml::from_str(&format!(
        r#"
[model]
verifier = "tiny"
{}
[output]
dir = "{}"
dtype = "f32"
sequences_per_shard = 8
[generation]
gen_len = 8
max_prompt_tokens = 64
chunk = 64
[tensors]
verifier = [{tensors}]
verifier_layers = "all"
drafter_kv = {drafter}
[[sources]]
kind = "jsonl"
path = "{}"
"#,
        if drafter {
            "drafter = \"tiny-drafter\""
        } else {
            ""
        },
        out.display(),
        prompts.display()
    ))
    .unwrap();
    let d = tiny_drafter(v);
    let info = |s: &str| ModelInfo {
        path: "tiny".into(),
        sha256: s.into(),
    };
    let models = Models {
        verifier: v,
        tokenizer: &tok,
        drafter: drafter.then_some(&d),
        verifier_info: info(VSHA),
        tokenizer_info: info(VSHA),
        drafter_info: drafter.then(|| info(DSHA)),
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

/// The random 2-layer drafter (block 4) whose K/V [`capture`] records.
pub fn tiny_drafter(v: &GemmaModel) -> DFlashDrafter {
    DFlashDrafter::from_checkpoint(random_drafter(&drafter_config(&v.config, 2, 4), 2), v).unwrap()
}

pub const ALL: &str = r#""q_raw", "k_raw", "v_raw", "attn_out""#;

pub fn config(dataset: &Path, run: &Path, steps: usize, extra: &str) -> FThetaTrainConfig {
    FThetaTrainConfig::parse(
        Path::new("f-theta.toml"),
        &format!(
            r#"
[data]
dataset = "{}"
heldout_every = 5
[model]
verifier = "tiny"
drafter = "tiny-drafter"
rank = 32
[loss]
kind = "attn_distill_hybrid"
queries_per_sequence = 16
normalize_attention = true
[train]
steps = {steps}
sequences_per_step = 2
lr = 1e-2
warmup_steps = 5
seed = 3
{extra}
[output]
dir = "{}"
export = "{}"
checkpoint_every = 5
eval_every = 20
eval_queries = 16
"#,
            dataset.display(),
            run.display(),
            run.join("export").display()
        ),
    )
    .unwrap()
}

/// Fresh training on the test device (`KAKEYA_TEST_DEVICE`).
pub fn opts() -> TrainOptions {
    TrainOptions {
        resume: false,
        device: kakeya_models::testing::test_device(),
        stop_after: None,
    }
}
