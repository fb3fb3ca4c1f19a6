//! `kakeya capture`: the capture job with progress bars and a final summary.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use kakeya_capture::job::sha256_path;
use kakeya_capture::schema::ModelInfo;
use kakeya_capture::{CaptureConfig, Models, Progress, RunOptions};
use kakeya_models::GemmaModel;
use kakeya_weights::{Checkpoint, Tokenizer};

use crate::common::{DeviceKind, load_drafter};

/// Arguments of `kakeya capture`.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct CaptureArgs {
    #[command(subcommand)]
    pub command: Option<CaptureCommand>,
    /// The capture config (`configs/capture/<name>.toml`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Run only shards `index % n == i` of the job, as `i/n`.
    #[arg(long, default_value = "0/1")]
    pub shard: String,
    /// Continue an existing dataset: finished shards are kept, the rest is (re)written.
    #[arg(long)]
    pub resume: bool,
    /// Compute device.
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
}

/// `kakeya capture merge`.
#[derive(Subcommand, Debug)]
pub enum CaptureCommand {
    /// Merge the datasets of `--shard i/n` runs of one config into one folder.
    Merge {
        /// Output folder.
        #[arg(long)]
        out: PathBuf,
        /// Input dataset folders.
        inputs: Vec<PathBuf>,
    },
}

fn parse_shard(s: &str) -> Result<(usize, usize)> {
    let (i, n) = s
        .split_once('/')
        .with_context(|| format!("--shard {s}: expected i/n, e.g. 0/2"))?;
    let (i, n): (usize, usize) = (
        i.trim()
            .parse()
            .with_context(|| format!("--shard {s}: bad i"))?,
        n.trim()
            .parse()
            .with_context(|| format!("--shard {s}: bad n"))?,
    );
    if n == 0 || i >= n {
        bail!("--shard {s}: need 0 ≤ i < n");
    }
    Ok((i, n))
}

/// Runs `kakeya capture`.
pub fn run(a: CaptureArgs) -> Result<()> {
    if let Some(CaptureCommand::Merge { out, inputs }) = &a.command {
        let m = kakeya_capture::merge(out, inputs)?;
        eprintln!(
            "merged {} of {} shards into {}",
            m.shards.len(),
            m.shards_total,
            out.display()
        );
        return Ok(());
    }
    let cfg_path = a.config.clone().context("--config is required")?;
    let shard = parse_shard(&a.shard)?;
    let cfg = CaptureConfig::load(&cfg_path)?;
    let device = a.device.device()?;
    let vpath = &cfg.model.verifier;
    let ck =
        Checkpoint::load(vpath).with_context(|| format!("loading verifier {}", vpath.display()))?;
    let tpath = cfg.model.tokenizer.clone().unwrap_or_else(|| {
        if vpath.is_dir() {
            vpath.join("tokenizer.json")
        } else {
            vpath.with_file_name("tokenizer.json")
        }
    });
    let tok = Tokenizer::load(&tpath, ck.config.vocab_size)?;
    let model = GemmaModel::from_checkpoint(ck, &device)?;
    let drafter = match &cfg.model.drafter {
        Some(d) => Some(load_drafter(d, &model)?),
        None => None,
    };
    let info = |p: &PathBuf| -> Result<ModelInfo> {
        Ok(ModelInfo {
            path: p.clone(),
            sha256: sha256_path(p)?,
        })
    };
    let models = Models {
        verifier: &model,
        tokenizer: &tok,
        drafter: drafter.as_ref(),
        verifier_info: info(vpath)?,
        tokenizer_info: info(&tpath)?,
        drafter_info: cfg.model.drafter.as_ref().map(info).transpose()?,
    };
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "capture [{bar:30}] {pos}/{len} sequences, {elapsed} elapsed, eta {eta} {msg}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let t0 = std::time::Instant::now();
    let (mut rows, mut tokens, mut bytes) = (0usize, 0usize, 0u64);
    let summary = kakeya_capture::run(
        &cfg,
        &cfg_path,
        &models,
        RunOptions {
            shard,
            resume: a.resume,
        },
        &mut |p| match p {
            Progress::Start { sequences } => bar.set_length(sequences as u64),
            Progress::Sequence { rows: r, tokens: t } => {
                rows += r;
                tokens += t;
                bar.inc(1);
                bar.set_message(format!(
                    "| {:.0} tok/s | {} rows | {:.1} MiB written",
                    tokens as f64 / t0.elapsed().as_secs_f64(),
                    rows,
                    bytes as f64 / (1 << 20) as f64
                ));
            }
            Progress::Shard { bytes: b, .. } => bytes += b,
        },
    )?;
    bar.finish_and_clear();
    eprintln!(
        "captured {} sequences, {} positions into {} shard(s) ({} already done) in {:.1} s: {:.1} positions/s, {:.0} bytes/position, {:.1} MiB → {}",
        summary.sequences,
        summary.rows,
        summary.shards,
        summary.skipped_shards,
        summary.secs,
        summary.rows as f64 / summary.secs.max(1e-9),
        summary.bytes as f64 / summary.rows.max(1) as f64,
        summary.bytes as f64 / (1 << 20) as f64,
        cfg.output.dir.display()
    );
    Ok(())
}
