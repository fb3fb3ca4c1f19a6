//! `kakeya train drafter` end to end on a tiny model: capture → train → the exported drafter
//! loads in `kakeya infer --drafter` and decodes exactly as AR; a dataset without the needed
//! aux columns, or captured with another verifier, is refused before training starts.

use std::path::{Path, PathBuf};

mod common;

use common::{fails, run_ok};
use kakeya_models::testing::Scratch;

/// A tiny model folder (random weights, `seed`) with a word-level tokenizer.
fn model(dir: &Path, name: &str, seed: u64) -> PathBuf {
    common::tiny_model_dir(dir, name, 64, seed)
}

/// Captures tokens + aux layers 1 and 3 of 16 short prompts with `m`.
fn capture(dir: &Path, m: &Path) -> PathBuf {
    let prompts = dir.join("prompts.jsonl");
    let lines: Vec<String> = (0..16)
        .map(|i| {
            let words: Vec<String> = (0..3 + i % 4)
                .map(|j| format!("w{}", 5 + (i * 13 + j * 7) % 90))
                .collect();
            serde_json::json!({"text": words.join(" ")}).to_string()
        })
        .collect();
    std::fs::write(&prompts, lines.join("\n") + "\n").unwrap();
    let out = dir.join("ds");
    let cfg = dir.join("capture.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"[model]
verifier = "{}"
[output]
dir = "{}"
dtype = "f32"
sequences_per_shard = 8
[generation]
gen_len = 16
max_prompt_tokens = 64
chunk = 64
[tensors]
verifier = []
aux_layers = [1, 3]
[[sources]]
kind = "jsonl"
path = "{}"
"#,
            m.display(),
            out.display(),
            prompts.display()
        ),
    )
    .unwrap();
    run_ok(&["capture", "--config", cfg.to_str().unwrap()]);
    out
}

fn train_config(dir: &Path, verifier: &Path, ds: &Path, targets: &str) -> PathBuf {
    let p = dir.join(format!("train-{}.toml", targets.replace([',', ' '], "")));
    std::fs::write(
        &p,
        format!(
            r#"[data]
dataset = "{}"
heldout_every = 4
[model]
verifier = "{}"
layers = 1
heads = 4
kv_heads = 2
head_dim = 8
intermediate = 64
block_size = 4
target_layers = [{targets}]
draft_vocab = 48
mask_token = 4
[train]
steps = 30
sequences_per_step = 4
anchors_per_sequence = 8
lr = 3e-3
warmup_steps = 5
gamma = 4.0
[output]
dir = "{}"
export = "{}"
export_dtype = "f16"
checkpoint_every = 10
eval_every = 10
"#,
            ds.display(),
            verifier.display(),
            dir.join("run").display(),
            dir.join("run/drafter").display()
        ),
    )
    .unwrap();
    p
}

#[test]
fn trained_drafter_exports_and_decodes_losslessly_in_infer() {
    let s = Scratch::new("traincli-ok");
    let m = model(&s.0, "tiny", 3);
    let ds = capture(&s.0, &m);
    let cfg = train_config(&s.0, &m, &ds, "1, 3");
    run_ok(&["train", "drafter", "--config", cfg.to_str().unwrap()]);
    let run = s.0.join("run");
    for f in [
        "report.json",
        "curves.png",
        "drafter/config.json",
        "drafter/model.safetensors",
    ] {
        assert!(run.join(f).is_file(), "{f} missing");
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["evals"].as_array().unwrap().len(), 4); // before training + 3
    let out = run_ok(&[
        "infer",
        "--model",
        m.to_str().unwrap(),
        "--drafter",
        run.join("drafter").to_str().unwrap(),
        "--prompt",
        "w7 w8 w9",
        "--max-tokens",
        "20",
        "--compare-ar",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["stats"]["identical_to_ar"], true, "{v}");

    // The pipeline goes on: capture with the trained drafter's K/V, then train f_θ.
    let drafter = run.join("drafter");
    let fds = s.0.join("fds");
    let cap = s.0.join("capture-f.toml");
    std::fs::write(
        &cap,
        format!(
            r#"[model]
verifier = "{}"
drafter = "{}"
[output]
dir = "{}"
dtype = "f16"
sequences_per_shard = 4
[generation]
gen_len = 8
max_prompt_tokens = 64
chunk = 64
[tensors]
verifier = ["q_raw", "k_raw", "v_raw", "attn_out"]
verifier_layers = "all"
drafter_kv = true
[[sources]]
kind = "jsonl"
path = "{}"
"#,
            m.display(),
            drafter.display(),
            fds.display(),
            s.0.join("prompts.jsonl").display()
        ),
    )
    .unwrap();
    run_ok(&["capture", "--config", cap.to_str().unwrap()]);
    let frun = s.0.join("frun");
    let fcfg = f_theta_config(&s.0, &m, &drafter, &fds, &frun);
    run_ok(&["train", "f-theta", "--config", fcfg.to_str().unwrap()]);
    for f in [
        "report.json",
        "curves.png",
        "state/state.json",
        "export/config.json",
        "export/f_theta.safetensors",
    ] {
        assert!(frun.join(f).is_file(), "{f} missing");
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(frun.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["steps_done"], 12);
    // Both paths read [K ; V]: 1 drafter layer × 2 KV heads × 8, twice.
    assert_eq!(report["f_theta"]["inputs"], "both");
    assert_eq!(
        report["f_theta"]["drafter_kv_dim"].as_u64().unwrap()
            * report["f_theta"]["drafter_layers"]
                .as_array()
                .unwrap()
                .len() as u64
            * 2,
        32
    );
    for t in ["sliding", "global"] {
        let d = &report["final_diagnostics"][t];
        for k in [
            "mse_o_ratio",
            "kdir",
            "vdir",
            "kmag",
            "vmag",
            "k_rel_mse",
            "v_rel_mse",
        ] {
            assert!(d[k].as_f64().unwrap().is_finite(), "{t} {k}: {d}");
        }
    }
}

fn f_theta_config(dir: &Path, verifier: &Path, drafter: &Path, ds: &Path, run: &Path) -> PathBuf {
    let p = dir.join("f-theta.toml");
    std::fs::write(
        &p,
        format!(
            r#"[data]
dataset = "{}"
heldout_every = 4
[model]
verifier = "{}"
drafter = "{}"
rank = 16
inputs = "both"
[train]
steps = 12
lr = 3e-3
warmup_steps = 2
[output]
dir = "{}"
export = "{}"
checkpoint_every = 5
eval_every = 6
eval_queries = 8
"#,
            ds.display(),
            verifier.display(),
            drafter.display(),
            run.display(),
            run.join("export").display()
        ),
    )
    .unwrap();
    p
}

#[test]
fn missing_aux_columns_or_another_verifier_fail_before_training() {
    let s = Scratch::new("traincli-bad");
    let m = model(&s.0, "tiny", 3);
    let other = model(&s.0, "other", 4);
    let ds = capture(&s.0, &m);
    let cfg = train_config(&s.0, &m, &ds, "1, 4");
    let e = fails(&["train", "drafter", "--config", cfg.to_str().unwrap()]);
    assert!(
        e.contains(&ds.display().to_string()) && e.contains("[4]") && e.contains("aux"),
        "{e}"
    );
    let cfg = train_config(&s.0, &other, &ds, "1, 3");
    let e = fails(&["train", "drafter", "--config", cfg.to_str().unwrap()]);
    assert!(e.contains("recapture with this verifier"), "{e}");
    let bad = s.0.join("bad.toml");
    std::fs::write(&bad, "[data]\ndataset = 3\n").unwrap();
    let e = fails(&["train", "drafter", "--config", bad.to_str().unwrap()]);
    assert!(e.contains("bad.toml"), "{e}");
    assert!(!s.0.join("run").exists(), "nothing may be written");
    // f_θ needs the drafter's K/V and the verifier's per-layer tensors: this capture has
    // neither.
    let fcfg = f_theta_config(&s.0, &m, &m, &ds, &s.0.join("frun"));
    let e = fails(&["train", "f-theta", "--config", fcfg.to_str().unwrap()]);
    assert!(
        e.contains(&ds.display().to_string()) && e.contains("no drafter K/V"),
        "{e}"
    );
    assert!(!s.0.join("frun").exists(), "nothing may be written");
}
