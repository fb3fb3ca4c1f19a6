//! `kakeya bench`: prefill and decode throughput, llama-bench style (pp N, tg M), after
//! warm-up, median of several runs.

use std::time::Instant;

use anyhow::Result;
use clap::Args;
use kakeya_runtime::{Sampler, Sampling};
use kakeya_runtime::{Session, Want};
use serde::Serialize;

use crate::common::{ModelArgs, SamplingArgs};
use crate::kv::{KvArgs, KvRun};

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
    /// Compare AR with speculative decoding using this DFlash drafter folder (instead of the
    /// pp/tg tests), over `--prompts` with `--gen-tokens` new tokens each.
    #[arg(long)]
    pub drafter: Option<std::path::PathBuf>,
    /// Compare AR with speculative decoding whose drafts are the AR output itself (every draft
    /// accepted): the engine's ceiling and overhead.
    #[arg(long, conflicts_with = "drafter")]
    pub replay_drafts: bool,
    /// What drafts in the speculative comparison: `dflash`, `ngram` (needs no drafter) or
    /// `combined` (default with --drafter).
    #[arg(long, conflicts_with = "replay_drafts")]
    pub draft: Option<crate::draft::DraftKind>,
    /// Tokens per speculative block, fixed (default: blocks adapt up to the drafter's
    /// `block_size`, or 8).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Verify a tree of drafts per block instead of one chain: the combined proposer's
    /// sources merged (the drafter's top 4 per position where it drafts, every earlier
    /// occurrence of the tail, the table), as many rows as the block; up to 16 rows, CPU only.
    #[arg(long, conflicts_with_all = ["replay_drafts", "draft"])]
    pub tree: bool,
    /// Prompts for the speculative comparison, JSON lines `{"text": ...}` (default: 20 built-in).
    #[arg(long)]
    pub prompts: Option<std::path::PathBuf>,
    /// Tokens in the context before the tests (llama-bench's `-d`): pp and tg run at this
    /// depth, from a copy of one prefilled context; its own prefill is reported too.
    #[arg(long, default_value_t = 0)]
    pub depth: usize,
    /// Sequences decoded together in the tg test (llama-batched-bench's `-npl`): each step is
    /// one stacked forward of one token per sequence, as the server batches concurrent
    /// requests (each continues one of the built-in prompts); tg reports their aggregate
    /// tokens/s.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// How the tg test chooses its tokens (default greedy): `--temperature` above 0 samples
    /// each step (on a GPU, on the device: only the ids come back).
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub table: crate::ngram::TableArgs,
    #[command(flatten)]
    pub kv: KvArgs,
}

#[derive(Debug, Serialize)]
struct Figure {
    test: String,
    tokens: usize,
    runs_tok_s: Vec<f64>,
    median_tok_s: f64,
}

/// Median of the runs (mean of the middle two for an even count; 0 for none).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
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
        a.runs > 0 && a.prompt_tokens > 0 && a.gen_tokens > 0 && a.batch > 0,
        "--runs, --prompt-tokens, --gen-tokens and --batch must be positive"
    );
    let sampling = a.sampling.sampling()?;
    let spec = a.drafter.is_some() || a.replay_drafts || a.draft.is_some();
    anyhow::ensure!(
        !spec || sampling == Sampling::Greedy,
        "--temperature applies to the pp/tg tests; the speculative comparison is greedy"
    );
    let (model, tok) = a.model.load()?;
    if spec {
        return run_spec(&a, &model, &tok);
    }
    let kv = KvRun::prepare(&a.kv, &a.model, &model, None, None)?;
    let prompt = synthetic_prompt(a.prompt_tokens, model.config.vocab_size, tok.bos);
    let picker = Sampler::new(sampling.clone());
    // The depth context is prefilled once (timed: a prompt of `depth` tokens from empty
    // caches); every run's pp and tg tests start from a copy of it, as llama-bench's `-d`
    // does (a copy shares the buffers until it writes them).
    let base = if a.depth > 0 {
        let context = synthetic_prompt(a.depth, model.config.vocab_size, tok.bos);
        let mut s = Session::with_kv(&model, kv.setup())?;
        let t = Instant::now();
        let first = picker.pick_scores(&s.run_for(&context, 512, &picker)?, context.len());
        let rate = a.depth as f64 / t.elapsed().as_secs_f64();
        tracing::info!(depth = a.depth, rate, "depth context prefilled");
        Some((s, first, rate))
    } else {
        None
    };
    let fresh = || -> Result<(Session<'_>, u32)> {
        Ok(match &base {
            Some((s, first, _)) => (s.clone(), *first),
            None => (Session::with_kv(&model, kv.setup())?, tok.bos),
        })
    };
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
        // Prefill: the whole prompt after the depth context (if any).
        let (mut s, _) = fresh()?;
        let t = Instant::now();
        s.run(&prompt, a.prompt_tokens)?;
        let pp_rate = a.prompt_tokens as f64 / t.elapsed().as_secs_f64();
        drop(s);
        // Decode: gen_tokens steps of `batch` sequences (one token each) after the depth
        // context, greedy unless sampling was asked for. Batched sequences each continue
        // one of the built-in prompts, as concurrent requests would.
        let mut seqs = Vec::with_capacity(a.batch);
        let mut next = Vec::with_capacity(a.batch);
        for b in 0..a.batch {
            let (mut s, mut first) = fresh()?;
            if a.batch > 1 {
                let prompts = &crate::bench_spec::DEFAULT_PROMPTS;
                let ctx = tok.encode(prompts[b % prompts.len()])?;
                let ctx = if base.is_some() {
                    ctx
                } else {
                    [vec![tok.bos], ctx].concat()
                };
                let end = s.len() + ctx.len();
                first = picker.pick_scores(&s.run_for(&ctx, 512, &picker)?, end);
            }
            seqs.push(s);
            next.push(first);
        }
        let t = Instant::now();
        for _ in 0..a.gen_tokens {
            if a.batch == 1 {
                let s = &mut seqs[0];
                next[0] = picker.pick_scores(&s.run_for(&[next[0]], 1, &picker)?, s.len());
            } else {
                let mut refs: Vec<&mut Session<'_>> = seqs.iter_mut().collect();
                let chunks: Vec<&[u32]> = next.iter().map(std::slice::from_ref).collect();
                let wants = vec![Want::Next(&picker); a.batch];
                let verified = Session::run_batch(&mut refs, &chunks, &wants)?;
                for ((n, v), s) in next.iter_mut().zip(verified).zip(&seqs) {
                    let sc = v.into_scores().expect("every session ran its next token");
                    *n = picker.pick_scores(&sc, s.len());
                }
            }
        }
        let tg_rate = (a.batch * a.gen_tokens) as f64 / t.elapsed().as_secs_f64();
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
    let depth_rate = base.map(|(_, _, rate)| rate);
    let figures = figures(&a, &sampling, (pp, tg), depth_rate);
    print_figures(&a, kv.policy, &figures)
}

/// The table's rows: pp and tg (medians of the measured runs), and the depth context's
/// prefill when there is one.
fn figures(
    a: &BenchArgs,
    sampling: &Sampling,
    (pp, tg): (Vec<f64>, Vec<f64>),
    depth_rate: Option<f64>,
) -> Vec<Figure> {
    let at_depth = if a.depth > 0 {
        format!(" @ d{}", a.depth)
    } else {
        String::new()
    };
    let mut figures = vec![
        Figure {
            test: format!("pp{}{at_depth}", a.prompt_tokens),
            tokens: a.prompt_tokens,
            median_tok_s: median(pp.clone()),
            runs_tok_s: pp,
        },
        Figure {
            test: format!(
                "tg{}{at_depth}{}{}",
                a.gen_tokens,
                if a.batch > 1 {
                    format!(" × {} sequences (aggregate)", a.batch)
                } else {
                    String::new()
                },
                match sampling {
                    Sampling::Greedy => String::new(),
                    Sampling::Sample {
                        temperature,
                        top_k,
                        top_p,
                        ..
                    } => format!(", sampled (T {temperature}, top-k {top_k}, top-p {top_p})"),
                }
            ),
            tokens: a.batch * a.gen_tokens,
            median_tok_s: median(tg.clone()),
            runs_tok_s: tg,
        },
    ];
    if let Some(rate) = depth_rate {
        // The depth context itself: a prompt of `depth` tokens from empty caches (one run).
        figures.push(Figure {
            test: format!("pp{} (the depth context, one run)", a.depth),
            tokens: a.depth,
            median_tok_s: rate,
            runs_tok_s: vec![rate],
        });
    }
    figures
}

/// Prints the figures as a Markdown table, or as JSON with `--json`.
fn print_figures(
    a: &BenchArgs,
    policy: kakeya_runtime::KvPolicy,
    figures: &[Figure],
) -> Result<()> {
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "device": format!("{:?}", a.model.device),
                "kernel": format!("{:?}", a.model.kernel).to_lowercase(),
                "kv_policy": policy,
                "results": figures
            }))?
        );
    } else {
        println!("| test | tok/s (median of {}) | runs |", a.runs);
        println!("|---|---|---|");
        for f in figures {
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

/// The AR-vs-speculative comparison.
fn run_spec(
    a: &BenchArgs,
    model: &kakeya_models::GemmaModel,
    tok: &kakeya_weights::Tokenizer,
) -> Result<()> {
    let kind = a.draft.unwrap_or(crate::draft::DraftKind::Combined);
    let drafter = match &a.drafter {
        Some(dir) if kind.needs_drafter() => Some(crate::common::load_drafter(dir, model)?),
        _ => None,
    };
    let kv = KvRun::prepare(
        &a.kv,
        &a.model,
        model,
        a.drafter.as_deref(),
        drafter.as_ref(),
    )?;
    let longest = drafter
        .as_ref()
        .map_or(crate::draft::NGRAM_BLOCK, |d| d.block_size());
    let spec = crate::draft::schedule(a.block_size, longest);
    crate::common::check_block_size(spec.block_size, model.config.max_position_embeddings)?;
    let prompts = crate::bench_spec::prompts_or_default(a.prompts.as_deref())?;
    let drafts = if a.replay_drafts {
        crate::bench_spec::Drafts::Replay
    } else if a.tree {
        let table = a.table.load(&a.model, model.config.vocab_size, kind)?;
        crate::bench_spec::Drafts::Tree(drafter.as_ref(), table)
    } else {
        let table = a.table.load(&a.model, model.config.vocab_size, kind)?;
        kind.proposer(drafter.as_ref(), table.clone())?; // a kind without its drafter: refused now
        crate::bench_spec::Drafts::Kind(kind, drafter.as_ref(), table)
    };
    let b = crate::bench_spec::run(
        model,
        tok,
        drafts,
        &prompts,
        (spec, kv.setup()),
        a.gen_tokens,
        a.runs,
        a.warmup,
    )?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&b)?);
    } else {
        crate::bench_spec::print(&b);
    }
    Ok(())
}
