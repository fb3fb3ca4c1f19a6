//! Speculative decoding on the real Gemma 3 270M (GGUF Q4_K_M): token-identical to plain greedy
//! decoding with a random-weight DFlash drafter over 20 prompts and block sizes 4, 8, 16 (two
//! prompts longer than the 512-token sliding window, so the rings wrap at every step); every draft
//! accepted when the drafts are the verifier's own output; the loop guard on real token
//! streams.
//!
//! They need the fetched model (`python3 scripts/fetch_default_model.py`), so they are
//! `#[ignore]`d; the README's test command runs them with `--include-ignored`.

mod common;

use common::{default_drafter, default_table, load, model_dir, trained_drafter};
use kakeya_models::testing::{drafter_config, random_drafter};
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::{
    CombinedProposer, DFlashProposer, GenerationConfig, KvSetup, NgramProposer, Proposer,
    ReplayProposer, RunawayGuard, Sampling, Session, SpecConfig, Verifier, generate,
    speculative_generate,
};
use kakeya_weights::Tokenizer;

const SHORT: [&str; 18] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "In 1969, the first humans",
    "A haiku about the sea:\n",
    "To make a cup of tea, first",
    "The quick brown fox",
    "Photosynthesis is the process by which",
    "List of planets in the solar system:\n1.",
    "SELECT name, age FROM",
    "The best way to learn a new language is",
    "Dear hiring manager,\n",
    "Q: What is 12 times 12?\nA:",
    "The mitochondria is",
    "fn main() {\n    let x =",
    "Rain is falling on the",
];

/// A ~900-token prompt (past the 512-token sliding window before generation starts).
fn long_prompt(seed: usize) -> String {
    let topics = [
        "rivers",
        "mountains",
        "cities",
        "forests",
        "oceans",
        "deserts",
    ];
    let mut s = String::from("Notes on geography.\n");
    for i in 0..40 {
        let t = topics[(i * 5 + seed) % topics.len()];
        s.push_str(&format!(
            "Entry {}: the {t} of region {} were surveyed in year {}.\n",
            i + 1,
            (i * 7 + seed * 3) % 23,
            1900 + (i * 13 + seed) % 120
        ));
    }
    s.push_str("Summary:");
    s
}

/// [`SHORT`] tokenised, each after BOS.
fn short_prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    SHORT
        .iter()
        .map(|t| {
            let mut ids = vec![tok.bos];
            ids.extend(tok.encode(t).unwrap());
            ids
        })
        .collect()
}

fn cfg(max_tokens: usize) -> GenerationConfig {
    GenerationConfig {
        max_tokens,
        sampling: Sampling::Greedy,
        stop_tokens: vec![],
        prefill_chunk: 512,
        loop_guard: None,
    }
}

/// On a mismatch: the position, both tokens and the reference's top-1/top-2 logit gap there.
fn divergence(v: &GemmaModel, p: &[u32], want: &[u32], got: &[u32]) -> String {
    let i = want.iter().zip(got).take_while(|(a, b)| a == b).count();
    let mut s = Session::new(v, 0);
    let mut logits = s.run(p, 512).unwrap();
    for &t in &want[..i] {
        logits = s.run(&[t], 1).unwrap();
    }
    logits.sort_by(|a, b| b.total_cmp(a));
    format!(
        "first divergence at generated token {i} (greedy {:?}, speculative {:?}); reference top-1/top-2 gap {:.3e}",
        want.get(i),
        got.get(i),
        logits[0] - logits[1]
    )
}

#[test]
#[ignore = "needs the fetched Gemma 3 270M (scripts/fetch_default_model.py)"]
fn speculative_equals_greedy_on_gemma3_270m() {
    let (v, tok) = load();
    let mut prompts = short_prompts(&tok);
    for seed in 0..2 {
        let mut ids = vec![tok.bos];
        ids.extend(tok.encode(&long_prompt(seed)).unwrap());
        // Its point: the prompt alone fills more than the sliding window, so every sliding
        // layer's ring has wrapped before the first draft and keeps wrapping at every block.
        assert!(
            ids.len() > v.config.sliding_window,
            "long prompt has {} tokens, not more than the {}-token sliding window",
            ids.len(),
            v.config.sliding_window
        );
        prompts.push(ids);
    }
    let max_tokens = 17; // = 1 + 2 · 8: the replay check below commits two whole blocks of 8
    let drafters: Vec<(usize, DFlashDrafter)> = [4, 8, 16]
        .into_iter()
        .map(|b| {
            // A reduced draft vocabulary keeps the random drafter's head cheap.
            let mut c = drafter_config(&v.config, 1, b);
            c.draft_vocab_size = Some(4096);
            (
                b,
                DFlashDrafter::from_checkpoint(random_drafter(&c, b as u64), &v).unwrap(),
            )
        })
        .collect();
    for (i, p) in prompts.iter().enumerate() {
        let want = generate(&mut Session::new(&v, 0), p, &cfg(max_tokens), &mut |_| {})
            .unwrap()
            .tokens;
        // Random drafts are (almost) all rejected: each block commits one token, so a few
        // tokens per prompt exercise every block size; the replay check below runs longer.
        let spec_tokens = 8;
        for (block, d) in &drafters {
            let mut ver = Verifier::new(&v, KvSetup::full(0).drafter(d), *block).unwrap();
            let mut prop = DFlashProposer::new(d);
            let g = speculative_generate(
                &mut ver,
                &mut prop,
                p,
                &cfg(spec_tokens),
                SpecConfig::fixed(*block),
                &mut |_| {},
            )
            .unwrap();
            assert!(
                g.tokens[..] == want[..spec_tokens],
                "prompt {i} ({} tokens), block {block}: {}",
                p.len(),
                divergence(&v, p, &want, &g.tokens)
            );
        }
        // Drafts equal to the target: every block commits `block` tokens.
        let block = 8;
        let mut ver = Verifier::new(&v, KvSetup::full(0), block).unwrap();
        let mut replay = ReplayProposer::new(p, &want);
        let g = speculative_generate(
            &mut ver,
            &mut replay,
            p,
            &cfg(1 + 2 * block),
            SpecConfig::fixed(block),
            &mut |_| {},
        )
        .unwrap();
        assert!(
            g.tokens[..] == want[..1 + 2 * block],
            "prompt {i}: {}",
            divergence(&v, p, &want, &g.tokens)
        );
        let s = g.spec.unwrap();
        assert_eq!((s.blocks, s.accepted), (2, 2 * (block - 1)), "prompt {i}");
    }
}

#[test]
#[ignore = "needs the fetched tokenizer (scripts/fetch_default_model.py)"]
fn loop_guard_on_real_token_streams() {
    let tok = Tokenizer::load(&model_dir().join("tokenizer.json"), 262_144).unwrap();
    let guard = RunawayGuard::default();
    let never = [
        (1..=60)
            .map(|i| format!("{i}. Item number {i}\n"))
            .collect::<String>(),
        (0..40)
            .map(|i| format!("- {}\n", ["apples", "pears", "plums", "figs", "kiwis"][i % 5]))
            .collect(),
        "fn main() {\n    let m = [[1, 0, 0], [0, 1, 0], [0, 0, 1]];\n    for row in m.iter() {\n        for x in row {\n            if *x > 0 {\n                println!(\"{x}\");\n            }\n        }\n    }\n}\n"
            .repeat(3),
        (0..30).map(|i| format!("| {i} | {} |\n", i * i)).collect(),
    ];
    for text in &never {
        let ids = tok.encode(text).unwrap();
        for end in 1..=ids.len() {
            assert_eq!(
                guard.check(&ids[..end]),
                None,
                "fired inside ordinary text at token {end}: {:?}",
                tok.decode(&ids[..end]).unwrap()
            );
        }
    }
    let ids = tok.encode(&"ha! ".repeat(30)).unwrap();
    let fired = (1..=ids.len()).find_map(|end| guard.check(&ids[..end]));
    let keep = fired.expect("a 30-fold repetition fires");
    let text = tok.decode(&ids[..keep]).unwrap();
    // The periodic tail keeps three units; the first "ha" may tokenize differently.
    let n = text.matches("ha!").count();
    assert!((3..=4).contains(&n), "kept {text:?}");
}

#[test]
#[ignore = "needs the fetched Gemma 3 270M (scripts/fetch_default_model.py)"]
fn trained_drafters_are_lossless_and_get_drafts_accepted() {
    let (v, tok) = load();
    let mut prompts = short_prompts(&tok);
    let mut ids = vec![tok.bos];
    ids.extend(tok.encode(&long_prompt(0)).unwrap());
    assert!(ids.len() > v.config.sliding_window, "{} tokens", ids.len());
    prompts.push(ids);
    // The other drafter and the other kernel on every third short prompt and the long one.
    let some: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 3 == 0 || *i == prompts.len() - 1)
        .map(|(_, p)| p.clone())
        .collect();
    // The default drafter (10x data) and the first one (the committed f_θ's).
    drafter_is_lossless(&v, "default", &default_drafter(&v), &prompts, 1.45);
    drafter_is_lossless(&v, "first", &trained_drafter(&v), &some, 1.1);
    // The int8 kernel: speculation against plain decoding with the same kernel.
    let mut v8 = v.clone();
    assert!(v8.set_kernel(kakeya_models::linear::Kernel::Int8) > 0);
    let d8 = default_drafter(&v8);
    drafter_is_lossless(&v8, "default, int8 kernel", &d8, &some, 1.45);
}

fn drafter_is_lossless(
    v: &GemmaModel,
    name: &str,
    d: &DFlashDrafter,
    prompts: &[Vec<u32>],
    floor: f64,
) {
    let max_tokens = 40;
    let (mut committed, mut blocks) = (0usize, 0usize);
    for (i, p) in prompts.iter().enumerate() {
        let want = generate(&mut Session::new(v, 0), p, &cfg(max_tokens), &mut |_| {})
            .unwrap()
            .tokens;
        for block in [4, 8] {
            let mut ver = Verifier::new(v, KvSetup::full(0).drafter(d), block).unwrap();
            let mut prop = DFlashProposer::new(d);
            let g = speculative_generate(
                &mut ver,
                &mut prop,
                p,
                &cfg(max_tokens),
                SpecConfig::fixed(block),
                &mut |_| {},
            )
            .unwrap();
            assert!(
                g.tokens == want,
                "prompt {i} ({} tokens), block {block}: {}",
                p.len(),
                divergence(v, p, &want, &g.tokens)
            );
            if block == 8 {
                let s = g.spec.unwrap();
                committed += s.accepted + s.blocks; // accepted drafts + the verifier's token
                blocks += s.blocks;
            }
        }
        // The default engine settings: lookup, the default n-gram table, then the drafter,
        // adaptive blocks; and lookup with the table alone.
        let runs: [(Box<dyn Proposer>, KvSetup<'_>, SpecConfig); 2] = [
            (
                Box::new(CombinedProposer::new(
                    Box::new(DFlashProposer::new(d)),
                    Some(default_table()),
                )),
                KvSetup::full(0).drafter(d),
                SpecConfig::adaptive(8),
            ),
            (
                Box::new(NgramProposer::with_table(Some(default_table()))),
                KvSetup::full(0),
                SpecConfig::fixed(8),
            ),
        ];
        for (mut prop, setup, sc) in runs {
            let mut ver = Verifier::new(v, setup, sc.block_size).unwrap();
            let g = speculative_generate(
                &mut ver,
                prop.as_mut(),
                p,
                &cfg(max_tokens),
                sc,
                &mut |_| {},
            )
            .unwrap();
            assert!(
                g.tokens == want,
                "prompt {i}, {sc:?}: {}",
                divergence(v, p, &want, &g.tokens)
            );
        }
    }
    // A trained drafter must actually draft: a random one commits 1.00 token per block. The
    // default one commits 1.61 per block on all 19 prompts (1.67 with the int8 kernel on the
    // seven of the subset), the first one 1.41 on all, 1.38 on the subset: the default's floor
    // is above what the first reaches.
    let mean = committed as f64 / blocks as f64;
    eprintln!(
        "{name} drafter, block 8: {mean:.2} tokens per block over {} prompts",
        prompts.len()
    );
    assert!(
        mean > floor,
        "{name} drafter: mean acceptance length {mean:.2}"
    );
}
