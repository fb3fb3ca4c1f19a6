//! `kakeya serve` with several sequences at once, on a tiny random model over real HTTP:
//! concurrent clients share forwards and each gets its own answer; a request that meets a
//! decoding one joins its forwards.

mod common;

use common::http::{self, post};
use common::server::{Server, streamed, tiny};
use kakeya_models::testing::Scratch;
use serde_json::{Value, json};

/// The tiny model served with its drafter, speculation's costs modelled (a forward of R rows:
/// 1 ms + 0.05 ms per extra row), so that whether drafts run beside other sequences does not
/// hang on the machine's load; `extra` arguments after those.
fn speculative_server(s: &Scratch, extra: &[&str]) -> Server {
    let (m, d) = tiny(s);
    let mut args = vec![
        "--drafter",
        d.to_str().unwrap(),
        "--modelled-costs",
        "1000,50,0",
    ];
    args.extend_from_slice(extra);
    Server::start(&m, &args)
}

/// Two sampled clients (T 0.3) together: each gets its answer alone. Returns the drafts
/// verified beside the other sequence, and those accepted.
fn sampled_pair(srv: &Server, prompts: &[&str; 2]) -> (f64, f64) {
    let cool = |i: usize| json!({"prompt": prompts[i], "max_tokens": 150, "ignore_eos": true, "temperature": 0.3, "seed": i});
    let alone: Vec<Value> = [0, 1]
        .map(|i| srv.post("/v1/completions", &cool(i)).json()["choices"][0]["text"].clone())
        .to_vec();
    let (drafted0, accepted0, forwards0) = (
        srv.metric("kakeya_batched_drafts_total"),
        srv.metric("kakeya_batched_drafts_accepted_total"),
        srv.metric("kakeya_batch_rows_count"),
    );
    let pair: Vec<Value> = std::thread::scope(|sc| {
        let handles = [0, 1].map(|i| {
            let (addr, b) = (srv.addr.clone(), cool(i));
            sc.spawn(move || {
                post(&addr, "/v1/completions", &b).json()["choices"][0]["text"].clone()
            })
        });
        handles.map(|h| h.join().unwrap()).to_vec()
    });
    assert_eq!(pair, alone, "sampled, together against alone");
    assert!(
        srv.metric("kakeya_batch_rows_count") > forwards0,
        "the pair shared forwards"
    );
    (
        srv.metric("kakeya_batched_drafts_total") - drafted0,
        srv.metric("kakeya_batched_drafts_accepted_total") - accepted0,
    )
}

#[test]
fn concurrent_clients_get_their_own_answers_through_shared_forwards() {
    let s = Scratch::new("serve-concurrent");
    // Sampled requests verify drafts beside others too (the default on a GPU only).
    let srv = speculative_server(&s, &["--sampled-blocks", "true"]);
    let prompts: Vec<String> = (0..16)
        .map(|i| format!("w{} w{} w{}", 9 + i, 40 + i, 70 + i))
        .collect();
    let body = |p: &str, i: usize| {
        if i.is_multiple_of(2) {
            json!({"prompt": p, "max_tokens": 150, "ignore_eos": true, "temperature": 0})
        } else {
            json!({"prompt": p, "max_tokens": 150, "ignore_eos": true, "temperature": 0.8, "seed": i})
        }
    };
    // One at a time first (each runs alone: speculative), then all 16 at once (batched).
    let alone: Vec<String> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            srv.post("/v1/completions", &body(p, i)).json()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let (rows0, forwards0) = (
        srv.metric("kakeya_batch_rows_sum"),
        srv.metric("kakeya_batch_rows_count"),
    );
    let (chunks0, prompt_forwards0) = (
        srv.metric("kakeya_prompt_chunks_sum"),
        srv.metric("kakeya_prompt_chunks_count"),
    );
    let addr = srv.addr.clone();
    let together: Vec<(String, String)> = std::thread::scope(|sc| {
        let handles: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (addr, b) = (addr.clone(), body(p, i));
                sc.spawn(move || {
                    let mut b = b;
                    if i % 4 == 1 {
                        b["stream"] = json!(true);
                        let r = post(&addr, "/v1/completions", &b);
                        (streamed(&r, false).0, "stream".to_string())
                    } else {
                        let v = post(&addr, "/v1/completions", &b).json();
                        (
                            v["choices"][0]["text"]
                                .as_str()
                                .unwrap_or_else(|| panic!("{v}"))
                                .to_string(),
                            v["kakeya"]["mode"].as_str().unwrap().to_string(),
                        )
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, ((text, _), want)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(text, want, "client {i}");
    }
    // The prompts differ, so the answers do (independence, not one shared answer).
    let distinct: std::collections::BTreeSet<&String> = alone.iter().collect();
    assert!(distinct.len() > 8, "{alone:?}");
    // Decode steps were shared: some forwards stacked several sequences.
    let rows = srv.metric("kakeya_batch_rows_sum") - rows0;
    let forwards = srv.metric("kakeya_batch_rows_count") - forwards0;
    assert!(
        rows > forwards * 1.5,
        "rows {rows} over {forwards} batched forwards"
    );
    assert!(together.iter().any(|(_, mode)| mode.contains("batched")));
    // Prompts that arrived together shared forwards too.
    let chunks = srv.metric("kakeya_prompt_chunks_sum") - chunks0;
    let prompt_forwards = srv.metric("kakeya_prompt_chunks_count") - prompt_forwards0;
    assert!(
        chunks >= 16.0 && chunks > prompt_forwards,
        "{chunks} prompt chunks in {prompt_forwards} forwards"
    );
    // Two greedy clients at once: their blocks are verified in one forward, the drafts of
    // each beside the other's rows, and each still gets its answer alone.
    let accepted0 = srv.metric("kakeya_batched_drafts_accepted_total");
    let pair: Vec<String> = std::thread::scope(|sc| {
        let handles = [0, 2].map(|i| {
            let (addr, b) = (addr.clone(), body(&prompts[i], i));
            sc.spawn(move || {
                post(&addr, "/v1/completions", &b).json()["choices"][0]["text"].to_string()
            })
        });
        handles.map(|h| h.join().unwrap()).to_vec()
    });
    assert_eq!(
        pair,
        [&alone[0], &alone[2]].map(|t| Value::from(t.as_str()).to_string())
    );
    let accepted = srv.metric("kakeya_batched_drafts_accepted_total") - accepted0;
    assert!(accepted > 0.0, "no draft accepted beside another sequence");
    // Two sampled clients at once: their drafts too are verified beside the other's rows
    // (each row drawn with its position's uniform).
    let (drafted, accepted) = sampled_pair(&srv, &[&prompts[1], &prompts[3]]);
    eprintln!("sampled pair: {accepted} of {drafted} drafts accepted beside the other");
    assert!(
        accepted > 0.0,
        "no sampled draft accepted beside another sequence"
    );
    srv.wait_metric("kakeya_running_sequences", 0.0);
    srv.wait_metric("kakeya_kv_bytes", 0.0);
}

/// A request that arrives while another decodes: its prompt runs in the decoding sequence's
/// forwards. The decoding sequence then drafts from lookups only (the drafter's drafts need a
/// forward of their own) and releases the drafter's compact store, whose hidden states would
/// cost each of its later rows; the newcomer keeps its own store while its prompt runs. A
/// batch of sessions with and without a store is one forward; both answers stay what each
/// gets alone.
#[test]
fn a_sequence_that_meets_another_releases_the_drafters_store_and_answers_the_same() {
    let s = Scratch::new("serve-release");
    let srv = speculative_server(&s, &[]);
    let long =
        json!({"prompt": "w9 w10 w11", "max_tokens": 400, "ignore_eos": true, "temperature": 0});
    let short =
        json!({"prompt": "w30 w31 w32", "max_tokens": 40, "ignore_eos": true, "temperature": 0});
    let text = |v: &Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    let long_alone = srv.post("/v1/completions", &long).json();
    let short_alone = text(&srv.post("/v1/completions", &short).json());
    // Alone, a sequence keeps the store its drafter drafts from.
    assert_eq!(long_alone["kakeya"]["mode"], "speculative");
    assert!(long_alone["kakeya"]["kv"]["store"].as_u64().unwrap() > 0);
    // The long request streams; once its tokens flow, the short one arrives (tried again if
    // the long one was done before the short one came: a stalled test thread).
    let mut met = false;
    for _ in 0..3 {
        let mut b = long.clone();
        b["stream"] = json!(true);
        let mut r = http::send(
            &srv.addr,
            "POST",
            "/v1/completions",
            b.to_string().as_bytes(),
        );
        assert_eq!(http::read_head(&mut r).0, 200);
        let mut body = http::read_chunk(&mut r).expect("a first chunk");
        let short_beside = text(&post(&srv.addr, "/v1/completions", &short).json());
        while let Some(c) = http::read_chunk(&mut r) {
            body.extend(c);
        }
        let body = String::from_utf8(body).unwrap();
        let (long_text, last) = streamed(&http::Response { status: 200, body }, false);
        assert_eq!(long_text, text(&long_alone));
        assert_eq!(short_beside, short_alone);
        if last["kakeya"]["mode"] == "speculative+batched" {
            assert_eq!(last["kakeya"]["kv"]["store"], 0, "{last}");
            met = true;
            break;
        }
    }
    assert!(met, "the short request never ran beside the long one");
    srv.wait_metric("kakeya_running_sequences", 0.0);
    srv.wait_metric("kakeya_kv_bytes", 0.0);
}

/// By default on the CPU, sampled requests beside other sequences take plain steps (a sampled
/// row computes every logit there: drafts cost more than they bring); answers are the same.
#[test]
fn sampled_requests_beside_others_take_plain_steps_by_default_on_the_cpu() {
    let s = Scratch::new("serve-sampled-plain");
    let srv = speculative_server(&s, &[]);
    let (drafted, _) = sampled_pair(&srv, &["w9 w10 w11", "w40 w41 w42"]);
    assert_eq!(drafted, 0.0, "no drafts beside others for sampled requests");
    srv.wait_metric("kakeya_running_sequences", 0.0);
}

/// Blocks beside other sequences padded to one length (`--beside-rows`, the default where
/// forwards are recorded: a GPU), the lookups' drafts then repeats of the last: greedy and
/// sampled clients together each get their answer alone, and drafts are accepted.
#[test]
fn padded_blocks_beside_others_answer_as_alone() {
    let s = Scratch::new("serve-padded");
    let srv = speculative_server(&s, &["--beside-rows", "16", "--sampled-blocks", "true"]);
    let body = |i: usize| {
        let p = format!("w{} w{} w{} w{} w{}", 9 + i, 10 + i, 9 + i, 10 + i, 30 + i);
        if i % 3 == 2 {
            json!({"prompt": p, "max_tokens": 60, "ignore_eos": true, "temperature": 0.5, "seed": i})
        } else {
            json!({"prompt": p, "max_tokens": 60, "ignore_eos": true, "temperature": 0})
        }
    };
    let text = |v: Value| {
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_else(|| panic!("{v}"))
            .to_string()
    };
    let alone: Vec<String> = (0..6)
        .map(|i| text(srv.post("/v1/completions", &body(i)).json()))
        .collect();
    let (drafted0, accepted0) = (
        srv.metric("kakeya_batched_drafts_total"),
        srv.metric("kakeya_batched_drafts_accepted_total"),
    );
    let together: Vec<String> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..6)
            .map(|i| {
                let (addr, b) = (srv.addr.clone(), body(i));
                sc.spawn(move || text(post(&addr, "/v1/completions", &b).json()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone, "together against alone");
    let drafted = srv.metric("kakeya_batched_drafts_total") - drafted0;
    let accepted = srv.metric("kakeya_batched_drafts_accepted_total") - accepted0;
    eprintln!("padded blocks: {accepted} of {drafted} draft rows accepted");
    assert!(accepted > 0.0, "drafts accepted beside others");
    srv.wait_metric("kakeya_running_sequences", 0.0);
}
