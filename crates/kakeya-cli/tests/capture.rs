//! `kakeya capture` end to end on a tiny model: a run killed with SIGKILL and resumed equals an
//! uninterrupted run (shard hashes), `--shard i/n` runs merged equal the single run, and bad
//! input fails with a clear message and nothing half-written listed.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

mod common;

use common::{assert_clean_failure, fails, kakeya, run_ok};
use kakeya_models::testing::Scratch;

/// Tiny model folder + word-level tokenizer + a prompt file of `n` prompts.
fn setup(dir: &Path, n: usize) -> (PathBuf, PathBuf) {
    let m = common::tiny_model_dir(dir, "tiny", 4, 3);
    let prompts = dir.join("prompts.jsonl");
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let words: Vec<String> = (0..60 + 7 * i)
                .map(|j| format!("w{}", 4 + (i * 11 + j * 5) % 93))
                .collect();
            serde_json::json!({"text": words.join(" ")}).to_string()
        })
        .collect();
    std::fs::write(&prompts, lines.join("\n") + "\n").unwrap();
    (m, prompts)
}

fn write_config(dir: &Path, name: &str, model: &Path, prompts: &Path, out: &Path) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(
        &p,
        format!(
            r#"[model]
verifier = "{}"
[output]
dir = "{}"
sequences_per_shard = 1
[generation]
gen_len = 120
max_prompt_tokens = 256
chunk = 64
[tensors]
verifier = ["k_raw", "v_raw", "attn_out"]
[[sources]]
kind = "jsonl"
path = "{}"
[[sources]]
kind = "needle"
count = 2
seed = 5
lines = [3, 6]
"#,
            model.display(),
            out.display(),
            prompts.display()
        ),
    )
    .unwrap();
    p
}

fn manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap()
}

/// (file, sha256) of every listed shard, checking the files themselves.
fn shard_hashes(dir: &Path) -> Vec<(String, String)> {
    let m = manifest(dir);
    m["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let file = s["file"].as_str().unwrap().to_string();
            let bytes = std::fs::read(dir.join(&file)).unwrap();
            assert_eq!(&bytes[..4], b"PAR1", "{file} is a complete Parquet file");
            assert_eq!(&bytes[bytes.len() - 4..], b"PAR1", "{file} has its footer");
            (file, s["sha256"].as_str().unwrap().to_string())
        })
        .collect()
}

#[test]
fn killed_and_resumed_equals_uninterrupted_and_shards_merge() {
    let s = Scratch::new("capcli-resume");
    let (model, prompts) = setup(&s.0, 8);
    let full_dir = s.0.join("full");
    let cfg_full = write_config(&s.0, "full.toml", &model, &prompts, &full_dir);
    run_ok(&["capture", "--config", cfg_full.to_str().unwrap()]);
    let want = shard_hashes(&full_dir);
    assert_eq!(want.len(), 10);

    // Kill part-way with SIGKILL, then resume.
    let kill_dir = s.0.join("killed");
    let cfg_kill = write_config(&s.0, "kill.toml", &model, &prompts, &kill_dir);
    let mut child = kakeya()
        .args(["capture", "--config", cfg_kill.to_str().unwrap()])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        let done = std::fs::read_to_string(kill_dir.join("manifest.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .map_or(0, |m| m["shards"].as_array().map_or(0, Vec::len));
        if done >= 2 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "capture made no progress"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let partial = shard_hashes(&kill_dir);
    assert!(
        partial.len() < want.len(),
        "the job finished before it was killed; make it longer"
    );
    for (file, hash) in &partial {
        assert!(
            want.contains(&(file.clone(), hash.clone())),
            "{file} differs from the full run"
        );
    }
    run_ok(&[
        "capture",
        "--config",
        cfg_kill.to_str().unwrap(),
        "--resume",
    ]);
    assert_eq!(shard_hashes(&kill_dir), want);
    let stray: Vec<_> = std::fs::read_dir(&kill_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(stray.is_empty(), "temporary files left: {stray:?}");

    // Without --resume an existing dataset is refused.
    let out = kakeya()
        .args(["capture", "--config", cfg_kill.to_str().unwrap()])
        .output()
        .unwrap();
    let err = assert_clean_failure(&out, "capture again without --resume");
    assert!(err.contains("--resume"), "{err}");

    // Two halves on "two machines", merged.
    let (a, b) = (s.0.join("half-a"), s.0.join("half-b"));
    let cfg_a = write_config(&s.0, "a.toml", &model, &prompts, &a);
    let cfg_b = write_config(&s.0, "b.toml", &model, &prompts, &b);
    run_ok(&[
        "capture",
        "--config",
        cfg_a.to_str().unwrap(),
        "--shard",
        "0/2",
    ]);
    run_ok(&[
        "capture",
        "--config",
        cfg_b.to_str().unwrap(),
        "--shard",
        "1/2",
    ]);
    let merged = s.0.join("merged");
    run_ok(&[
        "capture",
        "merge",
        "--out",
        merged.to_str().unwrap(),
        a.to_str().unwrap(),
        b.to_str().unwrap(),
    ]);
    assert_eq!(shard_hashes(&merged), want);
    let (mm, mf) = (manifest(&merged), manifest(&full_dir));
    assert_eq!(mm["sequences"], mf["sequences"]);
    assert_eq!(mm["columns"], mf["columns"]);
}

#[test]
fn bad_capture_input_is_reported_clearly() {
    let s = Scratch::new("capcli-bad");
    let (model, prompts) = setup(&s.0, 2);
    // Unreadable prompt file.
    let out = s.0.join("o1");
    let cfg = write_config(&s.0, "c1.toml", &model, &s.0.join("missing.jsonl"), &out);
    let err = fails(&["capture", "--config", cfg.to_str().unwrap()]);
    assert!(err.contains("missing.jsonl"), "{err}");
    // Malformed JSONL: line number.
    let bad = s.0.join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"w4 w5\"}\n{\"text\": \"w6\"\n").unwrap();
    let cfg = write_config(&s.0, "c2.toml", &model, &bad, &s.0.join("o2"));
    let err = fails(&["capture", "--config", cfg.to_str().unwrap()]);
    assert!(err.contains("bad.jsonl:2"), "{err}");
    // Unknown tensor.
    let cfg = write_config(&s.0, "c3.toml", &model, &prompts, &s.0.join("o3"));
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("\"attn_out\"", "\"attn_outt\"");
    std::fs::write(&cfg, text).unwrap();
    let err = fails(&["capture", "--config", cfg.to_str().unwrap()]);
    assert!(
        err.contains("c3.toml") && err.contains("attn_outt"),
        "{err}"
    );
    // Output folder that cannot be created (a file stands in the way).
    let blocker = s.0.join("blocker");
    std::fs::write(&blocker, "x").unwrap();
    let cfg = write_config(&s.0, "c4.toml", &model, &prompts, &blocker.join("out"));
    let err = fails(&["capture", "--config", cfg.to_str().unwrap()]);
    assert!(err.contains("blocker"), "{err}");
    // Bad --shard.
    let err = fails(&[
        "capture",
        "--config",
        cfg.to_str().unwrap(),
        "--shard",
        "2/2",
    ]);
    assert!(err.contains("--shard 2/2"), "{err}");
}
