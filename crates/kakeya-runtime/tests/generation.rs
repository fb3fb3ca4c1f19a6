//! Generation on tiny random models: sampling through `generate` (seeded runs repeat, seeds
//! differ, top-k 1 is greedy), the stop rules (stop tokens, a full context, the loop guard)
//! stopping AR and speculative decoding at the same token, multi-turn chat whose caches carry
//! across turns (a fresh session over the transcript continues identically, also after the
//! loop guard trimmed a reply), and text streaming of byte-fallback tokens.

mod common;

use burn::tensor::Device;
use common::speculative;
use kakeya_models::testing::{
    Scratch, byte_fallback_tokenizer_json, chat_tokenizer_json, drafter_config, random_checkpoint,
    random_drafter, random_quantized_checkpoint, tiny_config,
};
use kakeya_models::{DFlashDrafter, DraftContext, GemmaModel};
use kakeya_runtime::chat::ChatSession;
use kakeya_runtime::{
    Generation, GenerationConfig, KvSetup, RunawayGuard, Sampler, Sampling, Session, StopReason,
    TextStream, Want, generate, generate_batch,
};
use kakeya_weights::Tokenizer;

const WINDOW: usize = 8;

fn verifier(seed: u64) -> GemmaModel {
    GemmaModel::from_checkpoint(
        random_checkpoint(&tiny_config(WINDOW), seed),
        &Device::flex(),
    )
    .unwrap()
}

fn drafter(v: &GemmaModel, block: usize) -> DFlashDrafter {
    let c = drafter_config(&v.config, 1, block);
    DFlashDrafter::from_checkpoint(random_drafter(&c, 9), v).unwrap()
}

fn prompt(i: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|j| ((j * 13 + i * 29 + 5) % 97) as u32)
        .collect()
}

fn cfg(max_tokens: usize, sampling: Sampling) -> GenerationConfig {
    GenerationConfig {
        max_tokens,
        sampling,
        stop_tokens: vec![],
        prefill_chunk: 16,
        loop_guard: None,
    }
}

fn ar(v: &GemmaModel, p: &[u32], c: &GenerationConfig) -> Generation {
    generate(&mut Session::new(v, 0), p, c, &mut |_| {}).unwrap()
}

fn sample(seed: u64, top_k: usize) -> Sampling {
    Sampling::Sample {
        temperature: 1.0,
        top_k,
        top_p: 1.0,
        seed,
    }
}

#[test]
fn sampling_through_generate_is_seeded_and_top_k_one_is_greedy() {
    let v = verifier(31);
    let p = prompt(0, 9);
    let greedy = ar(&v, &p, &cfg(24, Sampling::Greedy)).tokens;
    let runs: Vec<Vec<u32>> = (0..4)
        .map(|seed| ar(&v, &p, &cfg(24, sample(seed, 0))).tokens)
        .collect();
    assert_eq!(
        runs[0],
        ar(&v, &p, &cfg(24, sample(0, 0))).tokens,
        "the same seed repeats"
    );
    for (i, a) in runs.iter().enumerate() {
        for b in &runs[i + 1..] {
            assert_ne!(a, b, "two seeds gave the same 24 sampled tokens");
        }
        assert_ne!(a, &greedy, "sampling at T = 1 gave the greedy continuation");
    }
    for seed in 0..3 {
        assert_eq!(
            ar(&v, &p, &cfg(24, sample(seed, 1))).tokens,
            greedy,
            "top-k 1 is greedy whatever the seed"
        );
    }
}

#[test]
fn stop_tokens_end_ar_and_speculative_decoding_at_the_same_token() {
    let v = verifier(32);
    let d = drafter(&v, 4);
    let mut checked = 0;
    for i in 0..6 {
        let p = prompt(i, 5 + i);
        let free = ar(&v, &p, &cfg(40, Sampling::Greedy)).tokens;
        // Two stop tokens ("<eos>", "<end_of_turn>"): the one generated first ends it.
        let first_new = |from: usize| (from..free.len()).find(|&j| !free[..j].contains(&free[j]));
        let Some(j1) = first_new(3) else { continue };
        let Some(j2) = first_new(j1 + 1) else {
            continue;
        };
        let mut c = cfg(40, Sampling::Greedy);
        c.stop_tokens = vec![free[j2], free[j1]];
        for g in [ar(&v, &p, &c), speculative(&v, &d, &p, &c)] {
            assert_eq!(g.stop_reason, StopReason::StopToken, "prompt {i}");
            assert_eq!(
                g.tokens,
                free[..j1],
                "prompt {i}: stops before the stop token"
            );
        }
        checked += 1;
    }
    assert!(
        checked >= 3,
        "only {checked} prompts had two distinct later tokens"
    );
}

#[test]
fn a_full_context_ends_ar_and_speculative_decoding_at_the_same_token() {
    let v = verifier(33);
    let ctx = v.config.max_position_embeddings;
    for block in [4, 8] {
        let d = drafter(&v, block);
        for left in [1, 5, 9] {
            let p = prompt(left, ctx - left);
            let c = cfg(100, Sampling::Greedy);
            let (a, s) = (ar(&v, &p, &c), speculative(&v, &d, &p, &c));
            // Every position is filled, and the token chosen at the last one is still emitted.
            assert_eq!(a.stop_reason, StopReason::ContextFull);
            assert_eq!(a.tokens.len(), left + 1, "{left} free positions");
            assert_eq!(s.stop_reason, StopReason::ContextFull);
            assert_eq!(s.tokens, a.tokens, "block {block}, {left} free positions");
        }
    }
}

#[test]
fn the_loop_guard_stops_ar_and_speculative_decoding_at_the_same_token() {
    // Random tiny models fall into short cycles under greedy decoding: the guard must fire.
    let v = verifier(34);
    let d = drafter(&v, 8);
    let mut fired = 0;
    for i in 0..8 {
        let p = prompt(i, 6);
        let mut c = cfg(120, Sampling::Greedy);
        let free = ar(&v, &p, &c).tokens;
        c.loop_guard = Some(RunawayGuard::default());
        let (a, s) = (ar(&v, &p, &c), speculative(&v, &d, &p, &c));
        assert_eq!(a.tokens, s.tokens, "prompt {i}");
        assert_eq!(a.stop_reason, s.stop_reason, "prompt {i}");
        if a.stop_reason == StopReason::Runaway {
            fired += 1;
            assert!(a.stopped_on_runaway && s.stopped_on_runaway);
            // The kept output is the unguarded output cut after 3 copies of the unit.
            assert_eq!(a.tokens, free[..a.tokens.len()], "prompt {i}");
            assert!(RunawayGuard::default().check(&a.tokens).is_none());
        }
    }
    assert!(fired >= 2, "the guard fired on only {fired} of 8 prompts");
}

/// The tiny verifier with the chat tokenizer, in a scratch folder.
fn chat_tokenizer(s: &Scratch) -> Tokenizer {
    let path = s.0.join("tokenizer.json");
    std::fs::write(&path, chat_tokenizer_json(97)).unwrap();
    Tokenizer::load(&path, 97).unwrap()
}

#[test]
fn chat_turns_carry_the_caches_and_equal_a_fresh_run_over_the_transcript() {
    let s = Scratch::new("chat-turns");
    let tok = chat_tokenizer(&s);
    assert_eq!(
        tok.encode("<start_of_turn>user\nw9 w10<end_of_turn>\n")
            .unwrap(),
        [5, 7, 9, 10, 6]
    );
    let v = verifier(35);
    let guard = RunawayGuard::default();
    let mut c = cfg(60, Sampling::Greedy);
    c.stop_tokens = vec![tok.eos, tok.end_of_turn.unwrap()];
    c.loop_guard = Some(guard);
    let mut chat = ChatSession::new(&v, &guard);
    let mut reasons = Vec::new();
    for turn in 0..8 {
        let user: Vec<String> = (0..3 + turn % 4)
            .map(|j| format!("w{}", 9 + (turn * 17 + j * 5) % 88))
            .collect();
        let user = user.join(" ");
        let before = chat.transcript().to_vec();
        let ids = chat.turn_ids(&tok, &user).unwrap();
        let mut streamed = Vec::new();
        let g = chat
            .reply(&tok, &user, &c, &mut |t| streamed.push(t))
            .unwrap();
        assert_eq!(streamed, g.tokens, "turn {turn}: streamed tokens");
        // A fresh session prefilled with everything so far answers the same.
        let mut fresh_prompt = before;
        fresh_prompt.extend(&ids);
        let fresh = ar(&v, &fresh_prompt, &c);
        assert_eq!(fresh.tokens, g.tokens, "turn {turn}");
        assert_eq!(fresh.stop_reason, g.stop_reason, "turn {turn}");
        // The caches hold exactly the transcript: the prompt, the kept reply, the turn end.
        let t = chat.transcript();
        assert_eq!(chat.session().len(), t.len(), "turn {turn}");
        assert_eq!(t[..fresh_prompt.len()], fresh_prompt[..]);
        let end = tok.encode("<end_of_turn>\n").unwrap();
        assert_eq!(t[fresh_prompt.len()..t.len() - end.len()], g.tokens[..]);
        reasons.push(g.stop_reason);
    }
    assert!(
        reasons.contains(&StopReason::Runaway),
        "no turn exercised the loop guard's trim: {reasons:?}"
    );
}

#[test]
fn streamed_text_equals_decoding_everything_at_once_across_split_characters() {
    let s = Scratch::new("stream-bytes");
    let path = s.0.join("tokenizer.json");
    std::fs::write(&path, byte_fallback_tokenizer_json(97)).unwrap();
    let tok = Tokenizer::load(&path, 97).unwrap();
    // "a€é 😀b": € and é and 😀 are 3, 2 and 4 byte tokens.
    let ids = tok.encode("a€é 😀b").unwrap();
    assert_eq!(ids, [13, 4, 5, 6, 7, 8, 39, 9, 10, 11, 12, 14]);
    let mut st = TextStream::new(&tok);
    let pieces: Vec<Option<String>> = ids.iter().map(|&i| st.push(i).unwrap()).collect();
    // A run of byte tokens is held back until an ordinary token closes it.
    let some = |t: &str| Some(t.to_string());
    let n = None;
    assert_eq!(
        pieces,
        [
            some("a"),
            n.clone(),
            n.clone(),
            n.clone(),
            n.clone(),
            n.clone(),
            some("€é "),
            n.clone(),
            n.clone(),
            n.clone(),
            n,
            some("😀b")
        ]
    );
    assert_eq!(st.finish().unwrap(), None);
    // A trailing incomplete character, stray continuation bytes, a special token inside a
    // character, a complete character that a later invalid byte spoils (a run decodes as a
    // whole): the pieces still add up to the decoding of all ids.
    for ids in [
        vec![13, 4, 5],
        vec![5, 13, 9, 10, 1, 11, 12, 4],
        vec![5, 13, 9, 10, 1, 11, 12, 14],
        vec![2, 8, 7, 39, 6, 0, 14],
        vec![13, 9, 10, 11, 12, 5, 14],
    ] {
        let mut st = TextStream::new(&tok);
        let mut text: String = ids.iter().filter_map(|&i| st.push(i).unwrap()).collect();
        text.extend(st.finish().unwrap());
        assert_eq!(text, tok.decode(&ids).unwrap(), "{ids:?}");
    }
}

#[test]
fn batched_generation_equals_each_sequence_alone() {
    // Q8_0 weights: projections of up to 16 rows run the batch-invariant block kernel, as on
    // the real model, so stacking sequences must not change a bit.
    let v = GemmaModel::from_checkpoint(
        random_quantized_checkpoint(&tiny_config(WINDOW), 3),
        &Device::flex(),
    )
    .unwrap();
    let d = drafter(&v, 4);
    // Prompts of different lengths; one stops early on a stop token, the others run to
    // max_tokens; greedy and seeded sampling.
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| prompt(i, 3 + 4 * i)).collect();
    let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    for sampling in [Sampling::Greedy, sample(7, 0)] {
        let mut c = cfg(12, sampling);
        let alone: Vec<Generation> = refs.iter().map(|p| ar(&v, p, &c)).collect();
        // A stop token the third sequence produces mid-way.
        c.stop_tokens = vec![alone[2].tokens[5]];
        let alone: Vec<Generation> = refs.iter().map(|p| ar(&v, p, &c)).collect();
        assert!(
            alone[2].tokens.len() <= 5,
            "the stop token ends sequence 2 early"
        );
        let mut sessions: Vec<Session> = refs.iter().map(|_| Session::new(&v, 0)).collect();
        let batched = generate_batch(&mut sessions, &refs, &c).unwrap();
        for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
            assert_eq!(a.tokens, b.tokens, "sequence {i}");
            assert_eq!(a.stop_reason, b.stop_reason, "sequence {i}");
            assert_eq!(a.stats.decode_steps, b.stats.decode_steps, "sequence {i}");
        }
        // The caches (and, with a drafter, the store rows) end as they would alone: one more
        // step in each session gives the same logits, bit for bit.
        let mut with_store: Vec<Session> = refs
            .iter()
            .map(|_| Session::with_kv(&v, KvSetup::full(0).drafter(&d)).unwrap())
            .collect();
        let batched = generate_batch(&mut with_store, &refs, &c).unwrap();
        for (i, (s, g)) in with_store.iter_mut().zip(&batched).enumerate() {
            let mut alone = Session::with_kv(&v, KvSetup::full(0).drafter(&d)).unwrap();
            let a = generate(&mut alone, refs[i], &c, &mut |_| {}).unwrap();
            assert_eq!(a.tokens, g.tokens, "sequence {i}");
            assert_eq!(alone.len(), s.len(), "sequence {i}");
            let next = 11;
            assert_eq!(
                s.run(&[next], 1).unwrap(),
                alone.run(&[next], 1).unwrap(),
                "sequence {i}"
            );
            let store = |s: &mut Session| {
                let st = s.store_mut().unwrap().unwrap();
                let (k, v) = st.read(0..st.len()).unwrap();
                let h = |t: burn::tensor::Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
                (h(k), h(v))
            };
            assert!(store(s) == store(&mut alone), "store rows of sequence {i}");
        }
    }
}

#[test]
fn batched_steps_refuse_mismatched_inputs() {
    let v = verifier(3);
    let other = verifier(4);
    let (mut a, mut b) = (Session::new(&v, 0), Session::new(&other, 0));
    a.run(&[1, 2], 4).unwrap();
    b.run(&[1, 2], 4).unwrap();
    let g = Sampler::new(Sampling::Greedy);
    let (three, four): (&[u32], &[u32]) = (&[3], &[4]);
    let next = Want::Next(&g);
    let err = Session::run_batch(&mut [&mut a, &mut b], &[three, four], &[next, next]).unwrap_err();
    assert!(err.to_string().contains("share one model"), "{err}");
    let mut c = Session::new(&v, 0);
    c.run(&[1], 4).unwrap();
    let err = Session::run_batch(&mut [&mut a, &mut c], &[three], &[next]).unwrap_err();
    assert!(
        err.to_string()
            .contains("1 chunks and 1 samplers for 2 sessions"),
        "{err}"
    );
    let mut sessions = vec![Session::new(&v, 0)];
    let err = generate_batch(
        &mut sessions,
        &[&[1][..], &[2][..]],
        &cfg(3, Sampling::Greedy),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("1 sessions for 2 prompts"),
        "{err}"
    );
}
