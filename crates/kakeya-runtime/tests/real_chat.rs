//! Chat and stop rules on the real Gemma 3 270M and its tokenizer: the chat template equals
//! Gemma's own (rendered by transformers from the `chat_template` of the tokenizer config,
//! fixture `tests/fixtures/chat/`), `<start_of_turn>` is one special token, a multi-turn chat
//! carries its caches across turns exactly (a fresh session over the transcript answers the
//! same, also after the loop guard trimmed a reply), and on real model output stop tokens and
//! the loop guard end AR and speculative decoding (with the trained drafter) at the same token.
//!
//! They need the fetched model (`python3 scripts/fetch_default_model.py`), so they are
//! `#[ignore]`d; the README's test command runs them with `--include-ignored`.

mod common;

use common::{load, model_dir, root, speculative, trained_drafter};
use kakeya_runtime::chat::{ChatSession, Message, format_chat};
use kakeya_runtime::{GenerationConfig, RunawayGuard, Sampling, Session, StopReason, generate};
use kakeya_weights::Tokenizer;

fn fixture() -> serde_json::Value {
    let p = root().join("tests/fixtures/chat/chat.json");
    serde_json::from_str(&std::fs::read_to_string(p).expect("chat.json present")).unwrap()
}

#[test]
#[ignore = "needs the fetched tokenizer (scripts/fetch_default_model.py)"]
fn chat_template_equals_gemmas_own() {
    let tok = Tokenizer::load(&model_dir().join("tokenizer.json"), 262_144).unwrap();
    let f = fixture();
    for (name, id) in f["special_ids"].as_object().unwrap() {
        assert_eq!(
            tok.encode(name).unwrap(),
            [id.as_u64().unwrap() as u32],
            "{name} is one special token"
        );
    }
    assert_eq!(
        Some(f["special_ids"]["<end_of_turn>"].as_u64().unwrap() as u32),
        tok.end_of_turn
    );
    let cases = f["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let msgs: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let ours = format_chat(&msgs);
        if case.get("error").is_some() {
            assert!(
                ours.is_err(),
                "Gemma's template refuses {msgs:?} ({}) but we render {ours:?}",
                case["reason"]
            );
            continue;
        }
        let text = ours.unwrap_or_else(|e| panic!("{msgs:?}: {e}"));
        assert_eq!(format!("<bos>{text}"), case["text"].as_str().unwrap());
        let mut ids = vec![tok.bos];
        ids.extend(tok.encode(&text).unwrap());
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(ids, want, "{msgs:?}");
    }
}

fn chat_cfg(tok: &Tokenizer, max_tokens: usize) -> GenerationConfig {
    GenerationConfig {
        max_tokens,
        sampling: Sampling::Greedy,
        stop_tokens: vec![tok.eos, tok.end_of_turn.unwrap()],
        prefill_chunk: 512,
        loop_guard: Some(RunawayGuard::default()),
    }
}

#[test]
#[ignore = "needs the fetched Gemma 3 270M (scripts/fetch_default_model.py)"]
fn chat_carries_caches_across_turns_and_stop_rules_agree_with_speculation() {
    let (v, tok) = load();
    let d = trained_drafter(&v);
    let cfg = chat_cfg(&tok, 48);
    let guard = RunawayGuard::default();
    let mut chat = ChatSession::new(&v, &guard);
    // The base 270M model rarely closes a turn by itself; these turns make it loop (the guard
    // trims the reply, and the trimmed repeats must leave the caches) and run to max_tokens.
    let turns = ["Hello", "Write one word.", "What is 2+2?"];
    let mut reasons = Vec::new();
    for (i, user) in turns.iter().enumerate() {
        let mut prompt = chat.transcript().to_vec();
        prompt.extend(chat.turn_ids(&tok, user).unwrap());
        let g = chat.reply(&tok, user, &cfg, &mut |_| {}).unwrap();
        let text = tok.decode(&g.tokens).unwrap();
        // Uninterrupted: one fresh session over the whole conversation so far.
        let fresh = generate(&mut Session::new(&v, 0), &prompt, &cfg, &mut |_| {}).unwrap();
        assert_eq!(fresh.tokens, g.tokens, "turn {i} ({user:?}): {text:?}");
        assert_eq!(fresh.stop_reason, g.stop_reason, "turn {i}");
        // Speculative decoding stops at the same token under the same rules.
        let s = speculative(&v, &d, &prompt, &cfg);
        assert_eq!(s.tokens, g.tokens, "turn {i}: speculative");
        assert_eq!(s.stop_reason, g.stop_reason, "turn {i}: speculative");
        assert_eq!(chat.session().len(), chat.transcript().len(), "turn {i}");
        reasons.push((g.stop_reason, text));
    }
    assert!(
        reasons.iter().any(|(r, _)| *r == StopReason::Runaway),
        "no turn exercised the loop guard's trim: {reasons:?}"
    );
}

#[test]
#[ignore = "needs the fetched Gemma 3 270M (scripts/fetch_default_model.py)"]
fn stop_tokens_and_the_loop_guard_end_ar_and_speculative_decoding_at_the_same_token() {
    let (v, tok) = load();
    let d = trained_drafter(&v);
    let prompts = [
        "The quick brown fox",
        "Photosynthesis is the process by which",
        "def fibonacci(n):",
        "The End.",
    ];
    let mut guarded = 0;
    for text in prompts {
        let mut p = vec![tok.bos];
        p.extend(tok.encode(text).unwrap());
        let mut c = chat_cfg(&tok, 64);
        c.loop_guard = None;
        let free = generate(&mut Session::new(&v, 0), &p, &c, &mut |_| {}).unwrap();
        // <eos> and <end_of_turn> plus a token the model really produces later on (the base
        // model seldom ends a text by itself): both decoders stop right before it.
        let j = (3..free.tokens.len())
            .find(|&j| !free.tokens[..j].contains(&free.tokens[j]))
            .unwrap_or_else(|| panic!("{text:?}: no new token after 3"));
        c.stop_tokens.push(free.tokens[j]);
        for g in [
            generate(&mut Session::new(&v, 0), &p, &c, &mut |_| {}).unwrap(),
            speculative(&v, &d, &p, &c),
        ] {
            assert_eq!(g.stop_reason, StopReason::StopToken, "{text:?}");
            assert_eq!(g.tokens, free.tokens[..j], "{text:?}");
        }
        // The loop guard on the same output: AR and speculative decoding cut at the same token.
        let c = chat_cfg(&tok, 64);
        let a = generate(&mut Session::new(&v, 0), &p, &c, &mut |_| {}).unwrap();
        let s = speculative(&v, &d, &p, &c);
        assert_eq!(
            (&a.tokens, a.stop_reason),
            (&s.tokens, s.stop_reason),
            "{text:?}"
        );
        if a.stop_reason == StopReason::Runaway {
            guarded += 1;
            assert_eq!(a.tokens, free.tokens[..a.tokens.len()], "{text:?}");
        }
    }
    assert!(guarded >= 1, "the loop guard never fired on real output");
}
