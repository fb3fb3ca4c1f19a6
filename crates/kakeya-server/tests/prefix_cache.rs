//! The engine with its prefix cache on, on a tiny model that computes every row on its own
//! (Q8_0 blocks, as the real GGUF model): requests sharing openings — alone (speculative),
//! together (batched beside prompt chunks), greedy and sampled — get exactly the tokens an
//! engine without the cache gives them, while the cache supplies prompt positions.

use std::sync::atomic::AtomicUsize;
use std::sync::mpsc;
use std::time::Instant;

use burn::tensor::Device;
use kakeya_models::testing::{
    drafter_config, random_drafter, random_quantized_checkpoint, tiny_config,
};
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::{DraftKind, GenerationConfig, KvPolicy, Sampling, SpecConfig};
use kakeya_server::engine::{self, Command, Event, Job};
use kakeya_server::{EngineParts, Metrics, Outcome};

/// An engine on its own thread (sliding window 64: longer than the sequences, whose rings
/// then still hold their openings); `prefix_mib` 0 turns the prefix cache off.
struct Engine {
    commands: mpsc::Sender<Command>,
    thread: Option<std::thread::JoinHandle<()>>,
    metrics: std::sync::Arc<Metrics>,
}

impl Engine {
    fn start(prefix_mib: usize) -> Self {
        let (commands, rx) = mpsc::channel();
        let metrics = std::sync::Arc::new(Metrics::default());
        let m = metrics.clone();
        let thread = std::thread::spawn(move || {
            let model = GemmaModel::from_checkpoint(
                random_quantized_checkpoint(&tiny_config(64), 3),
                &Device::flex(),
            )
            .unwrap();
            let drafter = DFlashDrafter::from_checkpoint(
                random_drafter(&drafter_config(&model.config, 1, 4), 5),
                &model,
            )
            .unwrap();
            let parts = EngineParts {
                model,
                drafter: Some(drafter),
                speculation: Some((DraftKind::Combined, SpecConfig::adaptive(4))),
                table: None,
                policy: KvPolicy::default(),
                restorer: None,
                prefill_chunk: 8,
                max_seqs: 16,
                prefix_cache_bytes: prefix_mib << 20,
                sampled_blocks: false,
                beside_rows: None,
            };
            engine::run(parts, rx, &m, &AtomicUsize::new(0));
        });
        Self {
            commands,
            thread: Some(thread),
            metrics,
        }
    }

    /// Submits every request at once; waits for all; (tokens, outcome) per request.
    fn run(&self, requests: &[(Vec<u32>, Sampling)]) -> Vec<(Vec<u32>, Outcome)> {
        let receivers: Vec<_> = requests
            .iter()
            .map(|(prompt, sampling)| {
                let (events, rx) = tokio::sync::mpsc::unbounded_channel();
                let mut cfg = GenerationConfig::greedy(24, 8);
                cfg.sampling = sampling.clone();
                self.commands
                    .send(Command::Job(Job {
                        prompt: prompt.clone(),
                        cfg,
                        events,
                        arrived: Instant::now(),
                    }))
                    .unwrap();
                rx
            })
            .collect();
        receivers
            .into_iter()
            .map(|mut rx| {
                let mut tokens = Vec::new();
                loop {
                    match rx.blocking_recv().expect("the engine answers") {
                        Event::Tokens(t) => tokens.extend(t),
                        Event::Done(o) => return (tokens, *o),
                        Event::Failed(status, msg) => panic!("{status}: {msg}"),
                    }
                }
            })
            .collect()
    }

    fn metric(&self, name: &str) -> f64 {
        self.metrics
            .render()
            .lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .map_or(0.0, |v| v.parse().unwrap())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

/// Prompts opening with one of two shared prefixes, then their own tokens.
fn requests(first: u32) -> Vec<(Vec<u32>, Sampling)> {
    (0..10u32)
        .map(|i| {
            let mut p: Vec<u32> = if i % 2 == 0 {
                vec![2, 11, 12, 13, 14, 15, 16, 17, 18]
            } else {
                vec![2, 40, 41, 42, 43, 44]
            };
            p.extend([(first + 3 * i) % 90 + 5, (first + 7 * i) % 90 + 5]);
            let sampling = if i % 3 == 0 {
                Sampling::Sample {
                    temperature: 0.8,
                    top_k: 0,
                    top_p: 0.95,
                    seed: u64::from(i),
                }
            } else {
                Sampling::Greedy
            };
            (p, sampling)
        })
        .collect()
}

#[test]
fn prompts_that_share_openings_get_the_same_tokens_with_the_prefix_cache() {
    let cached = Engine::start(64);
    let plain = Engine::start(0);
    // One at a time (each runs alone: speculative), then all at once (batched).
    let mut got = Vec::new();
    let mut want = Vec::new();
    for r in requests(1) {
        got.extend(cached.run(std::slice::from_ref(&r)));
        want.extend(plain.run(std::slice::from_ref(&r)));
    }
    got.extend(cached.run(&requests(50)));
    want.extend(plain.run(&requests(50)));
    for (i, ((g, go), (w, wo))) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i}: tokens");
        assert_eq!(g.len(), 24, "request {i}");
        assert_eq!(
            wo.cached_prompt_tokens, 0,
            "request {i}: no cache, nothing cached"
        );
        assert!(go.cached_prompt_tokens < go.prompt_tokens, "request {i}");
    }
    // After the first request of each opening, the alone requests took it from the cache.
    let alone: Vec<usize> = got[..10]
        .iter()
        .map(|(_, o)| o.cached_prompt_tokens)
        .collect();
    assert_eq!(alone[..2], [0, 0], "{alone:?}");
    assert!(alone[2..].iter().all(|&n| n >= 6), "{alone:?}");
    assert!(got[..10].iter().any(|(_, o)| o.speculative.is_some()));
    assert!(got[10..].iter().any(|(_, o)| o.mode.contains("batched")));
    let hits = cached.metric("kakeya_prefix_cache_hits_total");
    let reused = cached.metric("kakeya_prefix_cache_reused_tokens_total");
    let sum: usize = got.iter().map(|(_, o)| o.cached_prompt_tokens).sum();
    assert!(hits >= 18.0, "{hits} hits");
    assert_eq!(reused, sum as f64);
    assert!(cached.metric("kakeya_prefix_cache_bytes") > 0.0);
    assert!(cached.metric("kakeya_prefix_cache_entries") >= 1.0);
    assert_eq!(plain.metric("kakeya_prefix_cache_hits_total"), 0.0);
    assert_eq!(plain.metric("kakeya_prefix_cache_bytes"), 0.0);
}
