//! `kakeya serve` on the test device (`KAKEYA_TEST_DEVICE`: the CPU by default;
//! `scripts/test_wgpu.sh` runs it on wgpu over Mesa's lavapipe, built with `--features
//! wgpu`): greedy and sampled requests alone and three at once, plainly and speculatively,
//! each equal to `kakeya infer` on the same device (issued kernel by kernel there, `--no-graph`, while the
//! server replays recorded forwards on a GPU).

mod common;

use common::http::post;
use common::server::{Server, infer_text, tiny};
use kakeya_models::testing::Scratch;
use serde_json::json;

/// The device the binary runs on, as `--device` names it.
fn device() -> String {
    match std::env::var("KAKEYA_TEST_DEVICE")
        .unwrap_or_default()
        .as_str()
    {
        "" => "cpu".to_string(),
        d => d.to_string(),
    }
}

#[test]
fn the_server_on_the_test_device_answers_what_infer_gives_alone_and_batched() {
    let s = Scratch::new("serve-device");
    let (m, d) = tiny(&s);
    let dev = device();
    let prompts = ["w9 w10 w11 w12", "w30 w31 w9", "w50 w51 w52 w53 w54"];
    // `infer` on each prompt, on the device, without a drafter, with `extra` flags.
    let infer_all = |extra: &[&str]| -> Vec<String> {
        prompts
            .iter()
            .map(|p| {
                let mut args = vec!["--prompt", p, "--max-tokens", "40", "--no-drafter"];
                args.extend(["--device", dev.as_str()]);
                args.extend(extra);
                infer_text(&m, &args).0
            })
            .collect()
    };
    let want = infer_all(&["--no-graph"]);
    // Sampled (top-k 20 at T 0.8, seeded): drawn on the device on a GPU, in `infer` as in the
    // server.
    let sampled = infer_all(&["--temperature", "0.8", "--top-k", "20", "--seed", "3"]);
    assert_ne!(sampled, want, "sampling changes the texts");
    let body = |p: &str| json!({"prompt": p, "max_tokens": 40, "temperature": 0});
    let sampled_body = |p: &str| json!({"prompt": p, "max_tokens": 40, "temperature": 0.8, "top_k": 20, "seed": 3});
    for extra in [vec!["--no-drafter"], vec!["--drafter", d.to_str().unwrap()]] {
        let mut args = vec!["--device", dev.as_str()];
        args.extend(extra.iter().copied());
        let srv = Server::start(&m, &args);
        // One at a time (a lone sequence speculates when it can).
        for (p, w) in prompts.iter().zip(&want) {
            let v = srv.post("/v1/completions", &body(p)).json();
            assert_eq!(
                v["choices"][0]["text"].as_str(),
                Some(w.as_str()),
                "{extra:?} {v}"
            );
        }
        // All at once: stacked forwards (drafts beside each other where they pay).
        let addr = srv.addr.clone();
        let at_once = |make: &dyn Fn(&str) -> serde_json::Value| -> Vec<String> {
            std::thread::scope(|sc| {
                let handles = prompts.map(|p| {
                    let (addr, b) = (addr.clone(), make(p));
                    sc.spawn(move || {
                        let v = post(&addr, "/v1/completions", &b).json();
                        v["choices"][0]["text"]
                            .as_str()
                            .unwrap_or_else(|| panic!("{v}"))
                            .to_string()
                    })
                });
                handles.map(|h| h.join().unwrap()).to_vec()
            })
        };
        assert_eq!(at_once(&body), want, "{extra:?}: together");
        // Sampled requests, alone and together: the texts `infer` samples.
        for (p, w) in prompts.iter().zip(&sampled) {
            let v = srv.post("/v1/completions", &sampled_body(p)).json();
            assert_eq!(
                v["choices"][0]["text"].as_str(),
                Some(w.as_str()),
                "{extra:?}, sampled: {v}"
            );
        }
        // (On a GPU, sampled sequences verify their lookups' drafts beside the others.)
        let drafted0 = srv.metric("kakeya_batched_drafts_total");
        assert_eq!(
            at_once(&sampled_body),
            sampled,
            "{extra:?}: sampled, together"
        );
        eprintln!(
            "{extra:?}: sampled together, {} drafts beside others",
            srv.metric("kakeya_batched_drafts_total") - drafted0
        );
        srv.wait_metric("kakeya_running_sequences", 0.0);
        // On a GPU the server's greedy forwards were replayed (infer's above were issued
        // kernel by kernel); the CPU records none.
        let replayed = srv.metric("kakeya_forwards_replayed_total");
        eprintln!(
            "{extra:?}: forwards replayed {replayed}, recorded {}, declined {}",
            srv.metric("kakeya_forwards_recorded_total"),
            srv.metric("kakeya_forwards_replay_declined_total")
        );
        assert_eq!(
            replayed > 0.0,
            dev != "cpu",
            "{extra:?}: {replayed} replayed"
        );
    }
}

/// Eight clients × two greedy requests of 64 tokens on repetitive prompts, drafts beside each
/// other costed as on a GPU (rows nearly free: `--modelled-costs 1000,1,0`), by the n-gram
/// lookups: with blocks padded to one length (the default where forwards replay) the batched
/// forwards keep one shape and most of them replay; with as many drafts as the schedule
/// chooses (`--beside-rows 0`), the shape changes at almost every step and few replay. Built
/// only for a GPU device (`scripts/test_wgpu.sh`); prints the figures `docs/gpu.md` records.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn padded_blocks_keep_the_batched_forwards_replaying() {
    let s = Scratch::new("serve-padded-replays");
    let (m, _) = tiny(&s);
    let dev = device();
    let run = |extra: &[&str]| -> [f64; 5] {
        let mut args = vec![
            "--device",
            dev.as_str(),
            "--draft",
            "ngram",
            "--modelled-costs",
            "1000,1,0",
        ];
        args.extend(extra);
        let srv = Server::start(&m, &args);
        std::thread::scope(|sc| {
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    let addr = srv.addr.clone();
                    sc.spawn(move || {
                        for r in 0..2 {
                            let p = format!(
                                "w{} w{} w{} w{} w{} w{}",
                                9 + i,
                                10 + i,
                                11 + i,
                                9 + i,
                                10 + i,
                                11 + r
                            );
                            let b = json!({"prompt": p, "max_tokens": 64, "ignore_eos": true, "temperature": 0});
                            let v = post(&addr, "/v1/completions", &b).json();
                            assert!(v["choices"][0]["text"].is_string(), "{v}");
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
        });
        let f = [
            "kakeya_forwards_replayed_total",
            "kakeya_forwards_recorded_total",
            "kakeya_forwards_replay_declined_total",
            "kakeya_batched_drafts_total",
            "kakeya_batched_drafts_accepted_total",
        ]
        .map(|name| srv.metric(name));
        eprintln!(
            "{extra:?}: forwards replayed {}, recorded {}, issued {}; draft rows {} ({} accepted)",
            f[0], f[1], f[2], f[3], f[4]
        );
        f
    };
    let padded = run(&[]);
    let unpadded = run(&["--beside-rows", "0"]);
    assert!(padded[3] > 0.0 && unpadded[3] > 0.0, "drafts beside others");
    assert!(
        padded[0] > padded[2] && padded[0] > 4.0 * unpadded[0].max(5.0),
        "replays: padded {padded:?}, unpadded {unpadded:?}"
    );
}
