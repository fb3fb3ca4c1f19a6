//! `kakeya train drafter` and `kakeya train f-theta`: train a DFlash drafter or f_θ from a
//! capture dataset, with a progress bar, periodic checkpoints (`--resume` continues the last
//! one) and a final summary.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use kakeya_capture::job::sha256_path;
use kakeya_models::GemmaModel;
use kakeya_train::ftheta::{FEvent, FThetaTrainConfig};
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
        /// Continue from the run folder's last saved state (same config and dataset); with
        /// nothing saved yet, start fresh.
        #[arg(long)]
        resume: bool,
        /// Compute device.
        #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
        device: DeviceKind,
    },
    /// f_θ (drafter context K/V → verifier K/V) from a `kakeya capture` dataset that holds the
    /// drafter's K/V and the verifier's per-layer tensors.
    #[command(name = "f-theta")]
    FTheta {
        /// The training config (`configs/train/f-theta-<name>.toml`).
        #[arg(long)]
        config: PathBuf,
        /// Continue from the run folder's last saved state (same config and dataset); with
        /// nothing saved yet, start fresh.
        #[arg(long)]
        resume: bool,
        /// Compute device.
        #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
        device: DeviceKind,
    },
}

/// Runs `kakeya train`.
pub fn run(a: TrainArgs) -> Result<()> {
    match a.command {
        TrainCommand::Drafter {
            config,
            resume,
            device,
        } => drafter(config, resume, device),
        TrainCommand::FTheta {
            config,
            resume,
            device,
        } => f_theta(config, resume, device),
    }
}

fn progress_bar(steps: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(steps as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "train [{bar:30}] {pos}/{len} steps, {elapsed} elapsed, eta {eta} {msg}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar
}

/// Prints above the bar, or plainly when the bar is hidden (output not a terminal).
fn say(bar: &indicatif::ProgressBar, msg: String) {
    if bar.is_hidden() {
        eprintln!("{msg}");
    } else {
        bar.println(msg);
    }
}

fn f_theta(config: PathBuf, resume: bool, device: DeviceKind) -> Result<()> {
    let cfg = FThetaTrainConfig::load(&config)?;
    let device = device.device()?;
    let vpath = &cfg.model.verifier;
    let ck =
        Checkpoint::load(vpath).with_context(|| format!("loading verifier {}", vpath.display()))?;
    let verifier = GemmaModel::from_checkpoint(ck, &device)?;
    let vsha = sha256_path(vpath)?;
    let dsha = sha256_path(&cfg.model.drafter)?;
    let setup = kakeya_train::ftheta::prepare(&cfg, &verifier, &vsha, &dsha)?;
    eprintln!(
        "{} training / {} held-out sequences; f_θ rank {}, input {} (drafter layers {:?}), {} verifier layers; loss {}",
        setup.info.train.len(),
        setup.info.heldout.len(),
        setup.f_theta.rank,
        setup.f_theta.in_dim(),
        setup.f_theta.drafter_layers,
        setup.f_theta.verifier_layers,
        cfg.loss.kind.name(),
    );
    let bar = progress_bar(cfg.train.steps);
    let mut smooth: Option<f64> = None;
    let mut ratio = String::from("-");
    let opts = TrainOptions {
        resume,
        device,
        stop_after: None,
    };
    let report = kakeya_train::ftheta::train_f_theta(&cfg, &verifier, setup, &opts, &mut |ev| {
        match ev {
            FEvent::Started { start, .. } => bar.set_position(start as u64),
            FEvent::Step(s) => {
                let l = smooth.map_or(s.loss, |m| 0.95 * m + 0.05 * s.loss);
                smooth = Some(l);
                bar.set_position(s.step as u64);
                bar.set_message(format!(
                    "| loss {l:.4} | lr {:.2e} | |g| {:.2} | {:.2} s/step | held-out mseO ratio {ratio}",
                    s.lr, s.grad_norm, s.secs
                ));
            }
            FEvent::Eval(e) => {
                ratio = format!("{:.3}/{:.3}", e.sliding.mse_o_ratio, e.global.mse_o_ratio);
                say(
                    &bar,
                    format!(
                        "step {}: held-out loss {:.4}; sliding / global: mseO ratio {:.4} / {:.4}, kDir {:.4} / {:.4}, vDir {:.4} / {:.4}, kMag {:.4} / {:.4}, vMag {:.4} / {:.4}, K rel-MSE {:.4} / {:.4}, V rel-MSE {:.4} / {:.4}",
                        e.step,
                        e.loss,
                        e.sliding.mse_o_ratio,
                        e.global.mse_o_ratio,
                        e.sliding.kdir,
                        e.global.kdir,
                        e.sliding.vdir,
                        e.global.vdir,
                        e.sliding.kmag,
                        e.global.kmag,
                        e.sliding.vmag,
                        e.global.vmag,
                        e.sliding.k_rel_mse,
                        e.global.k_rel_mse,
                        e.sliding.v_rel_mse,
                        e.global.v_rel_mse,
                    ),
                );
            }
            FEvent::Saved(_) => {}
            FEvent::Fitting { done, total } => {
                bar.set_message(format!(
                    "| least-squares start: {done}/{total} training sequences read"
                ));
            }
        }
    })?;
    bar.finish_and_clear();
    let d = &report.final_diagnostics;
    eprintln!(
        "trained {} parameters for {} steps ({:.2} s/step median on {}); held-out mseO/mean|O|²: sliding {:.4}, global {:.4} (floor of the recomputation {}); f_θ → {}; report and curves → {}",
        report.parameters,
        report.steps_done,
        report.secs_per_step,
        report.device,
        d["sliding"].mse_o_ratio,
        d["global"].mse_o_ratio,
        report.floor.as_ref().map_or("-".to_string(), |f| format!(
            "{:.1e} / {:.1e}",
            f.sliding.mse_o_ratio, f.global.mse_o_ratio
        )),
        report.export.display(),
        cfg.output.dir.display()
    );
    Ok(())
}

fn drafter(config: PathBuf, resume: bool, device: DeviceKind) -> Result<()> {
    let cfg = DrafterTrainConfig::load(&config)?;
    let device = device.device()?;
    let vpath = &cfg.model.verifier;
    let ck =
        Checkpoint::load(vpath).with_context(|| format!("loading verifier {}", vpath.display()))?;
    let verifier = GemmaModel::from_checkpoint(ck, &device)?;
    let sha = sha256_path(vpath)?;
    let prep = kakeya_train::prepare(&cfg, &verifier, &sha)?;
    eprintln!(
        "{} training / {} held-out sequences; target layers {:?}; draft vocabulary {}",
        prep.data.train.len(),
        prep.data.heldout.len(),
        prep.config.target_layer_ids,
        prep.d2t.as_ref().map_or(prep.config.vocab_size, Vec::len),
    );
    let bar = progress_bar(cfg.train.steps);
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
            say(
                &bar,
                format!(
                    "step {}: held-out loss {:.3}, acceptance length {:.3} (per slot {:?})",
                    e.step,
                    e.loss,
                    e.acceptance_length,
                    e.per_slot_acceptance
                        .iter()
                        .map(|x| (x * 100.0).round() / 100.0)
                        .collect::<Vec<_>>()
                ),
            );
        }
        Event::Saved(_) | Event::Fitting { .. } => {}
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
