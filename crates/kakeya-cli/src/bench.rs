//! `kakeya bench`: prefill and decode throughput, llama-bench style (pp N, tg M), after
//! warm-up, median of several runs.

use std::time::Instant;

use anyhow::Result;
use clap::Args;
use kakeya_runtime::Session;
use kakeya_runtime::sampler::argmax;
use serde::Serialize;

use crate::common::ModelArgs;

/// Arguments of `kakeya bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length of the prefill test (pp).
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens of the decode test (tg).
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Measured runs per test (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Unmeasured warm-up runs per test.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Figure {
    test: String,
    tokens: usize,
    runs_tok_s: Vec<f64>,
    median_tok_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Deterministic pseudo-random prompt ids in `[4, vocab)` (llama-bench also uses synthetic ids).
fn synthetic_prompt(n: usize, vocab: usize, bos: u32) -> Vec<u32> {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut ids = vec![bos];
    while ids.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ids.push(4 + (x % (vocab as u64 - 4)) as u32);
    }
    ids
}

/// Runs the benchmark.
pub fn run(a: BenchArgs) -> Result<()> {
    anyhow::ensure!(
        a.runs > 0 && a.prompt_tokens > 0 && a.gen_tokens > 0,
        "--runs, --prompt-tokens and --gen-tokens must be positive"
    );
    let (model, tok) = a.model.load()?;
    let prompt = synthetic_prompt(a.prompt_tokens, model.config.vocab_size, tok.bos);
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    let bar = indicatif::ProgressBar::new((a.warmup + a.runs) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} runs {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix("bench");
    for i in 0..a.warmup + a.runs {
        // Prefill: the whole prompt into empty caches.
        let mut s = Session::new(&model, 0);
        let t = Instant::now();
        s.prefill(&prompt, a.prompt_tokens)?;
        let pp_rate = a.prompt_tokens as f64 / t.elapsed().as_secs_f64();
        // Decode: gen_tokens single-token steps from <bos>, greedy.
        let mut s = Session::new(&model, 0);
        let t = Instant::now();
        let mut next = tok.bos;
        for _ in 0..a.gen_tokens {
            let logits = s.step(next)?;
            next = argmax(&logits).unwrap_or(0) as u32;
        }
        let tg_rate = a.gen_tokens as f64 / t.elapsed().as_secs_f64();
        if i >= a.warmup {
            pp.push(pp_rate);
            tg.push(tg_rate);
        }
        tracing::info!(run = i, pp_rate, tg_rate, "bench run");
        let phase = if i < a.warmup { "warm-up" } else { "measured" };
        bar.set_message(format!(
            "({phase}: pp {pp_rate:.1} tok/s, tg {tg_rate:.1} tok/s)"
        ));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let figures = [
        Figure {
            test: format!("pp{}", a.prompt_tokens),
            tokens: a.prompt_tokens,
            median_tok_s: median(pp.clone()),
            runs_tok_s: pp,
        },
        Figure {
            test: format!("tg{}", a.gen_tokens),
            tokens: a.gen_tokens,
            median_tok_s: median(tg.clone()),
            runs_tok_s: tg,
        },
    ];
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"device": format!("{:?}", a.model.device), "results": figures})
            )?
        );
    } else {
        println!("| test | tok/s (median of {}) | runs |", a.runs);
        println!("|---|---|---|");
        for f in &figures {
            let runs: Vec<String> = f.runs_tok_s.iter().map(|r| format!("{r:.1}")).collect();
            println!(
                "| {} | {:.2} | {} |",
                f.test,
                f.median_tok_s,
                runs.join(", ")
            );
        }
    }
    Ok(())
}
