//! `kakeya`: the command-line front end. Parses arguments, picks the device, calls the
//! libraries.

// Printing results to stdout is this binary's job (libraries use `tracing`).
#![allow(clippy::print_stdout)]

mod bench;
mod bench_spec;
mod capture;
mod common;
mod convert;
mod draft;
mod eval;
mod eval_prompts;
mod eval_report;
mod eval_trees;
mod infer;
mod kv;
mod ngram;
mod serve;
mod train;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Kakeya: fast decoding with a bounded KV cache.
#[derive(Parser, Debug)]
#[command(name = "kakeya", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text with a Gemma model.
    Infer(infer::InferArgs),
    /// Measure prefill and decode throughput, or AR vs speculative decoding.
    Bench(bench::BenchArgs),
    /// Capture verifier/drafter tensors over a prompt corpus to Parquet.
    Capture(capture::CaptureArgs),
    /// Write a GGUF model out as a Hugging Face safetensors folder.
    Convert(convert::ConvertArgs),
    /// Train a model component (the DFlash drafter, f_θ).
    Train(train::TrainArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(serve::ServeArgs),
    /// Evaluate the KV modes (needle-in-a-haystack recall against the full cache).
    Eval(eval::EvalArgs),
    /// Build the static n-gram table that prompt-lookup drafting falls back on.
    Ngram(ngram::NgramArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KAKEYA_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    // The whole command runs on a worker of the rayon pool: each of a decode step's ~130 kernel
    // calls then splits from inside the pool (the other worker steals half) instead of handing
    // the work over from the main thread and sleeping until it is done. Workers get the main
    // thread's stack size (parsers and autodiff graphs recurse).
    if let Err(e) = rayon::ThreadPoolBuilder::new()
        .stack_size(8 << 20)
        .build_global()
    {
        tracing::warn!("rayon pool: {e}");
    }
    let result = rayon::scope(move |_| run(cli));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Infer(a) => infer::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Capture(a) => capture::run(a),
        Command::Train(a) => train::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Ngram(a) => ngram::run(a),
        Command::Eval(a) => match a.what {
            eval::EvalWhat::Niah(n) => eval::run(n),
            eval::EvalWhat::Trees(t) => eval_trees::run(t),
        },
    }
}
