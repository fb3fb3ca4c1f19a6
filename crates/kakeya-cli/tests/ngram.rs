//! `kakeya ngram build` end to end on a tiny model: a table counted over a capture of the
//! model's own continuations drafts for `--draft ngram` where the sequence has no match, the
//! output stays identical to plain decoding, and bad tables fail cleanly, naming the file.

use std::path::{Path, PathBuf};

mod common;

use common::{fails, run_ok};
use kakeya_models::testing::Scratch;

/// A tokens-only capture of the tiny model's greedy continuations of `n` prompts.
fn capture(dir: &Path, model: &Path, n: usize) -> PathBuf {
    let prompts = dir.join("prompts.jsonl");
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let words: Vec<String> = (0..6 + i % 5)
                .map(|j| format!("w{}", 4 + (i * 13 + j * 7) % 93))
                .collect();
            serde_json::json!({"text": words.join(" ")}).to_string()
        })
        .collect();
    std::fs::write(&prompts, lines.join("\n") + "\n").unwrap();
    let out = dir.join("tokens");
    let config = dir.join("capture.toml");
    std::fs::write(
        &config,
        format!(
            "[model]\nverifier = \"{}\"\n[output]\ndir = \"{}\"\nsequences_per_shard = 8\n\
             [generation]\ngen_len = 24\nmax_prompt_tokens = 64\nchunk = 32\nbatch = 8\n\
             [tensors]\nverifier = []\naux_layers = []\n\
             [[sources]]\nkind = \"jsonl\"\npath = \"{}\"\n",
            model.display(),
            out.display(),
            prompts.display()
        ),
    )
    .unwrap();
    run_ok(&["capture", "--config", config.to_str().unwrap()]);
    out
}

#[test]
fn a_table_of_the_models_own_continuations_drafts_losslessly() {
    let dir = Scratch::new("ngram-cli");
    let model = common::tiny_model_dir(dir.0.as_path(), "tiny", 8, 3);
    let data = capture(dir.0.as_path(), &model, 24);
    let table = dir.0.as_path().join("t.bin");
    let (m, d, t) = (
        model.to_str().unwrap(),
        data.to_str().unwrap(),
        table.to_str().unwrap(),
    );
    run_ok(&["ngram", "build", "--data", d, "--out", t, "--order", "4"]);
    let infer = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec![
            "infer",
            "--model",
            m,
            "--prompt",
            "w50 w9 w31",
            "--max-tokens",
            "40",
            "--draft",
            "ngram",
            "--block-size",
            "4",
            "--json",
            "--compare-ar",
            "--no-loop-guard",
        ];
        args.extend_from_slice(extra);
        serde_json::from_str(&run_ok(&args)).unwrap()
    };
    let with = infer(&["--ngram-table", t]);
    let without = infer(&[]);
    for j in [&with, &without] {
        assert_eq!(j["stats"]["identical_to_ar"], true, "{j}");
    }
    let by_source = |j: &serde_json::Value, key: &str| -> usize {
        j["stats"]["speculative"]["schedule_stats"][key]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.starts_with("table_"))
            .map(|(_, v)| match v {
                serde_json::Value::Array(a) => a.iter().map(|x| x.as_u64().unwrap()).sum::<u64>(),
                x => x.as_u64().unwrap(),
            } as usize)
            .sum()
    };
    assert!(by_source(&with, "blocks_by_source") > 0, "{with}");
    assert!(by_source(&with, "accepted_by_source") > 0, "{with}");
    assert_eq!(by_source(&without, "blocks_by_source"), 0, "{without}");
    // The table's bytes are counted apart from the K/V.
    let held = std::fs::metadata(&table).unwrap().len() as usize;
    let counted = with["stats"]["weights_bytes"]["ngram_table"]
        .as_u64()
        .unwrap() as usize;
    assert!(
        counted >= held * 3 / 4 && counted <= held * 2,
        "{counted} vs file {held}"
    );
    assert!(without["stats"]["weights_bytes"]["ngram_table"].is_null());

    // Bad tables: missing, not a table, truncated, another vocabulary; each names the file.
    let missing = dir.0.as_path().join("missing.bin");
    let garbage = dir.0.as_path().join("garbage.bin");
    std::fs::write(&garbage, b"hello").unwrap();
    let truncated = dir.0.as_path().join("truncated.bin");
    let bytes = std::fs::read(&table).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() - 5]).unwrap();
    let other = dir.0.as_path().join("other.bin");
    kakeya_runtime::NgramTable::build([[1u32, 2, 3].as_slice()], 2, 50_000, [0; 32])
        .unwrap()
        .save(&other)
        .unwrap();
    for (file, says) in [
        (&missing, "cannot read"),
        (&garbage, "not a kakeya n-gram table"),
        (&truncated, "truncated"),
        (&other, "vocabulary"),
    ] {
        let f = file.to_str().unwrap();
        let err = fails(&[
            "infer",
            "--model",
            m,
            "--prompt",
            "w5",
            "--draft",
            "ngram",
            "--ngram-table",
            f,
        ]);
        assert!(err.contains(f) && err.contains(says), "{f}: {err}");
    }
    // A build from a folder that is no dataset fails and writes nothing.
    let out = dir.0.as_path().join("none.bin");
    let err = fails(&[
        "ngram",
        "build",
        "--data",
        dir.0.as_path().to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(err.contains("manifest"), "{err}");
    assert!(!out.exists());
    let err = fails(&["ngram", "build", "--data", d, "--out", t, "--order", "0"]);
    assert!(err.contains("order"), "{err}");
}

/// The committed table of the default model is what `kakeya ngram build` makes of the
/// committed token captures, byte for byte (the command in `docs/train-drafter.md`): a change
/// to how tables are counted or pruned must come with the rebuilt file.
#[test]
fn the_committed_default_table_is_rebuilt_byte_for_byte() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = Scratch::new("ngram-default");
    let out = dir.0.join("table.bin");
    let data = |d: &str| root.join("data").join(d).to_str().unwrap().to_string();
    let (large, sampled) = (data("tokens-drafter-270m-large"), data("tokens-sampled"));
    run_ok(&[
        "ngram",
        "build",
        "--data",
        &large,
        "--data",
        &sampled,
        "--heldout-every",
        "50",
        "--out",
        out.to_str().unwrap(),
    ]);
    let committed = std::fs::read(root.join("checkpoints/ngram-gemma3-270m.bin")).unwrap();
    assert!(
        std::fs::read(&out).unwrap() == committed,
        "checkpoints/ngram-gemma3-270m.bin differs from a rebuild: rebuild it"
    );
}
