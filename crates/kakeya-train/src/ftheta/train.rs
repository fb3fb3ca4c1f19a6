//! The f_θ training loop: checks, streamed batches, AdamW steps with a global clip and a
//! cosine schedule, held-out evaluation, checkpoints, resume, export, report and curves.
//!
//! A step draws `sequences_per_step` training sequences and, in each, `queries_per_sequence`
//! query positions from an RNG seeded by `(seed, step)`; a reader thread streams those
//! sequences from the Parquet shards ahead of the step that needs them. f_θ predicts raw K/V at
//! every position of a sequence; the loss is averaged over sequences and verifier layers.
//! Resuming is exact (the state holds weights, Adam moments and history in f32).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Instant;

use burn::tensor::{Device, Tensor};
use kakeya_capture::Dataset;
use kakeya_models::Gemma3Model;
use kakeya_weights::ftheta::{FTHETA_FORMAT, FTHETA_VERSION, FThetaInputs, ModelRef};
use kakeya_weights::{FThetaConfig, HostTensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::config::{FThetaInit, FThetaTrainConfig};
use super::data::{self, DataInfo, SeqData};
use super::loss::Diagnostics;
use super::lstsq::{Normal, params_from_fits};
use super::params::FThetaParams;
use super::step::{batch_loss, evaluate, frozen_layers, leaves, optimizer_step};
use crate::error::{Result, TrainError};
use crate::optim::Moments;
use crate::train::{StepRecord, TrainOptions};
use crate::{plot, state};

/// One held-out evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FEval {
    /// Steps done when evaluated.
    pub step: usize,
    /// The configured loss on the held-out sequences.
    pub loss: f64,
    /// Diagnostics of sliding-window layers and of global layers.
    pub sliding: Diagnostics,
    /// See `sliding`.
    pub global: Diagnostics,
    /// Per verifier layer.
    pub per_layer: Vec<Diagnostics>,
    /// Held-out sequences and query positions used.
    pub sequences: usize,
    /// See `sequences`.
    pub queries: usize,
}

/// What [`train_f_theta`] reports as it goes.
#[derive(Debug, Clone)]
pub enum FEvent {
    /// Training starts at `start` of `steps`.
    Started {
        /// Steps already done (resume).
        start: usize,
        /// Total steps.
        steps: usize,
    },
    /// A step finished.
    Step(StepRecord),
    /// An evaluation finished.
    Eval(FEval),
    /// The state was saved after this many steps.
    Saved(usize),
    /// The least-squares start has read `done` of `total` training sequences.
    Fitting {
        /// Sequences read.
        done: usize,
        /// Training sequences.
        total: usize,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct State {
    step: usize,
    fingerprint: String,
    steps: Vec<StepRecord>,
    evals: Vec<FEval>,
    floor: Option<FEval>,
}

/// `report.json`.
#[derive(Debug, Clone, Serialize)]
pub struct FThetaReport {
    /// The config.
    pub config: FThetaTrainConfig,
    /// f_θ's shape and owners as exported.
    pub f_theta: FThetaConfig,
    /// Trainable parameters.
    pub parameters: usize,
    /// Dataset summary.
    pub data: serde_json::Value,
    /// Device.
    pub device: String,
    /// Median seconds per step of this invocation.
    pub secs_per_step: f64,
    /// Steps done.
    pub steps_done: usize,
    /// The attention-output error of the verifier's own K/V through the same recomputation
    /// (the f16 storage floor; 0 for non-attention losses).
    pub floor: Option<FEval>,
    /// Held-out evaluations, the first before any training.
    pub evals: Vec<FEval>,
    /// The last evaluation's diagnostics per layer type.
    pub final_diagnostics: BTreeMap<String, Diagnostics>,
    /// Per-step records (the loss curve).
    pub steps: Vec<StepRecord>,
    /// Exported f_θ folder.
    pub export: PathBuf,
}

/// Checked inputs, before the first step.
pub struct Setup {
    /// Dataset layout and split.
    pub info: DataInfo,
    /// f_θ's shape and owners.
    pub f_theta: FThetaConfig,
    ds: Dataset,
    fingerprint: String,
}

/// Checks the dataset against the config, the verifier and the drafter (content hashes as
/// `kakeya capture` computes them). Errors here come before anything is trained or written.
pub fn prepare(
    cfg: &FThetaTrainConfig,
    verifier: &Gemma3Model,
    verifier_sha: &str,
    drafter_sha: &str,
) -> Result<Setup> {
    let v = &verifier.config;
    let layers = v.num_hidden_layers;
    let kv = v.num_key_value_heads * v.head_dim;
    let ds = Dataset::open(&cfg.data.dataset)?;
    let info = data::check(
        &ds,
        verifier_sha,
        drafter_sha,
        layers,
        cfg.loss.kind.needs_attention(),
        cfg.data.heldout_every,
    )?;
    if info.kv_dim != kv {
        return Err(TrainError::invalid(
            &info.dir,
            format!(
                "the dataset's raw K width is {}, the verifier's is {kv}",
                info.kv_dim
            ),
        ));
    }
    let f_theta = FThetaConfig {
        format: FTHETA_FORMAT.into(),
        version: FTHETA_VERSION,
        verifier: ModelRef {
            path: cfg.model.verifier.clone(),
            sha256: verifier_sha.into(),
        },
        drafter: ModelRef {
            path: cfg.model.drafter.clone(),
            sha256: drafter_sha.into(),
        },
        drafter_layers: info.drafter_layers.clone(),
        drafter_kv_dim: info.drafter_kv_dim,
        inputs: cfg.model.inputs,
        rank: cfg.rank(),
        verifier_layers: layers,
        verifier_kv_dim: kv,
        bias: cfg.model.bias,
        loss: cfg.loss.kind.name().into(),
    };
    if let Some(p) = &cfg.model.init_from {
        FThetaParams::from_dir(f_theta.clone(), p, &Device::flex())?;
    }
    let shards: Vec<&str> = ds
        .manifest()
        .shards
        .iter()
        .map(|s| s.sha256.as_str())
        .collect();
    let fingerprint = serde_json::to_string(&(
        &cfg.data,
        &cfg.model,
        &cfg.loss,
        &cfg.train,
        verifier_sha,
        drafter_sha,
        &shards,
    ))
    .expect("fingerprint serialises");
    Ok(Setup {
        info,
        f_theta,
        ds,
        fingerprint,
    })
}

/// The distinct training sequences of 0-based step `t` (seeded by the config and `t`).
fn pick(cfg: &FThetaTrainConfig, info: &DataInfo, t: usize) -> Vec<usize> {
    let mut rng =
        StdRng::seed_from_u64(cfg.train.seed ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let want = cfg.train.sequences_per_step.min(info.train.len());
    let mut chosen = Vec::with_capacity(want);
    while chosen.len() < want {
        let s = info.train[rng.random_range(0..info.train.len())];
        if !chosen.contains(&s) {
            chosen.push(s);
        }
    }
    chosen
}

/// The least-squares start (see [`super::lstsq`]): one pass over the training sequences'
/// drafter K/V and raw verifier K/V.
fn least_squares(
    cfg: &FThetaTrainConfig,
    info: &DataInfo,
    ds: &Dataset,
    f_theta: &FThetaConfig,
    device: &Device,
    on_event: &mut dyn FnMut(FEvent),
) -> Result<FThetaParams> {
    let raw_only = DataInfo {
        attention: false,
        ..info.clone()
    };
    let (inp, out) = (
        f_theta.in_dim(),
        f_theta.verifier_layers * f_theta.verifier_kv_dim,
    );
    let mut nk = Normal::new(inp, out, f_theta.bias);
    let mut nv = Normal::new(inp, out, f_theta.bias);
    let total = info.train.len();
    for (i, &seq) in info.train.iter().enumerate() {
        let s = raw_only.read(ds, seq)?;
        let rows_of = |k: bool| -> Vec<&[f32]> {
            s.layers
                .iter()
                .map(|l| if k { &l.k[..] } else { &l.v[..] })
                .collect()
        };
        let (yk, yv) = (
            data::side_by_side(&rows_of(true), s.len, f_theta.verifier_kv_dim),
            data::side_by_side(&rows_of(false), s.len, f_theta.verifier_kv_dim),
        );
        match f_theta.inputs {
            FThetaInputs::Own => {
                nk.add(&s.dk, &yk, s.len, device);
                nv.add(&s.dv, &yv, s.len, device);
            }
            FThetaInputs::Both => {
                let w = f_theta.drafter_layers.len() * f_theta.drafter_kv_dim;
                let x = data::side_by_side(&[&s.dk, &s.dv], s.len, w);
                nk.add(&x, &yk, s.len, device);
                nv.add(&x, &yv, s.len, device);
            }
        }
        on_event(FEvent::Fitting { done: i + 1, total });
    }
    let singular = || {
        TrainError::invalid(
            &info.dir,
            "the least-squares start is singular (constant drafter K/V?); set model.init_ridge > 0 or model.init = \"random\"",
        )
    };
    let rank = f_theta.rank;
    let kf = nk
        .solve_rank(cfg.model.init_ridge, rank)
        .ok_or_else(singular)?;
    let vf = nv
        .solve_rank(cfg.model.init_ridge, rank)
        .ok_or_else(singular)?;
    tracing::info!(
        positions = nk.count(),
        ridge = cfg.model.init_ridge,
        "f_θ least-squares start fitted"
    );
    Ok(params_from_fits(f_theta.clone(), &kf, &vf, device))
}

/// Trains (or resumes) f_θ as `cfg` says, exports it, and writes `report.json` and
/// `curves.png` into the run folder.
pub fn train_f_theta(
    cfg: &FThetaTrainConfig,
    verifier: &Gemma3Model,
    setup: Setup,
    opts: &TrainOptions,
    on_event: &mut dyn FnMut(FEvent),
) -> Result<FThetaReport> {
    let device = opts.device.clone();
    let ad = device.clone().autodiff();
    let Setup {
        info,
        f_theta,
        ds,
        fingerprint,
    } = setup;
    let state_dir = cfg.output.dir.join("state");
    let old_dir = cfg.output.dir.join("state.old");
    let (mut params, mut moments, mut st) = if opts.resume {
        let dir = if state_dir.is_dir() {
            &state_dir
        } else {
            &old_dir
        };
        load_state(dir, &f_theta, &fingerprint, &device)?
    } else {
        if state_dir.exists() || old_dir.exists() {
            return Err(TrainError::invalid(
                &cfg.output.dir,
                "a training state exists here; pass --resume to continue it or remove the folder",
            ));
        }
        let params = match (&cfg.model.init_from, cfg.model.init) {
            (Some(p), _) => FThetaParams::from_dir(f_theta.clone(), p, &device)?,
            (None, FThetaInit::Random) => {
                FThetaParams::init(f_theta.clone(), cfg.train.seed, &device)
            }
            (None, FThetaInit::LeastSquares) => {
                least_squares(cfg, &info, &ds, &f_theta, &device, on_event)?
            }
        };
        let moments = params
            .tensors
            .iter()
            .map(|(_, _, p)| Moments::zeros_like(p))
            .collect();
        let st = State {
            step: 0,
            fingerprint: fingerprint.clone(),
            steps: Vec::new(),
            evals: Vec::new(),
            floor: None,
        };
        (params, moments, st)
    };
    std::fs::create_dir_all(&cfg.output.dir).map_err(|e| TrainError::io(&cfg.output.dir, e))?;
    let frozen = frozen_layers(verifier, &device);
    let frozen_ad = frozen_layers(verifier, &ad);
    let held: Vec<SeqData> = info
        .heldout
        .iter()
        .map(|&s| info.read(&ds, s))
        .collect::<Result<_>>()?;
    let mut saturated: usize = held.iter().map(|s| s.saturated).sum();
    on_event(FEvent::Started {
        start: st.step,
        steps: cfg.train.steps,
    });
    let weights = |p: &FThetaParams| -> Vec<Tensor<2>> {
        p.tensors.iter().map(|(_, _, t)| t.clone()).collect()
    };
    if st.step == 0 && st.evals.is_empty() {
        let model = params.model(&weights(&params));
        if cfg.loss.kind.needs_attention() {
            st.floor = Some(evaluate(&model, &frozen, &held, cfg, 0, true));
        }
        let e = evaluate(&model, &frozen, &held, cfg, 0, false);
        on_event(FEvent::Eval(e.clone()));
        st.evals.push(e);
    }

    // The reader thread streams each step's sequences ahead of the step.
    let (tx, rx) = mpsc::sync_channel::<Result<(usize, Vec<SeqData>)>>(2);
    let reader = {
        let (cfg, info, ds) = (cfg.clone(), info.clone(), ds.clone());
        let start = st.step;
        std::thread::spawn(move || {
            for t in start..cfg.train.steps {
                let batch: Result<Vec<SeqData>> = pick(&cfg, &info, t)
                    .into_iter()
                    .map(|s| info.read(&ds, s))
                    .collect();
                let failed = batch.is_err();
                if tx.send(batch.map(|b| (t, b))).is_err() || failed {
                    return;
                }
            }
        })
    };

    let mut secs = Vec::new();
    let mut ran = 0;
    let mut last_saved: Option<usize> = (st.step > 0).then_some(st.step);
    let attention = cfg.loss.kind.needs_attention();
    while st.step < cfg.train.steps {
        let t = st.step;
        let (bt, batch) = rx
            .recv()
            .map_err(|_| TrainError::invalid(&info.dir, "the data reader stopped"))??;
        debug_assert_eq!(bt, t);
        let started = Instant::now();
        saturated += batch.iter().map(|s| s.saturated).sum::<usize>();
        let leaves = leaves(&params);
        let model = params.model(&leaves);
        let loss = batch_loss(&model, &frozen_ad, &batch, cfg, t, &ad);
        let loss_value = f64::from(loss.clone().into_scalar::<f32>());
        if !loss_value.is_finite() {
            return Err(TrainError::NonFinite {
                step: t + 1,
                value: loss_value,
                kept: last_saved
                    .map_or_else(|| "none was saved yet".to_string(), |s| format!("step {s}")),
                dir: state_dir.clone(),
            });
        }
        let (lr, norm) = optimizer_step(cfg, t, loss, &leaves, &mut params, &mut moments);
        st.step += 1;
        ran += 1;
        let rec = StepRecord {
            step: st.step,
            loss: loss_value,
            lr,
            grad_norm: norm,
            secs: started.elapsed().as_secs_f64(),
        };
        secs.push(rec.secs);
        on_event(FEvent::Step(rec.clone()));
        st.steps.push(rec);
        let last = st.step == cfg.train.steps;
        if st.step % cfg.output.eval_every == 0 || last {
            let model = params.model(&weights(&params));
            let e = evaluate(&model, &frozen, &held, cfg, st.step, false);
            on_event(FEvent::Eval(e.clone()));
            st.evals.push(e);
        }
        let stop = opts.stop_after.is_some_and(|n| ran >= n);
        if st.step % cfg.output.checkpoint_every == 0 || last || stop {
            save_state(&cfg.output.dir, &params, &moments, &st)?;
            last_saved = Some(st.step);
            on_event(FEvent::Saved(st.step));
        }
        if stop && !last {
            drop(rx);
            let _ = reader.join();
            return Err(TrainError::Interrupted(st.step));
        }
    }
    drop(rx);
    let _ = reader.join();
    if saturated > 0 {
        tracing::warn!(
            saturated,
            "non-finite values (f16 overflow) in the dataset were saturated to ±65504"
        );
    }
    let ck = params.to_checkpoint();
    state::replace_dir(&cfg.output.export, |dir| {
        ck.write_files(dir).map_err(TrainError::from)
    })?;
    secs.sort_by(f64::total_cmp);
    let median = secs.get(secs.len() / 2).copied().unwrap_or(0.0);
    let last = st.evals.last().cloned().expect("evaluated at the end");
    let mut final_diagnostics = BTreeMap::new();
    final_diagnostics.insert("sliding".to_string(), last.sliding);
    final_diagnostics.insert("global".to_string(), last.global);
    let report = FThetaReport {
        config: cfg.clone(),
        f_theta: params.config.clone(),
        parameters: params.count(),
        data: serde_json::json!({
            "dataset": cfg.data.dataset,
            "train_sequences": info.train.len(),
            "heldout_sequences": info.heldout.len(),
            "heldout_positions": held.iter().map(|s| s.len).sum::<usize>(),
            "drafter_layers": info.drafter_layers,
            "saturated_values": saturated,
        }),
        device: format!("{device:?}"),
        secs_per_step: median,
        steps_done: st.step,
        floor: st.floor.clone(),
        evals: st.evals.clone(),
        final_diagnostics,
        steps: st.steps.clone(),
        export: cfg.output.export.clone(),
    };
    let json = serde_json::to_string_pretty(&report).expect("report serialises");
    state::write_file_atomically(&cfg.output.dir.join("report.json"), json.as_bytes())?;
    let metric: Vec<(f64, f64)> = st
        .evals
        .iter()
        .map(|e| {
            let v = if attention {
                let n = e.per_layer.len().max(1) as f64;
                e.per_layer.iter().map(|d| d.mse_o_ratio).sum::<f64>() / n
            } else {
                e.loss
            };
            (e.step as f64, v)
        })
        .collect();
    let right = if attention {
        "HELD-OUT MSEO/MEAN O2"
    } else {
        "HELD-OUT LOSS"
    };
    let png = plot::two_panels(
        ("TRAIN LOSS", &plot::smoothed_loss(&st.steps)),
        (right, &metric),
    );
    state::write_file_atomically(&cfg.output.dir.join("curves.png"), &png)?;
    Ok(report)
}

fn save_state(
    dir: &std::path::Path,
    params: &FThetaParams,
    moments: &[Moments],
    st: &State,
) -> Result<()> {
    let entries: Vec<(&str, &Tensor<2>, &Moments)> = params
        .tensors
        .iter()
        .zip(moments)
        .map(|((n, _, p), m)| (n.as_str(), p, m))
        .collect();
    let json = serde_json::to_string_pretty(st).expect("state serialises");
    state::save(dir, &entries, &json)
}

fn load_state(
    dir: &std::path::Path,
    config: &FThetaConfig,
    fingerprint: &str,
    device: &Device,
) -> Result<(FThetaParams, Vec<Moments>, State)> {
    let (mut read, text, sp, wp) = state::load(dir)?;
    let st: State = serde_json::from_str(&text)
        .map_err(|e| TrainError::invalid(&sp, format!("unreadable training state: {e}")))?;
    if st.fingerprint != fingerprint {
        return Err(TrainError::invalid(
            &sp,
            "this state was trained with another config or dataset; resume with the same ones",
        ));
    }
    let mut by = |prefix: &str| -> BTreeMap<String, HostTensor> {
        let keys: Vec<String> = read
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect();
        keys.into_iter()
            .map(|k| {
                let t = read.remove(&k).expect("listed");
                (k[prefix.len()..].to_string(), t)
            })
            .collect()
    };
    let mut p = by("param/");
    let mut m = by("m/");
    let mut v = by("v/");
    let bad = |e: String| TrainError::invalid(&wp, e);
    let params = FThetaParams::from_host(config.clone(), &mut p, device).map_err(bad)?;
    let ms = FThetaParams::from_host(config.clone(), &mut m, device).map_err(bad)?;
    let vs = FThetaParams::from_host(config.clone(), &mut v, device).map_err(bad)?;
    let moments = ms
        .tensors
        .into_iter()
        .zip(vs.tensors)
        .map(|((_, _, m), (_, _, v))| Moments { m, v })
        .collect();
    Ok((params, moments, st))
}
