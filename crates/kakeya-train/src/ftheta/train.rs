//! The f_θ training loop: checks, streamed batches, AdamW steps with a global clip and a
//! cosine schedule, held-out evaluation, checkpoints, resume, export, report and curves.
//!
//! A step draws `sequences_per_step` training sequences and, in each, `queries_per_sequence`
//! query positions from an RNG seeded by `(seed, step)`; a reader thread streams those
//! sequences from the Parquet shards ahead of the step that needs them. f_θ predicts raw K/V at
//! every position of a sequence; the loss is averaged over sequences and verifier layers.
//! Resuming is exact (the state holds weights, Adam moments and history in f32).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use burn::tensor::{Device, Tensor};

use super::pass::PassInputs;
use super::replay::{RecordingGate, Replayer};
use crate::optim::{Moments, StepValues};
use kakeya_capture::Dataset;
use kakeya_models::GemmaModel;
use kakeya_weights::FThetaConfig;
use kakeya_weights::ftheta::{FTHETA_FORMAT, FTHETA_VERSION, ModelRef};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::config::{FThetaInit, FThetaTrainConfig};
use super::data::{self, DataInfo, SeqData};
use super::loss::Diagnostics;
use super::lstsq::least_squares;
use super::params::FThetaParams;
use super::step::{
    GroupFrozen, GroupLayout, Passes, Prepared, adamw, evaluate, frozen_groups, frozen_layers,
    layouts, prepare_step, prepared_loss,
};
use crate::error::{Result, TrainError};
use crate::optim::AdamW;
use crate::run::{self, Cadence, Trainer};
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
pub type FEvent = crate::run::Event<FEval>;

/// f_θ's own part of the saved state: the storage floor measured before training.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Floor {
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
    /// Steps replayed from a recording (on a GPU, `[train] graph`).
    pub replayed_steps: usize,
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
    verifier: &GemmaModel,
    verifier_sha: &str,
    drafter_sha: &str,
) -> Result<Setup> {
    // f_θ predicts the layers with K/V of their own (all of Gemma 3's; Gemma 4's KV-sharing
    // layers read their source's), each at its own width.
    let widths = verifier.config.own_kv_widths();
    let ds = Dataset::open(&cfg.data.dataset)?;
    let info = data::check(
        &ds,
        verifier_sha,
        drafter_sha,
        widths.len(),
        cfg.loss.kind.needs_attention(),
        cfg.data.heldout_every,
    )?;
    if info.kv_dims != widths {
        return Err(TrainError::invalid(
            &info.dir,
            format!(
                "the dataset's raw K widths per layer are {:?}, the verifier's are {widths:?}",
                info.kv_dims
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
        verifier_layers: 0,
        verifier_kv_dim: 0,
        verifier_kv_dims: Vec::new(),
        bias: cfg.model.bias,
        loss: cfg.loss.kind.name().into(),
    }
    .with_layer_widths(&widths);
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

/// Steps the reader prepares together, at least (more where more threads are: one step per
/// thread and round).
const READ_AHEAD: usize = 4;

/// The reader thread: each step's sequences ahead of it, targets gathered ([`prepare_step`]), a
/// round of steps at a time on up to 8 threads, one step each (a sequence's Parquet row group
/// takes tens of milliseconds to decode on one core: longer than a step on a GPU), then the
/// round staged for `device` on the reader's own thread ([`Prepared::stage`]: on CUDA, copied
/// into pinned memory off the device's one thread), not while `gate` is held.
fn spawn_reader(
    cfg: &FThetaTrainConfig,
    info: &DataInfo,
    ds: &Dataset,
    start: usize,
    (groups, passes): (Vec<GroupLayout>, Passes),
    (device, gate): (&Device, RecordingGate),
) -> (Batches, std::thread::JoinHandle<()>) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    let round = threads.max(READ_AHEAD);
    let (tx, rx) = mpsc::sync_channel::<Result<Step>>(2 * round);
    let (cfg, info, ds, device) = (cfg.clone(), info.clone(), ds.clone(), device.clone());
    let handle = std::thread::spawn(move || {
        let mut t0 = start;
        while t0 < cfg.train.steps {
            let steps: Vec<usize> = (t0..(t0 + round).min(cfg.train.steps)).collect();
            t0 += steps.len();
            let per = steps.len().div_ceil(threads).max(1);
            let one = |t: usize| -> Result<Step> {
                let mut batch = pick(&cfg, &info, t)
                    .into_iter()
                    .map(|s| info.read(&ds, s))
                    .collect::<Result<Vec<SeqData>>>()?;
                let prepared = prepare_step(&groups, &batch, &cfg, t, passes);
                // The verifier's tensors now live in `prepared`; the step reads only the
                // drafter's side of each sequence (a step held ahead keeps them once, not twice).
                for s in &mut batch {
                    s.layers = Vec::new();
                }
                Ok((t, batch, prepared))
            };
            let mut done: Vec<Result<Step>> = std::thread::scope(|scope| {
                let parts: Vec<_> = steps
                    .chunks(per)
                    .map(|part| {
                        let one = &one;
                        scope.spawn(move || part.iter().map(|&t| one(t)).collect::<Vec<_>>())
                    })
                    .collect();
                parts
                    .into_iter()
                    .flat_map(|h| h.join().expect("a reader thread panicked"))
                    .collect()
            });
            let (bytes, pinned) = {
                // Not while the trainer records a step (see `RecordingGate`).
                let _alone = gate.hold();
                Prepared::stage(
                    done.iter_mut().flatten().map(|(_, _, prepared)| prepared),
                    &device,
                )
            };
            tracing::debug!(
                steps = done.len(),
                bytes,
                pinned,
                "a round's targets staged"
            );
            for step in done {
                let failed = step.is_err();
                if tx.send(step).is_err() || failed {
                    return;
                }
            }
        }
    });
    (rx, handle)
}

/// One step from the reader: its 0-based index, sequences and prepared targets.
type Step = (usize, Vec<SeqData>, Prepared);

/// What the reader sends: each step, in step order.
type Batches = mpsc::Receiver<Result<Step>>;

/// `curves.png`: the training loss, and the held-out metric (the mean MSE-over-O² ratio of
/// the attention losses, else the held-out loss).
fn curves(evals: &[FEval], steps: &[crate::run::StepRecord], attention: bool) -> Vec<u8> {
    let metric: Vec<(f64, f64)> = evals
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
    plot::two_panels(
        ("TRAIN LOSS", &plot::smoothed_loss(steps)),
        (right, &metric),
    )
}

/// Trains (or resumes) f_θ as `cfg` says, exports it, and writes `report.json` and
/// `curves.png` into the run folder.
pub fn train_f_theta(
    cfg: &FThetaTrainConfig,
    verifier: &GemmaModel,
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
    let out = &cfg.output.dir;
    let mut opened = run::open(
        out,
        opts.resume,
        &fingerprint,
        (f_theta.stacked_tensors(), &device),
        |tensors| FThetaParams {
            config: f_theta.clone(),
            tensors,
        },
        || {
            let params = match (&cfg.model.init_from, cfg.model.init) {
                (Some(p), _) => FThetaParams::from_dir(f_theta.clone(), p, &device)?,
                (None, FThetaInit::Random) => {
                    FThetaParams::init(f_theta.clone(), cfg.train.seed, &device)
                }
                (None, FThetaInit::LeastSquares) => {
                    least_squares(cfg, &info, &ds, &f_theta, &device, on_event)?
                }
            };
            Ok((params, Floor { floor: None }))
        },
    )?;
    let frozen = frozen_groups(&frozen_layers(verifier, &device), &f_theta);
    let held: Vec<SeqData> = info
        .heldout
        .iter()
        .map(|&s| info.read(&ds, s))
        .collect::<Result<_>>()?;
    let attention = cfg.loss.kind.needs_attention();
    let st = &mut opened.state;
    if st.step == 0 && st.evals.is_empty() && attention {
        let model = opened.params.model(&run::values(&opened.params.tensors));
        st.extra.floor = Some(evaluate(&model, &frozen, &held, cfg, 0, true)?);
    }

    let ahead = (layouts(&frozen), Passes::for_device(&ad));
    let gate = RecordingGate::default();
    let (rx, reader) = spawn_reader(cfg, &info, &ds, st.step, ahead, (&device, gate.clone()));
    let mut trainer = FThetaRun {
        cfg,
        dir: &info.dir,
        rx,
        frozen,
        frozen_ad: frozen_groups(&frozen_layers(verifier, &ad), &f_theta),
        held: &held,
        replayer: Replayer::new(cfg, &device, gate),
        ad,
        saturated: held.iter().map(|s| s.saturated).sum(),
        pending: None,
        replayed: 0,
    };
    let cadence = Cadence {
        steps: cfg.train.steps,
        eval_every: cfg.output.eval_every,
        checkpoint_every: cfg.output.checkpoint_every,
    };
    let ran = run::run_steps(&mut trainer, &mut opened, out, cadence, opts, on_event);
    let (saturated, replayed_steps) = (trainer.saturated, trainer.replayed);
    drop(trainer);
    let _ = reader.join();
    let secs = ran?;
    let (params, st) = (opened.params, opened.state);
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
        secs_per_step: run::median_secs(secs),
        steps_done: st.step,
        floor: st.extra.floor.clone(),
        evals: st.evals.clone(),
        final_diagnostics,
        steps: st.steps.clone(),
        export: cfg.output.export.clone(),
        replayed_steps,
    };
    let png = curves(&st.evals, &st.steps, attention);
    run::write_outputs(out, &report, &png)?;
    Ok(report)
}

impl FThetaRun<'_> {
    /// Step `t`'s sequences and prepared targets from the reader.
    fn receive(&mut self, t: usize) -> Result<Step> {
        let waited = std::time::Instant::now();
        let step = self
            .rx
            .recv()
            .map_err(|_| TrainError::invalid(self.dir, "the data reader stopped"))??;
        debug_assert_eq!(step.0, t);
        tracing::debug!(
            step = t + 1,
            data_wait_ms = waited.elapsed().as_secs_f64() * 1e3,
            "waited for the reader"
        );
        self.saturated += step.1.iter().map(|s| s.saturated).sum::<usize>();
        Ok(step)
    }
}

/// f_θ's part of the shared loop ([`run::run_steps`]): batches come from the reader thread.
struct FThetaRun<'a> {
    cfg: &'a FThetaTrainConfig,
    dir: &'a Path,
    rx: Batches,
    frozen: Vec<GroupFrozen>,
    frozen_ad: Vec<GroupFrozen>,
    held: &'a [SeqData],
    ad: Device,
    saturated: usize,
    /// Replays recorded steps (on a GPU, `[train] graph`).
    replayer: Option<Replayer>,
    /// A step received by [`Trainer::whole_step`] and left to [`Trainer::loss`].
    pending: Option<Step>,
    /// Steps replayed.
    replayed: usize,
}

impl Trainer for FThetaRun<'_> {
    type Params = FThetaParams;
    type Eval = FEval;

    fn whole_step(
        &mut self,
        t: usize,
        params: &FThetaParams,
        moments: &[Moments],
    ) -> Option<Result<StepValues>> {
        self.replayer.as_ref()?;
        let (bt, batch, prepared) = match self.receive(t) {
            Ok(step) => step,
            Err(e) => return Some(Err(e)),
        };
        let host = match prepared.into_single_pass() {
            Ok(host) => host,
            Err(prepared) => {
                self.pending = Some((bt, batch, prepared));
                return None;
            }
        };
        let part: Vec<&SeqData> = batch.iter().collect();
        let inputs = PassInputs::training(&part, host, self.cfg, &self.ad);
        let replayer = self.replayer.as_mut().expect("checked above");
        let frozen = (&self.frozen_ad[..], self.cfg);
        let values = replayer.step(t, (params, moments), frozen, inputs, batch.len());
        self.replayed += 1;
        if !replayer.replays_graphs() {
            // Replaying here re-runs the step: the steps that follow are issued one by one.
            tracing::info!("this device records no graphs: f_θ steps are issued one by one");
            self.replayer = None;
        }
        Some(Ok(values))
    }

    fn loss(&mut self, t: usize, params: &FThetaParams, leaves: &[Tensor<2>]) -> Result<Tensor<1>> {
        let (_, batch, prepared) = match self.pending.take() {
            Some(step) => step,
            None => self.receive(t)?,
        };
        let model = params.model(leaves);
        Ok(prepared_loss(
            &model,
            &self.frozen_ad,
            &batch,
            prepared,
            self.cfg,
            &self.ad,
        ))
    }

    fn optimizer(&self, t: usize) -> (AdamW, f64) {
        adamw(self.cfg, t)
    }

    fn decays(&self, _shape: &[usize]) -> bool {
        true
    }

    fn evaluate(&mut self, step: usize, params: &FThetaParams) -> Result<FEval> {
        let model = params.model(&run::values(&params.tensors));
        evaluate(&model, &self.frozen, self.held, self.cfg, step, false)
    }
}
