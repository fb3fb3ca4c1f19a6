//! Bad input to the `kakeya` binary: each case must exit non-zero with a message naming the
//! file and the problem, never panic, and leave no partial output.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use common::{fails, run_ok};
use kakeya_models::testing::Scratch;
use kakeya_models::testing::{
    drafter_config, random_drafter, tiny_config, word_level_tokenizer_json,
};

/// A word-level tokenizer with `n` tokens (<pad>, <eos>, <bos>, <unk>, w4, w5, ...).
fn write_tokenizer(path: &Path, n: usize) {
    std::fs::write(path, word_level_tokenizer_json(n)).unwrap();
}

/// A tiny random Gemma 3 as an HF folder, with a matching tokenizer (vocab 97, context 512).
fn tiny_model(dir: &Path) -> PathBuf {
    common::tiny_model_dir(dir, "tiny", 4, 3)
}

/// A GGUF image with one F32 tensor `w` of 4 elements of type `type_id`.
fn gguf_bytes(type_id: u32) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    let key = b"general.architecture";
    b.extend((key.len() as u64).to_le_bytes());
    b.extend(key);
    b.extend(8u32.to_le_bytes());
    b.extend(6u64.to_le_bytes());
    b.extend(b"gemma3");
    b.extend(1u64.to_le_bytes());
    b.push(b'w');
    b.extend(1u32.to_le_bytes());
    b.extend(4u64.to_le_bytes());
    b.extend(type_id.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.resize(b.len().div_ceil(32) * 32, 0);
    b.extend([0u8; 16]);
    b
}

#[test]
fn truncated_gguf() {
    let s = Scratch::new("cli-trunc");
    let p = s.0.join("m.gguf");
    let mut b = gguf_bytes(0);
    b.truncate(b.len() - 5);
    std::fs::write(&p, b).unwrap();
    let err = fails(&["infer", "--model", p.to_str().unwrap(), "--prompt", "hi"]);
    assert!(err.contains("m.gguf") && err.contains("truncated"), "{err}");
    // convert leaves nothing behind
    let out = s.0.join("out");
    let err = fails(&[
        "convert",
        "--model",
        p.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(err.contains("truncated"), "{err}");
    assert!(!out.exists());
    assert_eq!(
        std::fs::read_dir(&s.0).unwrap().count(),
        1,
        "no temp folders left"
    );
}

#[test]
fn wrong_magic() {
    let s = Scratch::new("cli-magic");
    let p = s.0.join("m.gguf");
    let mut b = gguf_bytes(0);
    b[..4].copy_from_slice(b"GGML");
    std::fs::write(&p, b).unwrap();
    let err = fails(&["infer", "--model", p.to_str().unwrap(), "--prompt", "hi"]);
    assert!(
        err.contains("m.gguf") && err.contains("not a GGUF file"),
        "{err}"
    );
}

#[test]
fn unknown_quant_type() {
    let s = Scratch::new("cli-qtype");
    let p = s.0.join("m.gguf");
    std::fs::write(&p, gguf_bytes(19)).unwrap();
    let err = fails(&["infer", "--model", p.to_str().unwrap(), "--prompt", "hi"]);
    assert!(
        err.contains("m.gguf") && err.contains("unsupported GGML type 19 (IQ1_S)"),
        "{err}"
    );
}

#[test]
fn safetensors_header_past_the_end() {
    let s = Scratch::new("cli-st");
    let m = tiny_model(&s.0);
    let st = m.join("model.safetensors");
    let len = std::fs::metadata(&st).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&st).unwrap();
    f.set_len(len - 100).unwrap();
    let err = fails(&["infer", "--model", m.to_str().unwrap(), "--prompt", "w4"]);
    assert!(
        err.contains("model.safetensors") && err.contains("invalid safetensors"),
        "{err}"
    );
}

#[test]
fn config_missing_a_field() {
    let s = Scratch::new("cli-cfg");
    let m = tiny_model(&s.0);
    let cfg = m.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("num_key_value_heads");
    std::fs::write(&cfg, v.to_string()).unwrap();
    let err = fails(&["infer", "--model", m.to_str().unwrap(), "--prompt", "w4"]);
    assert!(
        err.contains("config.json: missing required field `num_key_value_heads`"),
        "{err}"
    );
}

#[test]
fn tokenizer_vocab_mismatch() {
    let s = Scratch::new("cli-tok");
    let m = tiny_model(&s.0);
    let other = s.0.join("other-tokenizer.json");
    write_tokenizer(&other, 50);
    let err = fails(&[
        "infer",
        "--model",
        m.to_str().unwrap(),
        "--tokenizer",
        other.to_str().unwrap(),
        "--prompt",
        "w4",
    ]);
    assert!(
        err.contains("other-tokenizer.json")
            && err.contains("50 tokens")
            && err.contains("97 rows"),
        "{err}"
    );
}

#[test]
fn empty_prompt() {
    let s = Scratch::new("cli-empty");
    let m = tiny_model(&s.0);
    let err = fails(&["infer", "--model", m.to_str().unwrap(), "--prompt", "  "]);
    assert!(err.contains("prompt is empty"), "{err}");
    let pf = s.0.join("prompt.txt");
    std::fs::write(&pf, "").unwrap();
    let err = fails(&[
        "infer",
        "--model",
        m.to_str().unwrap(),
        "--prompt-file",
        pf.to_str().unwrap(),
    ]);
    assert!(err.contains("prompt is empty"), "{err}");
}

#[test]
fn int8_kernel_without_quantised_weights() {
    // An HF folder's weights are f32: nothing for the int8 kernel, which says so.
    let s = Scratch::new("cli-int8");
    let m = tiny_model(&s.0);
    let err = fails(&[
        "infer",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "w5",
        "--kernel",
        "int8",
    ]);
    assert!(
        err.contains("--kernel int8") && err.contains(m.to_str().unwrap()),
        "{err}"
    );
}

#[test]
fn prompt_longer_than_context() {
    let s = Scratch::new("cli-long");
    let m = tiny_model(&s.0);
    let prompt = vec!["w5"; 600].join(" ");
    let err = fails(&["infer", "--model", m.to_str().unwrap(), "--prompt", &prompt]);
    assert!(
        err.contains("601 tokens") && err.contains("context of 512"),
        "{err}"
    );
}

#[test]
fn tiny_model_generates() {
    // The good path of the same fixtures, so the failures above are failures of the input.
    let s = Scratch::new("cli-ok");
    let m = tiny_model(&s.0);
    let out = Command::new(env!("CARGO_BIN_EXE_kakeya"))
        .args([
            "infer",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            "w4 w5 w6",
            "--max-tokens",
            "5",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["prompt_ids"].as_array().unwrap().len(), 4);
    assert!(!v["tokens"].as_array().unwrap().is_empty());
}

/// A random drafter folder for the tiny model, with `edit` applied to its config.
fn tiny_drafter(
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&mut kakeya_weights::DFlashConfig),
) -> PathBuf {
    let mut c = drafter_config(&tiny_config(4), 1, 4);
    edit(&mut c);
    let d = dir.join(name);
    random_drafter(&c, 7).write_dir(&d).unwrap();
    d
}

#[test]
fn mismatched_drafter_and_bad_block_sizes() {
    let s = Scratch::new("cli-drafter");
    let m = tiny_model(&s.0);
    let m = m.to_str().unwrap();
    let wide = tiny_drafter(&s.0, "wide", |c| {
        c.hidden_size = 64;
    });
    let err = fails(&[
        "infer",
        "--model",
        m,
        "--prompt",
        "w4",
        "--drafter",
        wide.to_str().unwrap(),
    ]);
    assert!(
        err.contains("wide") && err.contains("hidden_size 64"),
        "{err}"
    );
    let deep = tiny_drafter(&s.0, "deep", |c| c.target_layer_ids = vec![2, 40]);
    let err = fails(&[
        "infer",
        "--model",
        m,
        "--prompt",
        "w4",
        "--drafter",
        deep.to_str().unwrap(),
    ]);
    assert!(
        err.contains("deep") && err.contains("target layer 40"),
        "{err}"
    );
    let ok = tiny_drafter(&s.0, "ok", |_| {});
    let ok = ok.to_str().unwrap();
    for (b, what) in [
        ("0", "at least 1"),
        ("513", "larger than the model's context"),
    ] {
        let err = fails(&[
            "infer",
            "--model",
            m,
            "--prompt",
            "w4",
            "--drafter",
            ok,
            "--block-size",
            b,
        ]);
        assert!(err.contains(what), "{err}");
    }
    let err = fails(&[
        "infer",
        "--model",
        m,
        "--prompt",
        "w4",
        "--drafter",
        s.0.join("nope").to_str().unwrap(),
    ]);
    assert!(err.contains("nope"), "{err}");
}

#[test]
fn tiny_model_decodes_speculatively_like_greedy() {
    let s = Scratch::new("cli-spec");
    let m = tiny_model(&s.0);
    let d = tiny_drafter(&s.0, "drafter", |_| {});
    let out = Command::new(env!("CARGO_BIN_EXE_kakeya"))
        .args([
            "infer",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            "w4 w5 w6",
            "--max-tokens",
            "20",
            "--drafter",
            d.to_str().unwrap(),
            "--block-size",
            "4",
            "--compare-ar",
            "--json",
            "--no-loop-guard",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let st = &v["stats"];
    assert_eq!(st["identical_to_ar"], true, "{v}");
    let sp = &st["speculative"];
    assert_eq!(sp["block_size"], 4);
    assert!(sp["blocks"].as_u64().unwrap() >= 1);
    assert!(sp["mean_acceptance_length"].as_f64().unwrap() >= 1.0);
    assert_eq!(sp["per_position_acceptance"].as_array().unwrap().len(), 3);
    assert!(st["ar_decode_tok_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn every_draft_kind_and_schedule_decodes_like_greedy() {
    let s = Scratch::new("cli-draft-kinds");
    let m = tiny_model(&s.0);
    let d = tiny_drafter(&s.0, "drafter", |_| {});
    for kind in ["dflash", "ngram", "combined"] {
        for block in [Some("4"), None] {
            let mut args = vec![
                "infer",
                "--model",
                m.to_str().unwrap(),
                "--prompt",
                "w4 w5 w6 w4 w5",
                "--max-tokens",
                "24",
                "--drafter",
                d.to_str().unwrap(),
                "--draft",
                kind,
                "--compare-ar",
                "--json",
                "--no-loop-guard",
            ];
            if let Some(b) = block {
                args.extend(["--block-size", b]);
            }
            let v: serde_json::Value = serde_json::from_str(&run_ok(&args)).unwrap();
            let st = &v["stats"];
            assert_eq!(st["identical_to_ar"], true, "{kind} {block:?}: {v}");
            let sp = &st["speculative"];
            assert_eq!(sp["draft"], kind);
            let want = if block.is_some() { "fixed" } else { "adaptive" };
            assert_eq!(sp["schedule"], want, "{v}");
            let by_len = sp["schedule_stats"]["blocks_by_length"].as_array().unwrap();
            let total: u64 = by_len.iter().map(|n| n.as_u64().unwrap()).sum();
            assert_eq!(total, sp["blocks"].as_u64().unwrap(), "{v}");
        }
    }
    // Sampling with a drafter: speculative sampling, seeded.
    let sampled = |seed: &str| {
        let out = run_ok(&[
            "infer",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            "w4 w5 w6",
            "--max-tokens",
            "16",
            "--drafter",
            d.to_str().unwrap(),
            "--temperature",
            "0.8",
            "--top-k",
            "5",
            "--seed",
            seed,
            "--json",
            "--no-loop-guard",
        ]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert!(
            v["stats"]["speculative"]["blocks"].as_u64().unwrap() >= 1,
            "{v}"
        );
        v["tokens"].clone()
    };
    assert_eq!(sampled("3"), sampled("3"), "same seed, same tokens");
    // A drafter kind without a drafter, and drafting options with --no-drafter, are refused.
    let err = fails(&[
        "infer",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "w4",
        "--draft",
        "dflash",
    ]);
    assert!(err.contains("--drafter"), "{err}");
    let err = fails(&[
        "infer",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "w4",
        "--draft",
        "ngram",
        "--no-drafter",
    ]);
    assert!(err.contains("--no-drafter"), "{err}");
}
