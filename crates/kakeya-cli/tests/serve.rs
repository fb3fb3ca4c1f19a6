//! `kakeya serve` on a tiny random model, over real HTTP on an ephemeral loopback port:
//! completions and chat, streamed and not, equal to `kakeya infer`; disconnects; hostile
//! requests; SIGTERM (concurrent clients: `serve_batching.rs`).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::http::{self, get, post};
use common::server::{Server, infer_text, streamed, tiny};
use kakeya_models::testing::Scratch;
use serde_json::{Value, json};

#[test]
fn completions_and_chat_equal_infer_streamed_or_not_plain_or_speculative() {
    let s = Scratch::new("serve-equal");
    let (m, d) = tiny(&s);
    let prompt = "w9 w10 w11 w12";
    let chat_file = s.0.join("chat.json");
    let messages = json!([{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w30 w31 w32"}]);
    std::fs::write(&chat_file, messages.to_string()).unwrap();
    let (want, inf) = infer_text(
        &m,
        &["--prompt", prompt, "--max-tokens", "24", "--no-drafter"],
    );
    let (want_chat, _) = infer_text(
        &m,
        &[
            "--chat-file",
            chat_file.to_str().unwrap(),
            "--max-tokens",
            "24",
            "--no-drafter",
        ],
    );
    let (want_sampled, _) = infer_text(
        &m,
        &[
            "--prompt",
            prompt,
            "--max-tokens",
            "24",
            "--no-drafter",
            "--temperature",
            "0.9",
            "--top-k",
            "20",
            "--seed",
            "11",
        ],
    );
    assert!(!want.is_empty());
    for extra in [vec!["--no-drafter"], vec!["--drafter", d.to_str().unwrap()]] {
        let srv = Server::start(&m, &extra);
        let base = json!({"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0});
        let r = srv.post("/v1/completions", &base);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], want.as_str(), "{extra:?}");
        let n = inf["tokens"].as_array().unwrap().len();
        assert_eq!(v["usage"]["completion_tokens"], n);
        assert_eq!(
            v["usage"]["prompt_tokens"],
            inf["prompt_ids"].as_array().unwrap().len()
        );
        let reason = if n == 24 { "length" } else { "stop" };
        assert_eq!(v["choices"][0]["finish_reason"], reason);
        let mode = v["kakeya"]["mode"].as_str().unwrap();
        assert_eq!(
            mode,
            if extra[0] == "--drafter" {
                "speculative"
            } else {
                "batched"
            }
        );
        // Streamed: the pieces add up to the same text; usage comes when asked for.
        let mut sb = base.clone();
        sb["stream"] = json!(true);
        sb["stream_options"] = json!({"include_usage": true});
        let r = srv.post("/v1/completions", &sb);
        let (text, last) = streamed(&r, false);
        assert_eq!(text, want);
        assert_eq!(last["choices"][0]["finish_reason"], reason);
        let events = r.events();
        let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], n);
        // Chat, streamed and not.
        let cb = json!({"messages": messages, "max_tokens": 24, "temperature": 0.0});
        let r = srv.post("/v1/chat/completions", &cb);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["message"]["content"], want_chat.as_str());
        let mut cs = cb.clone();
        cs["stream"] = json!(true);
        let (text, _) = streamed(&srv.post("/v1/chat/completions", &cs), true);
        assert_eq!(text, want_chat);
        // Seeded sampling: the same tokens as infer's.
        let sampled = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0.9, "top_k": 20, "seed": 11});
        let v = srv.post("/v1/completions", &sampled).json();
        assert_eq!(v["choices"][0]["text"], want_sampled.as_str(), "{extra:?}");
        // A stop string cuts the text before it.
        let words: Vec<&str> = want.split_whitespace().collect();
        if words.len() > 3 {
            let mut st = base.clone();
            st["stop"] = json!([words[2]]);
            let v = srv.post("/v1/completions", &st).json();
            let text = v["choices"][0]["text"].as_str().unwrap();
            assert_eq!(text, &want[..want.find(words[2]).unwrap()]);
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
        }
        let models = get(&srv.addr, "/v1/models").json();
        assert_eq!(models["data"][0]["id"], "m");
        assert_eq!(get(&srv.addr, "/health").status, 200);
    }
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_sequence() {
    let s = Scratch::new("serve-disconnect");
    let (m, _) = tiny(&s);
    let srv = Server::start(&m, &["--no-drafter", "--no-loop-guard"]);
    let body = json!({"prompt": "w9 w10", "max_tokens": 500, "ignore_eos": true, "stream": true});
    let mut r = http::send(
        &srv.addr,
        "POST",
        "/v1/completions",
        body.to_string().as_bytes(),
    );
    let (status, chunked, _) = http::read_head(&mut r);
    assert_eq!((status, chunked), (200, true));
    // Two chunks of tokens arrive, then the client goes away.
    assert!(http::read_chunk(&mut r).is_some());
    assert!(http::read_chunk(&mut r).is_some());
    drop(r);
    let deadline = Instant::now() + Duration::from_secs(30);
    while srv.metric("kakeya_sequences_cancelled_total") < 1.0 {
        assert!(Instant::now() < deadline, "the sequence was not freed");
        std::thread::sleep(Duration::from_millis(20));
    }
    srv.wait_metric("kakeya_running_sequences", 0.0);
    srv.wait_metric("kakeya_kv_bytes", 0.0);
    assert_eq!(srv.metric("kakeya_sequences_finished_total"), 0.0);
    let sent = srv.metric("kakeya_generated_tokens_total");
    assert!(sent < 400.0, "{sent} of 500 tokens were generated and sent");
    // And the server serves on.
    let v = srv
        .post("/v1/completions", &json!({"prompt": "w9", "max_tokens": 3}))
        .json();
    assert!(v["choices"][0]["text"].is_string());
}

#[test]
fn hostile_requests_get_openai_errors_and_the_server_keeps_serving() {
    let s = Scratch::new("serve-hostile");
    let (m, _) = tiny(&s);
    let srv = Server::start(
        &m,
        &[
            "--no-drafter",
            "--max-prompt-tokens",
            "32",
            "--max-body-bytes",
            "4096",
            "--max-tokens-limit",
            "100",
        ],
    );
    let long: String = (0..40).map(|i| format!("w{} ", 10 + i)).collect();
    let big = format!("{{\"prompt\": \"{}\"}}", "w9 ".repeat(3000));
    let cases: Vec<(&str, &str, String, u16)> = vec![
        ("POST", "/v1/completions", r#"{"prompt": "w9""#.into(), 400),
        ("POST", "/v1/completions", "[1, 2]".into(), 400),
        ("POST", "/v1/completions", "".into(), 400),
        ("POST", "/v1/completions", "{}".into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": 5}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": ""}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": [5, 100000]}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": ["w9", "w10"]}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": "w9", "max_tokens": "ten"}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": "w9", "max_tokens": -5}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": "w9", "max_tokens": 0}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": "w9", "max_tokens": 1000000000000}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": "w9", "model": "gpt-4"}"#.into(), 404),
        ("POST", "/v1/completions", r#"{"prompt": "w9", "foo": 1}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": "w9", "temperature": 5}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": "w9", "top_p": 0}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": "w9", "n": 3}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": "w9", "stop": ["a","b","c","d","e"]}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": "w9", "stream": "yes"}"#.into(), 400),
        ("POST", "/v1/completions", r#"{"prompt": "w9", "logprobs": 5}"#.into(), 400),
        ("POST", "/v1/completions", format!("{{\"prompt\": \"{long}\"}}"), 400),
        ("POST", "/v1/completions", big, 413),
        ("POST", "/v1/chat/completions", r#"{"messages": []}"#.into(), 400),
        ("POST", "/v1/chat/completions", r#"{"messages": "hi"}"#.into(), 400),
        ("POST", "/v1/chat/completions", r#"{"messages": [{"role": "wizard", "content": "w9"}]}"#.into(), 400),
        ("POST", "/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "w9"}, {"role": "assistant", "content": "w10"}]}"#.into(), 400),
        ("POST", "/v1/chat/completions", r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#.into(), 400),
        ("POST", "/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "w9"}], "tools": [{"type": "function"}]}"#.into(), 400),
        ("GET", "/v1/nope", String::new(), 404),
        ("GET", "/v1/completions", String::new(), 405),
        ("GET", "/v1/models/gpt-4", String::new(), 404),
    ];
    assert!(cases.len() >= 20);
    for (method, path, body, want) in &cases {
        let r = http::request(&srv.addr, method, path, body);
        assert_eq!(
            r.status,
            *want,
            "{method} {path} {}: {}",
            &body[..body.len().min(80)],
            r.body
        );
        let v = r.json();
        let e = &v["error"];
        assert!(
            e["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{}",
            r.body
        );
        assert!(e["type"].is_string(), "{}", r.body);
        assert!(
            e.get("param").is_some() && e.get("code").is_some(),
            "{}",
            r.body
        );
        assert_eq!(get(&srv.addr, "/health").status, 200);
    }
    let v = srv
        .post(
            "/v1/completions",
            &json!({"prompt": "w9 w10", "max_tokens": 4}),
        )
        .json();
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert!(
        srv.metric("kakeya_requests_total{endpoint=\"/v1/completions\",status=\"400\"}") >= 15.0
    );
}

/// Starts `n` streamed requests of 500 tokens (one sequence at a time), sends SIGTERM once
/// the first is streaming, and returns the answers and the exit status.
fn terminate_while_busy(
    m: &Path,
    drain: &str,
    n: usize,
) -> (Vec<http::Response>, std::process::ExitStatus) {
    let mut srv = Server::start(
        m,
        &[
            "--no-drafter",
            "--no-loop-guard",
            "--max-seqs",
            "1",
            "--drain-secs",
            drain,
        ],
    );
    let body = json!({"prompt": "w9 w10", "max_tokens": 500, "ignore_eos": true, "temperature": 0, "stream": true});
    let mut first = http::send(
        &srv.addr,
        "POST",
        "/v1/completions",
        body.to_string().as_bytes(),
    );
    assert_eq!(http::read_head(&mut first).0, 200);
    let mut head = http::read_chunk(&mut first).unwrap();
    let others: Vec<_> = (1..n)
        .map(|_| {
            let (addr, b) = (srv.addr.clone(), body.clone());
            std::thread::spawn(move || post(&addr, "/v1/completions", &b))
        })
        .collect();
    while srv.metric("kakeya_queue_depth") < (n - 1) as f64 {
        std::thread::sleep(Duration::from_millis(2));
    }
    let pid = srv.child.id().to_string();
    assert!(
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    while let Some(c) = http::read_chunk(&mut first) {
        head.extend(c);
    }
    let mut answers = vec![http::Response {
        status: 200,
        body: String::from_utf8(head).unwrap(),
    }];
    answers.extend(others.into_iter().map(|h| h.join().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = srv.child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "the server did not exit");
        std::thread::sleep(Duration::from_millis(20));
    };
    let log: Vec<String> = srv.stderr.try_iter().collect();
    assert!(!log.iter().any(|l| l.contains("panicked")), "{log:?}");
    (answers, status)
}

#[test]
fn sigterm_drains_requests_in_flight_or_aborts_them_after_the_drain_time() {
    let s = Scratch::new("serve-sigterm");
    let (m, _) = tiny(&s);
    // Time to drain: every request, queued ones included, runs to its end.
    let (answers, status) = terminate_while_busy(&m, "60", 4);
    assert!(status.success(), "exit status {status:?}");
    for r in &answers {
        let (_, last) = streamed(r, false);
        assert_eq!(last["choices"][0]["finish_reason"], "length", "{}", r.body);
        assert_eq!(last["kakeya"]["completion_tokens"], 500);
    }
    // No drain time: what still runs ends with an error event and [DONE]; the exit is clean.
    let (answers, status) = terminate_while_busy(&m, "0", 4);
    assert!(status.success(), "exit status {status:?}");
    let aborted = answers
        .iter()
        .filter(|r| {
            let events = r.events();
            assert_eq!(
                events.last().map(String::as_str),
                Some("[DONE]"),
                "{}",
                r.body
            );
            events.iter().any(|e| e.contains("shutting down"))
        })
        .count();
    assert!(aborted >= 3, "{aborted} of 4 requests aborted");
}

#[test]
fn a_bounded_kv_mode_serves_what_infer_gives_alone_and_batched() {
    let s = Scratch::new("serve-kv");
    let (m, d) = tiny(&s);
    let kv = ["--kv-mode", "quant8", "--kv-sink", "2", "--kv-window", "8"];
    let prompts: Vec<String> = (0..4)
        .map(|i| {
            (0..20)
                .map(|k| format!("w{} ", 9 + (i * 7 + k * 3) % 80))
                .collect()
        })
        .collect();
    let want: Vec<String> = prompts
        .iter()
        .map(|p| {
            let mut args = vec!["--prompt", p.as_str(), "--max-tokens", "30", "--no-drafter"];
            args.extend(kv);
            infer_text(&m, &args).0
        })
        .collect();
    // Plain steps, then speculation (drafts verified beside the other sequences' rows, the
    // rejected ones rolled back out of the bounded caches).
    let spec = [
        "--drafter",
        d.to_str().unwrap(),
        "--modelled-costs",
        "1000,50,0",
    ];
    for extra in [&["--no-drafter"][..], &spec[..]] {
        let mut args = extra.to_vec();
        args.extend(kv);
        let srv = Server::start(&m, &args);
        let addr = srv.addr.clone();
        let got: Vec<Value> = std::thread::scope(|sc| {
            let hs: Vec<_> = prompts
                .iter()
                .map(|p| {
                    let (addr, b) = (
                        addr.clone(),
                        json!({"prompt": p, "max_tokens": 30, "temperature": 0}),
                    );
                    sc.spawn(move || post(&addr, "/v1/completions", &b).json())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (v, w) in got.iter().zip(&want) {
            assert_eq!(v["choices"][0]["text"], w.as_str(), "{extra:?}: {v}");
            assert_eq!(v["kakeya"]["kv_mode"], "quant8");
            assert!(v["kakeya"]["kv"]["quantised"].as_u64().unwrap() > 0, "{v}");
        }
        if extra == spec {
            let drafted = srv.metric("kakeya_batched_drafts_total");
            assert!(drafted > 0.0, "no drafts beside other sequences");
        }
    }
}

#[test]
fn ignore_eos_gives_exactly_max_tokens_even_where_the_loop_guard_would_stop() {
    let s = Scratch::new("serve-ignore-eos");
    let (m, _) = tiny(&s);
    // The loop guard is on (the default); the tiny model's greedy output falls into a loop.
    let srv = Server::start(&m, &["--no-drafter"]);
    let mut guarded = 0;
    for p in ["w9 w10", "w20 w21", "w33", "w50 w51 w52"] {
        let body = |ignore: bool| json!({"prompt": p, "max_tokens": 300, "temperature": 0, "ignore_eos": ignore});
        let free = srv.post("/v1/completions", &body(false)).json();
        let fixed = srv.post("/v1/completions", &body(true)).json();
        // A fixed-length request (load tests, benchmarks): neither end-of-sequence nor the
        // guard ends it.
        assert_eq!(fixed["usage"]["completion_tokens"], 300, "{fixed}");
        assert_eq!(fixed["choices"][0]["finish_reason"], "length");
        if free["kakeya"]["stop_reason"] == "runaway" {
            guarded += 1;
        }
    }
    assert!(guarded > 0, "the guard never fired: the test shows nothing");
}
