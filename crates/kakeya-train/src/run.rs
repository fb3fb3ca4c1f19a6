//! The skeleton both trainers share: a fresh or resumed state (parameters, Adam moments, the
//! step, the history and the trainer's own record), the step loop with its held-out
//! evaluations, checkpoints, non-finite-loss stop and interruption, and the run's outputs.
//!
//! Resuming is exact when the trainer's step is a function of the step index and the state:
//! the state is saved in f32 and swapped in as one folder ([`crate::state`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_weights::HostTensor;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::optim::{AdamW, Moments, StepValues, backward_and_step};
use crate::state;

/// Trainable tensors `(name, PyTorch shape, value)`, stored 2-D (`[1, n]` for vectors), in
/// the order of the checkpoint's expected tensors.
pub type Named = Vec<(String, Vec<usize>, Tensor<2>)>;

/// Reads a TOML config file and checks it with `validate` (errors name `path`).
pub fn load_config<T: DeserializeOwned>(
    path: &Path,
    validate: impl Fn(&T, &Path) -> Result<()>,
) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?;
    parse_config(path, &text, validate)
}

/// Parses TOML config text and checks it with `validate` (`path` names it in errors).
pub fn parse_config<T: DeserializeOwned>(
    path: &Path,
    text: &str,
    validate: impl Fn(&T, &Path) -> Result<()>,
) -> Result<T> {
    let cfg: T = toml::from_str(text).map_err(|e| TrainError::invalid(path, e.to_string()))?;
    validate(&cfg, path)?;
    Ok(cfg)
}

/// PyTorch shape → the 2-D storage shape (`[1, n]` for vectors).
pub fn storage_dims(shape: &[usize]) -> [usize; 2] {
    match shape {
        [r, c] => [*r, *c],
        [c] => [1, *c],
        _ => [1, shape.iter().product()],
    }
}

/// Builds [`Named`] from host tensors taken out of `host` by name, in `expected` order.
pub fn named_from_host(
    expected: Vec<(String, Vec<usize>)>,
    host: &mut BTreeMap<String, HostTensor>,
    device: &Device,
) -> std::result::Result<Named, String> {
    expected
        .into_iter()
        .map(|(name, shape)| {
            let t = host
                .remove(&name)
                .ok_or_else(|| format!("missing tensor {name}"))?;
            if t.data.len() != shape.iter().product::<usize>() {
                return Err(format!("tensor {name} has the wrong size"));
            }
            let v = Tensor::from_data(TensorData::new(t.data, storage_dims(&shape)), device);
            Ok((name, shape, v))
        })
        .collect()
}

/// A trainer's parameter set: named tensors plus whatever the trainer derives from them.
pub trait Params {
    /// The tensors, in checkpoint order.
    fn tensors(&self) -> &Named;
    /// See [`Params::tensors`].
    fn tensors_mut(&mut self) -> &mut Named;
}

/// Gradient-tracking copies of the tensors (the step's leaves).
pub fn leaves(tensors: &Named) -> Vec<Tensor<2>> {
    tensors
        .iter()
        .map(|(_, _, p)| p.clone().autodiff().require_grad())
        .collect()
}

/// The tensors' current values, in order.
pub fn values(tensors: &Named) -> Vec<Tensor<2>> {
    tensors.iter().map(|(_, _, t)| t.clone()).collect()
}

/// Number of scalars.
pub fn count(tensors: &Named) -> usize {
    tensors
        .iter()
        .map(|(_, s, _)| s.iter().product::<usize>())
        .sum()
}

/// How to run.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Continue from the run folder's last saved state.
    pub resume: bool,
    /// Device to train on (its autodiff twin records the graph).
    pub device: Device,
    /// Stop after this many steps of this invocation (the state is saved first); `None` runs
    /// to the end. Used to test resuming.
    pub stop_after: Option<usize>,
}

/// A tensor's values read back to the host as f32: where the device failed to run what
/// produced it, a [`TrainError::Device`] rather than a panic.
pub(crate) fn read_f32<const D: usize>(t: Tensor<D>) -> Result<Vec<f32>> {
    let data = t.try_into_data().map_err(|e| {
        let msg = e.to_string();
        // The failure itself, without the chain's headers or the launches it skipped.
        let said: Vec<&str> = msg
            .lines()
            .map(str::trim)
            .filter(|l| {
                !l.is_empty()
                    && *l != "Caused by:"
                    && *l != "Several failures at once"
                    && !l.starts_with("skipped")
                    && !l.starts_with('(')
            })
            .take(3)
            .collect();
        TrainError::Device(said.join(": "))
    })?;
    Ok(data
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("converted to f32"))
}

/// One optimiser step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// 1-based step.
    pub step: usize,
    /// The training loss.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Wall seconds of the step.
    pub secs: f64,
}

/// What a trainer reports as it goes (`E`: its held-out evaluation).
#[derive(Debug, Clone)]
pub enum Event<E> {
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
    Eval(E),
    /// The state was saved after this many steps.
    Saved(usize),
    /// A preparatory pass (f_θ's least-squares start) has read `done` of `total` sequences.
    Fitting {
        /// Sequences read.
        done: usize,
        /// Sequences to read.
        total: usize,
    },
}

/// Saved between invocations: the step, what was trained on, the history, and the trainer's
/// own record `X` (its fields sit beside the others in `state.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunState<E, X> {
    /// Steps done.
    pub step: usize,
    /// Config, data and model hashes the state was trained with.
    pub fingerprint: String,
    /// Per-step records.
    pub steps: Vec<StepRecord>,
    /// Held-out evaluations, the first before any training.
    pub evals: Vec<E>,
    /// The trainer's own record.
    #[serde(flatten)]
    pub extra: X,
}

/// A run's parameters, moments and state, fresh or resumed.
pub struct Opened<P, E, X> {
    /// The parameters.
    pub params: P,
    /// Their Adam moments.
    pub moments: Vec<Moments>,
    /// The state.
    pub state: RunState<E, X>,
}

/// Opens the run folder `out`: resumes its saved state (`state/`, or `state.old/` when a swap
/// was interrupted) when `resume` and one exists, else starts from `fresh` — refusing, without
/// `resume`, to overwrite a state that exists. (`--resume` with nothing saved yet starts
/// fresh, as `kakeya capture --resume` does, so one command line both starts and continues.) `expected` names the tensors a state must hold; `rebuild` makes the
/// parameter set of the saved tensors.
pub fn open<P: Params, E: DeserializeOwned, X: DeserializeOwned>(
    out: &Path,
    resume: bool,
    fingerprint: &str,
    (expected, device): (Vec<(String, Vec<usize>)>, &Device),
    rebuild: impl FnOnce(Named) -> P,
    fresh: impl FnOnce() -> Result<(P, X)>,
) -> Result<Opened<P, E, X>> {
    let state_dir = out.join("state");
    let old_dir = out.join("state.old");
    let saved = state_dir.exists() || old_dir.exists();
    if !resume || !saved {
        if saved {
            return Err(TrainError::invalid(
                out,
                "a training state exists here; pass --resume to continue it or remove the folder",
            ));
        }
        if resume {
            tracing::info!(
                "{}: no saved state to resume; starting fresh",
                out.display()
            );
        }
        let (params, extra) = fresh()?;
        let moments = params
            .tensors()
            .iter()
            .map(|(_, _, p)| Moments::zeros_like(p))
            .collect();
        return Ok(Opened {
            params,
            moments,
            state: RunState {
                step: 0,
                fingerprint: fingerprint.to_string(),
                steps: Vec::new(),
                evals: Vec::new(),
                extra,
            },
        });
    }
    let dir = if state_dir.is_dir() {
        &state_dir
    } else {
        &old_dir
    };
    let (read, text, sp, wp) = state::load(dir)?;
    let st: RunState<E, X> = serde_json::from_str(&text)
        .map_err(|e| TrainError::invalid(&sp, format!("unreadable training state: {e}")))?;
    if st.fingerprint != fingerprint {
        return Err(TrainError::invalid(
            &sp,
            "this state was trained with another config or dataset; resume with the same ones",
        ));
    }
    let mut by_kind: BTreeMap<&str, BTreeMap<String, HostTensor>> = BTreeMap::new();
    for (key, t) in read {
        let Some((kind, name)) = key.split_once('/') else {
            return Err(TrainError::invalid(&wp, format!("unexpected tensor {key}")));
        };
        let kind = match kind {
            "param" => "param",
            "m" => "m",
            "v" => "v",
            _ => return Err(TrainError::invalid(&wp, format!("unexpected tensor {key}"))),
        };
        by_kind.entry(kind).or_default().insert(name.to_string(), t);
    }
    let mut part = |kind: &str| {
        let mut host = by_kind.remove(kind).unwrap_or_default();
        named_from_host(expected.clone(), &mut host, device)
            .map_err(|e| TrainError::invalid(&wp, format!("{kind}/: {e}")))
    };
    let tensors = part("param")?;
    let (m, v) = (part("m")?, part("v")?);
    let moments = m
        .into_iter()
        .zip(v)
        .map(|((_, _, m), (_, _, v))| Moments { m, v })
        .collect();
    Ok(Opened {
        params: rebuild(tensors),
        moments,
        state: st,
    })
}

/// Writes `out/state` (weights, moments, step, history) as a whole.
pub fn save<E: Serialize, X: Serialize>(
    out: &Path,
    tensors: &Named,
    moments: &[Moments],
    st: &RunState<E, X>,
) -> Result<()> {
    let entries: Vec<(&str, &Tensor<2>, &Moments)> = tensors
        .iter()
        .zip(moments)
        .map(|((name, _, p), m)| (name.as_str(), p, m))
        .collect();
    let json = serde_json::to_string_pretty(st).expect("state serialises");
    state::save(out, &entries, &json)
}

/// When to evaluate and save.
#[derive(Debug, Clone, Copy)]
pub struct Cadence {
    /// Total steps.
    pub steps: usize,
    /// Evaluate every this many steps (and after the last).
    pub eval_every: usize,
    /// Save the state every this many steps (and after the last, and when stopping).
    pub checkpoint_every: usize,
}

/// What the loop asks of a trainer.
pub trait Trainer {
    /// The parameter set.
    type Params: Params;
    /// A held-out evaluation.
    type Eval: Clone;
    /// The training loss of 0-based step `t`, computed over `leaves` (gradient-tracking
    /// copies of the parameters' tensors, in order).
    ///
    /// # Shapes
    /// - returns `[1]`
    fn loss(&mut self, t: usize, params: &Self::Params, leaves: &[Tensor<2>]) -> Result<Tensor<1>>;
    /// Step `t` whole — loss, gradients, clip and update, the parameters and `moments`
    /// updated in place — where the trainer runs it itself (f_θ replaying a recorded step on a
    /// GPU: [`crate::ftheta::replay`]); `None`: the loop's [`Self::loss`] and update.
    fn whole_step(
        &mut self,
        _t: usize,
        _params: &Self::Params,
        _moments: &[Moments],
    ) -> Option<Result<StepValues>> {
        None
    }
    /// The AdamW settings of 0-based step `t` and the global gradient-norm clip.
    fn optimizer(&self, t: usize) -> (AdamW, f64);
    /// Whether a tensor of this (PyTorch) shape takes weight decay.
    fn decays(&self, shape: &[usize]) -> bool;
    /// Held-out metrics of the current parameters after `step` steps.
    fn evaluate(&mut self, step: usize, params: &Self::Params) -> Result<Self::Eval>;
}

/// Runs the steps from `opened.state.step` to the end: per step the trainer's loss, the
/// backward pass and one AdamW update with a global clip ([`backward_and_step`]), the step's
/// record, evaluations and saves as `cadence` says, a stop with [`TrainError::NonFinite`] on a NaN/infinite loss (the
/// last checkpoint stays), and [`TrainError::Interrupted`] after `opts.stop_after` steps of
/// this invocation (saved first). Evaluates once before the first step of a fresh run.
/// Returns the wall seconds of this invocation's steps.
pub fn run_steps<T: Trainer, X: Serialize>(
    trainer: &mut T,
    opened: &mut Opened<T::Params, T::Eval, X>,
    out: &Path,
    cadence: Cadence,
    opts: &TrainOptions,
    on_event: &mut dyn FnMut(Event<T::Eval>),
) -> Result<Vec<f64>>
where
    T::Eval: Serialize,
{
    let Opened {
        params,
        moments,
        state: st,
    } = opened;
    std::fs::create_dir_all(out).map_err(|e| TrainError::io(out, e))?;
    on_event(Event::Started {
        start: st.step,
        steps: cadence.steps,
    });
    if st.step == 0 && st.evals.is_empty() {
        let e = trainer.evaluate(0, params)?;
        on_event(Event::Eval(e.clone()));
        st.evals.push(e);
    }
    let mut secs = Vec::new();
    let mut last_saved: Option<usize> = (st.step > 0).then_some(st.step);
    let mut ran = 0;
    while st.step < cadence.steps {
        let t = st.step;
        let started = Instant::now();
        let (opt, clip) = trainer.optimizer(t);
        let (values, forward) = match trainer.whole_step(t, params, moments) {
            Some(values) => (values?, started.elapsed()),
            None => {
                let leaves = leaves(params.tensors());
                let loss_t = trainer.loss(t, params, &leaves)?;
                let forward = started.elapsed();
                let decay = |shape: &[usize]| trainer.decays(shape);
                let values = backward_and_step(
                    loss_t,
                    &leaves,
                    params.tensors_mut(),
                    moments,
                    &opt,
                    clip,
                    t + 1,
                    &decay,
                );
                (values, forward)
            }
        };
        let queued = started.elapsed();
        // The step's one read-back: on a GPU, the wait for the queued work.
        let (loss, grad_norm) = values.read()?;
        tracing::debug!(
            step = t + 1,
            forward_ms = forward.as_secs_f64() * 1e3,
            backward_and_update_ms = (queued - forward).as_secs_f64() * 1e3,
            read_ms = (started.elapsed() - queued).as_secs_f64() * 1e3,
            "step phases (host time; a GPU runs the queued work meanwhile)"
        );
        if !loss.is_finite() {
            // The update already ran (the loss is read with the gradient norm, after it): the
            // parameters in memory are spoilt, the last saved state is not.
            return Err(TrainError::NonFinite {
                step: t + 1,
                value: loss,
                kept: last_saved
                    .map_or_else(|| "none was saved yet".to_string(), |s| format!("step {s}")),
                dir: out.join("state"),
            });
        }
        st.step += 1;
        ran += 1;
        let rec = StepRecord {
            step: st.step,
            loss,
            lr: opt.lr,
            grad_norm,
            secs: started.elapsed().as_secs_f64(),
        };
        secs.push(rec.secs);
        on_event(Event::Step(rec.clone()));
        st.steps.push(rec);
        let last = st.step == cadence.steps;
        if st.step % cadence.eval_every == 0 || last {
            let e = trainer.evaluate(st.step, params)?;
            on_event(Event::Eval(e.clone()));
            st.evals.push(e);
        }
        let stop = opts.stop_after.is_some_and(|n| ran >= n);
        if st.step % cadence.checkpoint_every == 0 || last || stop {
            save(out, params.tensors(), moments, st)?;
            last_saved = Some(st.step);
            on_event(Event::Saved(st.step));
        }
        if stop && !last {
            return Err(TrainError::Interrupted(st.step));
        }
    }
    Ok(secs)
}

/// The median of step seconds (0 when none ran).
pub fn median_secs(mut secs: Vec<f64>) -> f64 {
    secs.sort_by(f64::total_cmp);
    secs.get(secs.len() / 2).copied().unwrap_or(0.0)
}

/// Writes the run's `report.json` and `curves.png` into `out`, each atomically.
pub fn write_outputs(out: &Path, report: &impl Serialize, png: &[u8]) -> Result<PathBuf> {
    let json = serde_json::to_string_pretty(report).expect("report serialises");
    let path = out.join("report.json");
    state::write_file_atomically(&path, json.as_bytes())?;
    state::write_file_atomically(&out.join("curves.png"), png)?;
    Ok(path)
}
