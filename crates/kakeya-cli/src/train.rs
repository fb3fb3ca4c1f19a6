//! `kakeya train drafter`: trains a DFlash drafter from a capture dataset, with a progress bar,
//! periodic checkpoints (`--resume` continues the last one) and a final summary.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use kakeya_capture::job::sha256_path;
use kakeya_models::Gemma3Model;
use kakeya_train::{DrafterTrainConfig, Event, TrainOptions};
use kakeya_weights::Checkpoint;

use crate::common::DeviceKind;

/// Arguments of `kakeya train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    #[command(subcommand)]
    pub command: TrainCommand,
}

/// What to train.
#[derive(Subcommand, Debug)]
pub enum TrainCommand {
    /// A DFlash drafter for a verifier, from a `kakeya capture` dataset.
    Drafter {
        /// The training config (`configs/train/drafter-<name>.toml`).
        #[arg(long)]
        config: PathBuf,
        /// Continue from the run folder's last saved state (same config and dataset).
        #[arg(long)]
        resume: bool,
        /// Compute device.
        #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
        device: DeviceKind,
    },
}

/// Runs `kakeya train`.
pub fn run(a: TrainArgs) -> Result<()> {
    let TrainCommand::Drafter {
        config,
        resume,
        device,
    } = a.command;
    let cfg = DrafterTrainConfig::load(&config)?;
    let device = device.device()?;
    let vpath = &cfg.model.verifier;
    let ck =
        Checkpoint::load(vpath).with_context(|| format!("loading verifier {}", vpath.display()))?;
    let verifier = Gemma3Model::from_checkpoint(ck, &device)?;
    let sha = sha256_path(vpath)?;
    let prep = kakeya_train::prepare(&cfg, &verifier, &sha)?;
    eprintln!(
        "{} training / {} held-out sequences; target layers {:?}; draft vocabulary {}",
        prep.data.train.len(),
        prep.data.heldout.len(),
        prep.config.target_layer_ids,
        prep.d2t.as_ref().map_or(prep.config.vocab_size, Vec::len),
    );
    let bar = indicatif::ProgressBar::new(cfg.train.steps as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "train [{bar:30}] {pos}/{len} steps, {elapsed} elapsed, eta {eta} {msg}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let mut smooth: Option<f64> = None;
    let mut accept = String::from("-");
    let opts = TrainOptions {
        resume,
        device,
        stop_after: None,
    };
    let report = kakeya_train::train_drafter(&cfg, &verifier, prep, &opts, &mut |ev| match ev {
        Event::Started { start, .. } => bar.set_position(start as u64),
        Event::Step(s) => {
            let l = smooth.map_or(s.loss, |m| 0.95 * m + 0.05 * s.loss);
            smooth = Some(l);
            bar.set_position(s.step as u64);
            bar.set_message(format!(
                "| loss {l:.3} | lr {:.2e} | {:.2} s/step | held-out acceptance {accept}",
                s.lr, s.secs
            ));
        }
        Event::Eval(e) => {
            accept = format!("{:.2}", e.acceptance_length);
            bar.println(format!(
                "step {}: held-out loss {:.3}, acceptance length {:.3} (per slot {:?})",
                e.step,
                e.loss,
                e.acceptance_length,
                e.per_slot_acceptance
                    .iter()
                    .map(|x| (x * 100.0).round() / 100.0)
                    .collect::<Vec<_>>()
            ));
        }
        Event::Saved(_) => {}
    })?;
    bar.finish_and_clear();
    let last = report.evals.last().context("no evaluation recorded")?;
    eprintln!(
        "trained {} parameters for {} steps ({:.2} s/step median on {}); held-out acceptance length {:.3} at block {}; drafter → {}; report and curves → {}",
        report.parameters,
        cfg.train.steps,
        report.secs_per_step,
        report.device,
        last.acceptance_length,
        cfg.model.block_size,
        report.export.display(),
        cfg.output.dir.display()
    );
    Ok(())
}
