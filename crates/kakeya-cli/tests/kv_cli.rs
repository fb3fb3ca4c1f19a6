//! The KV modes through the binary on a tiny random model: `infer --kv-mode` stats, policy
//! files, f_θ loading (refusing another pair), speculative == plain in a restored mode (and
//! `kakeya serve` in one, sequences drafting beside each other), and
//! `eval niah`: the report, resume == uninterrupted, refused resumes and bad input.

mod common;

use std::path::{Path, PathBuf};

use common::http::post;
use common::server::Server;
use common::{fails, run_ok, tiny_model_dir};
use kakeya_capture::job::sha256_path;
use kakeya_models::testing::{
    Scratch, drafter_config, f_theta_config, random_drafter, random_f_theta, tiny_config,
    word_level_tokenizer_json,
};
use kakeya_weights::Checkpoint;
use kakeya_weights::ftheta::FThetaInputs;

fn json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout).unwrap()
}

/// A prompt of `n` words of the tiny tokenizer.
fn words(n: usize, salt: usize) -> String {
    (0..n)
        .map(|i| format!("w{}", 4 + (i * 7 + salt * 13) % 93))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The tiny model, a drafter for it, and an f_θ made for exactly that pair.
fn pair(s: &Scratch) -> (PathBuf, PathBuf, PathBuf) {
    let m = tiny_model_dir(&s.0, "model", 32, 3);
    let c = tiny_config(32);
    let d = s.0.join("drafter");
    let dc = drafter_config(&c, 2, 4);
    random_drafter(&dc, 4).write_dir(&d).unwrap();
    let f = s.0.join("f-theta");
    let mut fc = f_theta_config(
        2,
        dc.num_key_value_heads * dc.head_dim,
        FThetaInputs::Own,
        16,
        c.num_hidden_layers,
        c.num_key_value_heads * c.head_dim,
    );
    fc.verifier.sha256 = sha256_path(&m).unwrap();
    fc.drafter.sha256 = sha256_path(&d).unwrap();
    random_f_theta(&fc, 5).write_dir(&f).unwrap();
    (m, d, f)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `--kv-mode mode` with sink 2, window 4, the drafter `d` and the f_θ `f`.
fn mode_args<'a>(mode: &'a str, d: &'a Path, f: &'a Path) -> [&'a str; 10] {
    [
        "--kv-mode",
        mode,
        "--kv-sink",
        "2",
        "--kv-window",
        "4",
        "--drafter",
        s(d),
        "--f-theta",
        s(f),
    ]
}

#[test]
fn infer_reports_the_mode_and_its_bytes() {
    let sc = Scratch::new("kv-cli-infer");
    let (m, d, f) = pair(&sc);
    let prompt = words(60, 1);
    let base = [
        "infer",
        "--model",
        s(&m),
        "--prompt",
        &prompt,
        "--max-tokens",
        "20",
        "--json",
    ];
    let full = json(&run_ok(&base));
    let mut seen = Vec::new();
    for mode in [
        "sink-window",
        "quant4",
        "quant8-all",
        "restored",
        "restored-q4",
        "residual-k4v3",
    ] {
        let mut args = base.to_vec();
        args.extend(mode_args(mode, &d, &f));
        args.extend(["--block-size", "4", "--compare-ar"]);
        let v = json(&run_ok(&args));
        let st = &v["stats"];
        assert_eq!(st["kv_mode"], mode);
        assert_eq!(st["identical_to_ar"], true, "{mode}: speculative == plain");
        let kv = &st["kv"];
        let part = |k: &str| kv[k].as_u64().unwrap();
        assert_eq!(
            part("total"),
            part("exact") + part("quantised") + part("store") + part("transient_peak"),
            "{mode}"
        );
        assert_eq!(st["kv_bytes"], kv["total"]);
        assert!(st["weights_bytes"]["drafter"].as_u64().unwrap() > 0);
        assert_eq!(
            st["weights_bytes"]["f_theta"].is_u64(),
            mode.starts_with("restored") || mode.starts_with("residual"),
            "{mode}"
        );
        seen.push(v["tokens"].clone());
    }
    // The bounded modes do change the output of this 80-position sequence (window 8).
    assert!(seen.iter().any(|t| *t != full["tokens"]));

    // A policy file gives the same run as the flags.
    let pol = sc.0.join("policy.toml");
    std::fs::write(&pol, "mode = \"quant4\"\nsink = 2\nwindow = 4\n").unwrap();
    let mut args = base.to_vec();
    args.extend(["--kv-policy", s(&pol)]);
    let by_file = json(&run_ok(&args));
    assert_eq!(by_file["tokens"], seen[1]);
    assert_eq!(by_file["stats"]["kv_policy"]["window"], 4);
}

/// `kakeya serve` in a restored mode: sequences decoding together verify drafts beside each
/// other, rolling back the compact store with the caches, and each gets `infer`'s text.
#[test]
fn a_restored_mode_serves_speculatively_what_infer_gives() {
    let sc = Scratch::new("kv-cli-serve");
    let (m, d, f) = pair(&sc);
    let kv = mode_args("restored", &d, &f);
    let prompts: Vec<String> = (0..3).map(|i| words(24, i)).collect();
    let want: Vec<serde_json::Value> = prompts
        .iter()
        .map(|p| {
            let mut args = vec![
                "infer",
                "--model",
                s(&m),
                "--prompt",
                p,
                "--max-tokens",
                "24",
            ];
            args.extend(kv);
            args.push("--json");
            json(&run_ok(&args))["text"].clone()
        })
        .collect();
    let mut args = kv.to_vec();
    args.extend(["--modelled-costs", "1000,50,0"]);
    let srv = Server::start(&m, &args);
    let addr = srv.addr.clone();
    let got: Vec<serde_json::Value> = std::thread::scope(|scope| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let body = serde_json::json!({"prompt": p, "max_tokens": 24, "temperature": 0});
                let addr = addr.clone();
                scope.spawn(move || post(&addr, "/v1/completions", &body).json())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (v, w) in got.iter().zip(&want) {
        assert_eq!(&v["choices"][0]["text"], w, "{v}");
        assert_eq!(v["kakeya"]["kv_mode"], "restored");
    }
    assert!(
        srv.metric("kakeya_batched_drafts_total") > 0.0,
        "no drafts beside others"
    );
}

#[test]
fn bad_kv_settings_fail_cleanly() {
    let sc = Scratch::new("kv-cli-bad");
    let (m, d, f) = pair(&sc);
    let prompt = words(10, 2);
    let run = |extra: &[&str]| {
        let mut a = vec![
            "infer",
            "--model",
            s(&m),
            "--prompt",
            &prompt,
            "--max-tokens",
            "4",
        ];
        a.extend(extra);
        fails(&a)
    };
    let e = run(&["--kv-mode", "quant3"]);
    assert!(e.contains("unknown KV mode \"quant3\""), "{e}");
    let pol = sc.0.join("bad.toml");
    std::fs::write(&pol, "mode = \"quant4\"\nwindows = 8\n").unwrap();
    let e = run(&["--kv-policy", s(&pol)]);
    assert!(e.contains("bad.toml") && e.contains("windows"), "{e}");
    let e = run(&["--kv-mode", "sink-window", "--kv-window", "600"]);
    assert!(e.contains("larger than the model's context"), "{e}");
    let e = run(&[
        "--kv-mode",
        "sink-window",
        "--kv-window",
        "4",
        "--drafter",
        s(&d),
        "--block-size",
        "8",
    ]);
    assert!(
        e.contains("block size 8 is larger than the global layers' exact window of 4"),
        "{e}"
    );
    // Bit widths, per-layer rules and dtypes.
    let e = run(&["--kv-mode", "bounded-k9v2"]);
    assert!(e.contains("unsupported key bit width 9"), "{e}");
    std::fs::write(&pol, "mode = \"bounded-k4v2\"\n[global]\nv_bits = 1\n").unwrap();
    let e = run(&["--kv-policy", s(&pol)]);
    assert!(
        e.contains("bad.toml") && e.contains("v_bits = 1: unsupported bit width"),
        "{e}"
    );
    std::fs::write(&pol, "mode = \"bounded-k4v2\"\n[global]\nbits = 4\n").unwrap();
    let e = run(&["--kv-policy", s(&pol)]);
    assert!(e.contains("bad.toml") && e.contains("bits"), "{e}");
    std::fs::write(&pol, "mode = \"bounded-k4v2\"\n[global]\nwindow = 32\n").unwrap();
    let e = run(&["--kv-policy", s(&pol)]);
    assert!(e.contains("must hold at least 64 (it is 32)"), "{e}");
    let e = run(&["--kv-dtype", "f8"]);
    assert!(e.contains("unknown KV dtype \"f8\""), "{e}");
    let e = run(&["--kv-mode", "restored", "--drafter", s(&d)]);
    assert!(e.contains("need an f_θ"), "{e}");
    let e = run(&["--kv-mode", "residual-k4v3", "--drafter", s(&d)]);
    assert!(e.contains("need an f_θ"), "{e}");
    std::fs::write(
        &pol,
        "mode = \"bounded-k4v3\"\n[global]\nkeep = \"residual\"\n",
    )
    .unwrap();
    let e = run(&["--kv-policy", s(&pol)]);
    assert!(
        e.contains("bad.toml") && e.contains("keep residuals of f_θ's prediction"),
        "{e}"
    );
    // An f_θ made for another verifier.
    let other = tiny_model_dir(&sc.0, "other", 8, 99);
    let e = fails(&[
        "infer",
        "--model",
        s(&other),
        "--prompt",
        &prompt,
        "--kv-mode",
        "restored",
        "--drafter",
        s(&d),
        "--f-theta",
        s(&f),
        "--no-drafter",
    ]);
    assert!(e.contains("trained for the verifier"), "{e}");
    let e = fails(&[
        "infer",
        "--model",
        s(&other),
        "--prompt",
        &prompt,
        "--kv-mode",
        "residual-k3v2",
        "--drafter",
        s(&d),
        "--f-theta",
        s(&f),
        "--no-drafter",
    ]);
    assert!(e.contains("trained for the verifier"), "{e}");
    // The f_θ folder broken.
    std::fs::write(f.join("f_theta.safetensors"), b"nonsense").unwrap();
    let e = run(&[
        "--kv-mode",
        "restored",
        "--drafter",
        s(&d),
        "--f-theta",
        s(&f),
    ]);
    assert!(e.contains("f_theta.safetensors"), "{e}");
}

#[test]
fn restored_modes_run_on_gemma4_and_an_f_theta_of_other_widths_is_refused() {
    let sc = Scratch::new("kv-cli-g4");
    // transformers' tiny Gemma 4 (sliding layers 2 × 16 wide, full layers 2 × 32; layers 4
    // and 5 share K/V), with a word-level tokenizer of its 128 tokens.
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gemma4/dense-kv");
    let m = sc.0.join("gemma4");
    std::fs::create_dir_all(&m).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), m.join(f)).unwrap();
    }
    std::fs::write(m.join("tokenizer.json"), word_level_tokenizer_json(128)).unwrap();
    let c = Checkpoint::load(&m).unwrap().config;
    let d = sc.0.join("drafter");
    let dc = drafter_config(&c, 2, 4);
    random_drafter(&dc, 4).write_dir(&d).unwrap();
    let make = |name: &str, widths: &[usize]| {
        let mut fc = f_theta_config(
            2,
            dc.num_key_value_heads * dc.head_dim,
            FThetaInputs::Own,
            16,
            widths.len(),
            widths[0],
        )
        .with_layer_widths(widths);
        fc.verifier.sha256 = sha256_path(&m).unwrap();
        fc.drafter.sha256 = sha256_path(&d).unwrap();
        let f = sc.0.join(name);
        random_f_theta(&fc, 5).write_dir(&f).unwrap();
        f
    };
    assert_eq!(c.own_kv_widths(), vec![32, 32, 64, 32]);
    let f = make("f-theta", &c.own_kv_widths());
    let prompt = words(30, 3);
    let args = |f: &Path| {
        [
            "infer",
            "--model",
            s(&m),
            "--prompt",
            &prompt,
            "--max-tokens",
            "16",
            "--json",
            "--kv-mode",
            "restored",
            "--kv-sink",
            "2",
            "--kv-window",
            "3",
            "--drafter",
            s(&d),
            "--f-theta",
            s(f),
            "--block-size",
            "2",
            "--compare-ar",
        ]
        .map(str::to_string)
    };
    let v = json(&run_ok(&args(&f).each_ref().map(String::as_str)));
    assert_eq!(v["stats"]["kv_mode"], "restored");
    assert_eq!(v["stats"]["identical_to_ar"], true, "speculative == plain");
    // The same pair, but an f_θ of one width for every layer (Gemma 3's shape).
    let wrong = make("f-theta-uniform", &[32, 32, 32, 32]);
    let e = fails(&args(&wrong).each_ref().map(String::as_str));
    assert!(
        e.contains("f-theta-uniform") && e.contains("K/V widths [32, 32, 32, 32]"),
        "{e}"
    );
}

fn prompts_file(dir: &Path) -> PathBuf {
    let p = dir.join("prompts.jsonl");
    let lines: Vec<String> = (0..5)
        .map(|i| {
            let text = words(30 + 10 * i, i);
            // The "answer" is a word the model may or may not say: recall is what it is.
            let answer = format!("w{}", 4 + i * 11);
            serde_json::json!({"id": format!("p{i}"), "text": text, "answer": answer}).to_string()
        })
        .collect();
    std::fs::write(&p, lines.join("\n")).unwrap();
    p
}

#[test]
fn eval_niah_reports_resumes_and_refuses_other_settings() {
    let sc = Scratch::new("kv-cli-eval");
    let (m, d, f) = pair(&sc);
    let prompts = prompts_file(&sc.0);
    let out = sc.0.join("eval");
    let args = |out: &Path| -> Vec<String> {
        [
            "eval",
            "niah",
            "--model",
            s(&m),
            "--drafter",
            s(&d),
            "--f-theta",
            s(&f),
            "--prompts",
            s(&prompts),
            "--modes",
            "sink-window,quant4,restored",
            "--kv-sink",
            "2",
            "--kv-window",
            "8",
            "--max-tokens",
            "6",
            "--lengths",
            "40,80",
            "--json",
            "--out",
            s(out),
        ]
        .map(String::from)
        .to_vec()
    };
    let a = args(&out);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let rep = json(&run_ok(&a));
    assert_report(&rep);
    assert!(out.join("recall.png").is_file());

    // Kill after 7 results (the 8th line torn), resume: the same results as uninterrupted.
    let lines = std::fs::read_to_string(out.join("items.jsonl")).unwrap();
    let all: Vec<&str> = lines.lines().collect();
    let torn = format!("{}\n{}", all[..7].join("\n"), &all[7][..all[7].len() / 2]);
    let out2 = sc.0.join("eval2");
    std::fs::create_dir_all(&out2).unwrap();
    std::fs::copy(out.join("settings.json"), out2.join("settings.json")).unwrap();
    std::fs::write(out2.join("items.jsonl"), torn).unwrap();
    let mut b = args(&out2);
    b.push("--resume".into());
    let b: Vec<&str> = b.iter().map(String::as_str).collect();
    let resumed = json(&run_ok(&b));
    let key = |v: &serde_json::Value| -> Vec<(String, String, bool, String)> {
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                (
                    i["id"].as_str().unwrap().into(),
                    i["mode"].as_str().unwrap().into(),
                    i["correct"].as_bool().unwrap(),
                    i["tokens"].to_string(),
                )
            })
            .collect()
    };
    assert_eq!(key(&resumed), key(&rep));

    // Other settings are refused on resume; an existing run is not overwritten.
    let mut c = args(&out);
    c.extend(["--resume".into()]);
    let i = c.iter().position(|x| x == "8").unwrap();
    c[i] = "16".into();
    let c: Vec<&str> = c.iter().map(String::as_str).collect();
    let e = fails(&c);
    assert!(e.contains("other settings"), "{e}");
    let e = fails(&a);
    assert!(e.contains("--resume"), "{e}");
}

/// The report of the run above: `full` then the modes asked for, every item scored against its
/// answer, prompts bucketed by the nearest ladder length.
fn assert_report(rep: &serde_json::Value) {
    assert_eq!(rep["schema_version"], 1);
    assert_eq!(rep["full_cache_dtype"], "f16");
    let modes: Vec<&str> = rep["modes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["mode"].as_str().unwrap())
        .collect();
    assert_eq!(modes, ["full", "sink-window", "quant4", "restored"]);
    let items = rep["items"].as_array().unwrap();
    assert_eq!(items.len(), 5 * 4);
    for it in items {
        let output = it["output"].as_str().unwrap();
        let answer = it["answer"].as_str().unwrap();
        assert_eq!(it["correct"], output.contains(answer));
        assert!(it["kv_bytes"].as_u64().unwrap() > 0);
        if it["mode"] == "full" {
            assert!(it["first_divergence_from_full"].is_null());
        }
    }
    let full = &rep["modes"][0];
    assert_eq!(full["delta_points"], 0.0);
    assert_eq!(full["identical_to_full"], 5);
    let buckets: Vec<u64> = full["by_length"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["length"].as_u64().unwrap())
        .collect();
    assert_eq!(
        buckets,
        [40, 80],
        "prompts of 31..71 tokens (<bos> included)"
    );
}

#[test]
fn eval_niah_refuses_bad_prompts_and_unknown_modes() {
    let sc = Scratch::new("kv-cli-eval-bad");
    let (m, _, _) = pair(&sc);
    let prompts = prompts_file(&sc.0);
    // Bad prompts files.
    let bad = sc.0.join("bad.jsonl");
    std::fs::write(&bad, "{\"id\": \"x\", \"text\": \"w5\"}\n").unwrap();
    let e = fails(&[
        "eval",
        "niah",
        "--model",
        s(&m),
        "--prompts",
        s(&bad),
        "--modes",
        "quant4",
        "--out",
        s(&sc.0.join("eval3")),
    ]);
    assert!(e.contains("bad.jsonl:1") && e.contains("answer"), "{e}");
    let e = fails(&[
        "eval",
        "niah",
        "--model",
        s(&m),
        "--prompts",
        s(&prompts),
        "--modes",
        "quant5",
        "--out",
        s(&sc.0.join("eval4")),
    ]);
    assert!(e.contains("unknown KV mode"), "{e}");
}
