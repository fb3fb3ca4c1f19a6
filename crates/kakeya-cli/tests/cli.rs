//! What users run, end to end through the `kakeya` binary on tiny random models: sampling
//! flags, streaming (stdout equals the `--json` text, also where characters are split across
//! byte tokens), the interactive chat loop and `--chat-file`, `kakeya bench --json`; and on the
//! real model, `kakeya convert` writing the folder transformers loads (fixture
//! `tests/fixtures/convert/`), and a copy of the default model getting its drafter and table.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;

mod common;

use common::{fails, kakeya, run_ok, tiny_model_dir};
use kakeya_models::GemmaModel;
use kakeya_models::testing::{Scratch, byte_fallback_tokenizer_json, chat_tokenizer_json};
use kakeya_runtime::chat::ChatSession;
use kakeya_runtime::{GenerationConfig, RunawayGuard, Sampling};
use kakeya_weights::{Checkpoint, Tokenizer};

fn json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

fn tokens(v: &serde_json::Value) -> Vec<u64> {
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

fn infer(model: &Path, extra: &[&str]) -> String {
    let mut args = vec!["infer", "--model", model.to_str().unwrap()];
    args.extend(extra);
    run_ok(&args)
}

#[test]
fn sampling_flags_are_seeded_and_top_k_one_is_greedy() {
    let s = Scratch::new("cli-sampling");
    let m = tiny_model_dir(&s.0, "tiny", 4, 41);
    let p = ["--prompt", "w5 w6 w7 w8", "--max-tokens", "20", "--json"];
    let run = |extra: &[&str]| {
        let mut a = p.to_vec();
        a.extend(extra);
        tokens(&json(&infer(&m, &a)))
    };
    let greedy = run(&[]);
    let seeded: Vec<Vec<u64>> = (1..=3)
        .map(|seed| run(&["--temperature", "1", "--seed", &seed.to_string()]))
        .collect();
    assert_eq!(
        seeded[0],
        run(&["--temperature", "1", "--seed", "1"]),
        "same seed"
    );
    assert!(
        seeded[0] != seeded[1] && seeded[1] != seeded[2] && seeded[0] != seeded[2],
        "seeds 1, 2, 3 should give different samples: {seeded:?}"
    );
    assert!(
        seeded.iter().all(|t| *t != greedy),
        "T = 1 sampled the greedy output"
    );
    for seed in ["1", "2"] {
        let k1 = run(&["--temperature", "1", "--top-k", "1", "--seed", seed]);
        assert_eq!(k1, greedy, "--top-k 1 is greedy (seed {seed})");
    }
    // A nucleus cut and a low temperature still sample, seeded.
    let a = run(&["--temperature", "0.7", "--top-p", "0.9", "--seed", "5"]);
    assert_eq!(
        a,
        run(&["--temperature", "0.7", "--top-p", "0.9", "--seed", "5"])
    );
    assert!(
        fails(&[
            "infer",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            "w5",
            "--top-p",
            "0"
        ])
        .contains("--top-p")
    );
    assert!(
        fails(&[
            "infer",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            "w5",
            "--temperature=-1"
        ])
        .contains("--temperature")
    );
}

#[test]
fn streamed_text_equals_the_json_text_across_split_characters() {
    let s = Scratch::new("cli-stream");
    let m = tiny_model_dir(&s.0, "tiny", 4, 42);
    std::fs::write(m.join("tokenizer.json"), byte_fallback_tokenizer_json(97)).unwrap();
    let mut multibyte = 0;
    for seed in 0..6 {
        let seed = seed.to_string();
        let args = [
            "--prompt",
            "abc",
            "--max-tokens",
            "40",
            "--temperature",
            "1",
            "--seed",
            &seed,
        ];
        let streamed = infer(&m, &args);
        let mut with_json = args.to_vec();
        with_json.push("--json");
        let j = json(&infer(&m, &with_json));
        let text = j["text"].as_str().unwrap();
        // The streamed run ends its text with one newline before the stats (on stderr).
        assert_eq!(streamed, format!("{text}\n"), "seed {seed}");
        multibyte += text
            .chars()
            .filter(|c| c.len_utf8() > 1 && *c != '\u{fffd}')
            .count();
    }
    assert!(
        multibyte > 0,
        "no run produced a character split over byte tokens"
    );
}

/// The tiny model with the chat tokenizer (`<start_of_turn>` = 5, `<end_of_turn>` = 6).
fn chat_model(s: &Scratch) -> PathBuf {
    let m = tiny_model_dir(&s.0, "tiny", 4, 43);
    std::fs::write(m.join("tokenizer.json"), chat_tokenizer_json(97)).unwrap();
    m
}

#[test]
fn interactive_chat_carries_the_conversation_like_the_library_session() {
    let s = Scratch::new("cli-chat");
    let m = chat_model(&s);
    let turns = ["w9 w10 w11", "", "w12 w13", "w40 w41 w42 w43"];
    let mut child = kakeya()
        .args([
            "infer",
            "--model",
            m.to_str().unwrap(),
            "--chat",
            "--max-tokens",
            "30",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let input: String = turns.iter().map(|t| format!("{t}\n")).collect();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The same conversation through the library's chat session (the empty line is skipped).
    let ck = Checkpoint::load(&m).unwrap();
    let tok = Tokenizer::load(&m.join("tokenizer.json"), 97).unwrap();
    let model = GemmaModel::from_checkpoint(ck, &burn::tensor::Device::flex()).unwrap();
    let guard = RunawayGuard::default();
    let cfg = GenerationConfig {
        max_tokens: 30,
        sampling: Sampling::Greedy,
        stop_tokens: vec![tok.eos, tok.end_of_turn.unwrap()],
        prefill_chunk: 512,
        loop_guard: Some(guard),
    };
    let mut chat = ChatSession::new(&model, &guard);
    let mut want = String::new();
    for t in turns.iter().filter(|t| !t.is_empty()) {
        let g = chat.reply(&tok, t, &cfg, &mut |_| {}).unwrap();
        want.push_str(&tok.decode(&g.tokens).unwrap());
        want.push('\n');
    }
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.matches("[prompt ").count(),
        3,
        "one stats line per turn: {stderr}"
    );
}

#[test]
fn chat_file_applies_the_template_and_refuses_bad_conversations() {
    let s = Scratch::new("cli-chat-file");
    let m = chat_model(&s);
    let file = s.0.join("chat.json");
    std::fs::write(
        &file,
        r#"[{"role": "system", "content": "w9"}, {"role": "user", "content": " w10 w11 "},
            {"role": "assistant", "content": "w12"}, {"role": "user", "content": "w13"}]"#,
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let j = json(&infer(
        &m,
        &["--chat-file", f, "--max-tokens", "4", "--json"],
    ));
    // <bos> <start_of_turn> user w9 w10 w11 <end_of_turn> <start_of_turn> model w12
    // <end_of_turn> <start_of_turn> user w13 <end_of_turn> <start_of_turn> model
    let want = [2, 5, 7, 9, 10, 11, 6, 5, 8, 12, 6, 5, 7, 13, 6, 5, 8];
    let ids: Vec<u64> = j["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(ids, want);
    for (body, why) in [
        (
            r#"[{"role": "user", "content": "w9"}, {"role": "user", "content": "w10"}]"#,
            "alternate",
        ),
        (r#"[{"role": "robot", "content": "w9"}]"#, "robot"),
        (
            r#"[{"role": "user", "content": "w9"}, {"role": "model", "content": "w10"}]"#,
            "end with a user",
        ),
        (r#"[]"#, "no user message"),
        (r#"{"role": "user"}"#, "JSON list"),
    ] {
        std::fs::write(&file, body).unwrap();
        let err = fails(&["infer", "--model", m.to_str().unwrap(), "--chat-file", f]);
        assert!(
            err.contains("chat.json") && err.contains(why),
            "{body}: {err}"
        );
    }
}

#[test]
fn bench_prints_the_documented_json() {
    let s = Scratch::new("cli-bench");
    let m = tiny_model_dir(&s.0, "tiny", 4, 44);
    let mm = m.to_str().unwrap();
    let j = json(&run_ok(&[
        "bench",
        "--model",
        mm,
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "8",
        "--runs",
        "3",
        "--warmup",
        "1",
        "--json",
    ]));
    assert!(j["device"].is_string());
    assert_eq!(j["kernel"], "exact");
    let r = j["results"].as_array().unwrap();
    assert_eq!(r.len(), 2);
    for (f, (test, n)) in r.iter().zip([("pp16", 16), ("tg8", 8)]) {
        assert_eq!(f["test"], test);
        assert_eq!(f["tokens"], n);
        let mut runs: Vec<f64> = f["runs_tok_s"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(runs.len(), 3, "{test}: one figure per measured run");
        assert!(runs.iter().all(|&x| x > 0.0 && x.is_finite()));
        runs.sort_by(f64::total_cmp);
        assert_eq!(
            f["median_tok_s"].as_f64().unwrap(),
            runs[1],
            "{test}: the median"
        );
    }
}

/// Batched decoding: the tg test steps 3 sequences together and counts all their tokens;
/// sampled decoding: the tg test says how it chose its tokens.
#[test]
fn bench_names_batched_and_sampled_decoding() {
    let s = Scratch::new("cli-bench-batch");
    let m = tiny_model_dir(&s.0, "tiny", 4, 44);
    let mm = m.to_str().unwrap();
    let j = json(&run_ok(&[
        "bench",
        "--model",
        mm,
        "--prompt-tokens",
        "4",
        "--gen-tokens",
        "5",
        "--runs",
        "1",
        "--warmup",
        "0",
        "--batch",
        "3",
        "--json",
    ]));
    let tg = &j["results"][1];
    assert_eq!(tg["test"], "tg5 × 3 sequences (aggregate)");
    assert_eq!(tg["tokens"], 15);
    assert!(tg["median_tok_s"].as_f64().unwrap() > 0.0);
    let j = json(&run_ok(&[
        "bench",
        "--model",
        mm,
        "--prompt-tokens",
        "4",
        "--gen-tokens",
        "5",
        "--runs",
        "1",
        "--warmup",
        "0",
        "--temperature",
        "0.8",
        "--top-k",
        "5",
        "--json",
    ]));
    assert_eq!(
        j["results"][1]["test"],
        "tg5, sampled (T 0.8, top-k 5, top-p 1)"
    );
}

/// The speculative comparison with replayed drafts: every draft is right.
#[test]
fn bench_compares_speculative_decoding_with_replayed_drafts() {
    let s = Scratch::new("cli-bench-spec");
    let m = tiny_model_dir(&s.0, "tiny", 4, 44);
    let mm = m.to_str().unwrap();
    let prompts = s.0.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"text\": \"w5 w6 w7\"}\n{\"text\": \"w9 w10\"}\n",
    )
    .unwrap();
    let j = json(&run_ok(&[
        "bench",
        "--model",
        mm,
        "--replay-drafts",
        "--block-size",
        "4",
        "--prompts",
        prompts.to_str().unwrap(),
        "--gen-tokens",
        "9",
        "--runs",
        "2",
        "--warmup",
        "1",
        "--json",
    ]));
    for key in [
        "drafts",
        "ar_decode_tok_s",
        "spec_decode_tok_s",
        "speedup",
        "mean_acceptance_length",
        "per_position_acceptance",
    ] {
        assert!(!j[key].is_null(), "missing {key}: {j}");
    }
    assert_eq!(
        (j["block_size"].as_u64(), j["gen_tokens"].as_u64()),
        (Some(4), Some(9))
    );
    assert_eq!(j["all_identical"], true);
    let p = j["prompts"].as_array().unwrap();
    assert_eq!(p.len(), 2);
    for f in p {
        assert_eq!(f["generated"], 9);
        assert_eq!(f["identical"], true);
        // 1 token from prefill + 2 blocks of 4, every draft accepted.
        assert_eq!(f["mean_acceptance_length"].as_f64(), Some(4.0), "{f}");
    }
}

#[test]
#[ignore = "needs the fetched default model (scripts/fetch_default_model.py)"]
fn convert_writes_the_folder_transformers_loads() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/fixtures/convert/convert.json")).unwrap(),
    )
    .unwrap();
    let s = Scratch::new("cli-convert");
    let out = s.0.join("converted");
    let gguf = root.join("models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf");
    run_ok(&[
        "convert",
        "--model",
        gguf.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    // Byte for byte the folder transformers loaded and checked against the GGUF.
    let files = fixture["files"].as_object().unwrap();
    let mut written: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    written.sort();
    assert_eq!(written, files.keys().cloned().collect::<Vec<_>>());
    for (name, hash) in files {
        let got = kakeya_capture::job::sha256_path(&out.join(name)).unwrap();
        assert_eq!(
            &got,
            hash.as_str().unwrap(),
            "{name} differs from the checked conversion"
        );
    }
    // And Kakeya reading that folder gives transformers' logits for it. Same tolerance as the
    // golden tests (f32 on the same weights and K/V; only summation order differs).
    let ck = Checkpoint::load(&out).unwrap();
    assert_eq!(
        ck.config,
        Checkpoint::load(&gguf).unwrap().config,
        "the same config from the GGUF metadata and the folder's config.json"
    );
    let model = GemmaModel::from_checkpoint(ck, &burn::tensor::Device::flex()).unwrap();
    for case in fixture["cases"].as_array().unwrap() {
        let ids: Vec<u32> = serde_json::from_value(case["prompt_ids"].clone()).unwrap();
        // f32 K/V, as the golden tests' 1e-3 comparison (the default 16-bit caches round them).
        let policy = kakeya_runtime::KvPolicy {
            dtype: kakeya_runtime::KvDtype::F32,
            ..Default::default()
        };
        let logits = kakeya_runtime::Session::with_kv(&model, kakeya_runtime::KvSetup::new(policy))
            .unwrap()
            .run(&ids, 512)
            .unwrap();
        let top: Vec<usize> = serde_json::from_value(case["top_ids"].clone()).unwrap();
        let want: Vec<f32> = serde_json::from_value(case["top_logits"].clone()).unwrap();
        for (&i, &w) in top.iter().zip(&want) {
            assert!(
                (logits[i] - w).abs() <= 1e-3,
                "id {i}: {} vs transformers {w}",
                logits[i]
            );
        }
    }
}

/// A copy of the default model (here a link to it) is the default model: it decodes with the
/// default drafter and n-gram table, as a run without `--model` does.
#[test]
#[ignore = "needs the fetched default model (scripts/fetch_default_model.py)"]
fn a_copy_of_the_default_model_gets_its_drafter_and_table() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let s = Scratch::new("cli-default-copy");
    let dir = root.join("models/gemma-3-270m");
    for name in ["gemma-3-270m-q4_k_m.gguf", "tokenizer.json"] {
        std::os::unix::fs::symlink(dir.join(name), s.0.join(name)).unwrap();
    }
    // From the workspace root, where the default drafter and table are found.
    let out = kakeya()
        .current_dir(&root)
        .args(["infer", "--model"])
        .arg(s.0.join("gemma-3-270m-q4_k_m.gguf"))
        .args([
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(j["stats"]["speculative"]["draft"], "combined", "{j}");
    assert!(
        j["stats"]["weights_bytes"]["drafter"].as_u64() > Some(0),
        "{j}"
    );
    assert!(
        j["stats"]["weights_bytes"]["ngram_table"].as_u64() > Some(0),
        "{j}"
    );
}

/// A model with no known drafter says on its stats why it decodes plainly, and `--no-drafter`
/// says so too.
#[test]
fn plain_decoding_says_why() {
    let s = Scratch::new("cli-plain-why");
    let m = tiny_model_dir(&s.0, "m", 8, 3);
    let prompt = ["--prompt", "w1 w2", "--max-tokens", "3", "--json"];
    let j = json(&infer(&m, &prompt));
    let why = j["stats"]["plain_decoding"].as_str().unwrap_or_default();
    assert!(why.contains("no drafter is known for this model"), "{j}");
    assert!(j["stats"]["speculative"].is_null(), "{j}");
    let mut args = prompt.to_vec();
    args.push("--no-drafter");
    let j = json(&infer(&m, &args));
    assert_eq!(j["stats"]["plain_decoding"], "--no-drafter", "{j}");
}
