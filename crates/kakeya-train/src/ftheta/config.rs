//! The f_θ training config (`configs/train/f-theta-<name>.toml`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use kakeya_weights::ftheta::FThetaInputs;

use super::loss::{Lambdas, LossKind};
use crate::error::{Result, TrainError};

/// A whole f_θ training job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FThetaTrainConfig {
    /// The capture dataset.
    pub data: DataSection,
    /// Models and f_θ's shape.
    pub model: ModelSection,
    /// The loss.
    #[serde(default)]
    pub loss: LossSection,
    /// Optimisation.
    pub train: TrainSection,
    /// Outputs.
    pub output: OutputSection,
}

/// The dataset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// A `kakeya capture` folder with the drafter's K/V and the columns the loss needs.
    pub dataset: PathBuf,
    /// Every n-th sequence (ids `n-1, 2n-1, ...`) is held out for evaluation.
    #[serde(default = "default_heldout_every")]
    pub heldout_every: usize,
}

fn default_heldout_every() -> usize {
    8
}

/// Models and shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// The verifier (GGUF or HF folder) the dataset was captured with.
    pub verifier: PathBuf,
    /// The drafter folder whose K/V the dataset holds.
    pub drafter: PathBuf,
    /// Encoder width (default: 768 for attention losses, 256 otherwise).
    pub rank: Option<usize>,
    /// What each path reads: `own` (K path ← drafter K, V path ← drafter V; DESIGN §7) or
    /// `both` (each path ← `[K ; V]`).
    #[serde(default)]
    pub inputs: FThetaInputs,
    /// Biases on the encoder and decoders.
    #[serde(default = "yes")]
    pub bias: bool,
    /// Warm start: an exported f_θ folder of the same shape (overrides `init`).
    pub init_from: Option<PathBuf>,
    /// How a fresh f_θ starts: `least_squares` (default: the ridge reduced-rank least-squares
    /// fit of raw K/V on the training sequences) or `random` (PyTorch's `nn.Linear` default).
    #[serde(default)]
    pub init: FThetaInit,
    /// Ridge strength of the least-squares start, relative to the mean eigenvalue of the
    /// inputs' covariance.
    #[serde(default = "default_ridge")]
    pub init_ridge: f64,
}

/// How a fresh f_θ starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FThetaInit {
    /// Closed-form ridge reduced-rank least squares on raw K/V (see `ftheta::lstsq`).
    #[default]
    LeastSquares,
    /// Uniform ±1/√fan_in.
    Random,
}

fn yes() -> bool {
    true
}

fn default_ridge() -> f64 {
    1e-4
}

/// The loss.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LossSection {
    /// Loss type.
    #[serde(default)]
    pub kind: LossKind,
    /// Hybrid-loss weights.
    #[serde(default)]
    pub lambdas: Lambdas,
    /// Query positions sampled per sequence for the attention losses.
    #[serde(default = "default_queries")]
    pub queries_per_sequence: usize,
    /// Divide each layer's attention MSE by its `mean(O_tgt²)` (DESIGN §7's plain MSE when
    /// false, the default).
    #[serde(default)]
    pub normalize_attention: bool,
}

fn default_queries() -> usize {
    64
}

impl Default for LossSection {
    fn default() -> Self {
        Self {
            kind: LossKind::default(),
            lambdas: Lambdas::default(),
            queries_per_sequence: default_queries(),
            normalize_attention: false,
        }
    }
}

/// Optimisation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    /// Optimiser steps.
    pub steps: usize,
    /// Training sequences per step.
    #[serde(default = "default_seqs")]
    pub sequences_per_step: usize,
    /// Peak learning rate (after warm-up; the cosine ends at `lr / 100`).
    pub lr: f64,
    /// Linear warm-up steps.
    #[serde(default)]
    pub warmup_steps: usize,
    /// AdamW decoupled weight decay.
    #[serde(default = "default_wd")]
    pub weight_decay: f64,
    /// AdamW β₁.
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    /// AdamW β₂.
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    /// AdamW ε.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Global gradient-norm clip (0: none).
    #[serde(default = "default_clip")]
    pub grad_clip: f64,
    /// Seed of the initialisation and of every step's sampling.
    #[serde(default)]
    pub seed: u64,
    /// On a GPU, record a step once per input shape and replay it ([`super::replay`]: on
    /// CUDA one graph launch a step); false: every step issues its launches from the host.
    #[serde(default = "default_graph")]
    pub graph: bool,
}

fn default_graph() -> bool {
    true
}
fn default_seqs() -> usize {
    2
}
fn default_wd() -> f64 {
    0.01
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_eps() -> f64 {
    1e-8
}
fn default_clip() -> f64 {
    1.0
}

/// Outputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    /// Run folder: state (checkpoints), `report.json`, `curves.png`.
    pub dir: PathBuf,
    /// Exported f_θ folder (`config.json` + `f_theta.safetensors`).
    pub export: PathBuf,
    /// Save the state every this many steps.
    #[serde(default = "default_every")]
    pub checkpoint_every: usize,
    /// Evaluate on the held-out sequences every this many steps.
    #[serde(default = "default_every")]
    pub eval_every: usize,
    /// Query positions per held-out sequence in evaluations (evenly spaced).
    #[serde(default = "default_eval_queries")]
    pub eval_queries: usize,
}

fn default_every() -> usize {
    100
}
fn default_eval_queries() -> usize {
    64
}

impl FThetaTrainConfig {
    /// Reads and checks a config file.
    pub fn load(path: &Path) -> Result<Self> {
        crate::run::load_config(path, Self::validate)
    }

    /// Parses and checks config text (`path` names it in errors).
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        crate::run::parse_config(path, text, Self::validate)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |msg: &str| Err(TrainError::invalid(path, msg.to_string()));
        let t = &self.train;
        if self.model.rank == Some(0) {
            return bad("model.rank must be positive");
        }
        if t.steps == 0 || t.sequences_per_step == 0 {
            return bad("train.steps and train.sequences_per_step must be positive");
        }
        if !(t.lr.is_finite() && t.lr > 0.0) {
            return bad("train.lr must be a positive number");
        }
        if t.warmup_steps >= t.steps {
            return bad("train.warmup_steps must be smaller than train.steps");
        }
        if !(0.0..1.0).contains(&t.beta1) || !(0.0..1.0).contains(&t.beta2) || t.eps <= 0.0 {
            return bad("train.beta1/beta2 must be in [0, 1) and train.eps positive");
        }
        if t.weight_decay < 0.0 || t.grad_clip < 0.0 {
            return bad("train.weight_decay and train.grad_clip must not be negative");
        }
        if !(self.model.init_ridge.is_finite() && self.model.init_ridge >= 0.0) {
            return bad("model.init_ridge must be a non-negative number");
        }
        if self.data.heldout_every < 2 {
            return bad("data.heldout_every must be at least 2");
        }
        if self.loss.queries_per_sequence == 0 || self.output.eval_queries == 0 {
            return bad("loss.queries_per_sequence and output.eval_queries must be positive");
        }
        if self.output.checkpoint_every == 0 || self.output.eval_every == 0 {
            return bad("output.checkpoint_every and output.eval_every must be positive");
        }
        Ok(())
    }

    /// The encoder width.
    pub fn rank(&self) -> usize {
        self.model
            .rank
            .unwrap_or(if self.loss.kind.needs_attention() {
                768
            } else {
                256
            })
    }

    /// Learning rate of 0-based step `t`: [`crate::optim::warmup_cosine`] from `lr` down to
    /// `lr / 100`.
    pub fn lr_at(&self, t: usize) -> f64 {
        let o = &self.train;
        crate::optim::warmup_cosine(t, o.steps, o.warmup_steps, o.lr, o.lr / 100.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Result<FThetaTrainConfig> {
        FThetaTrainConfig::parse(
            Path::new("f.toml"),
            &format!(
                r#"
[data]
dataset = "d"
[model]
verifier = "v.gguf"
drafter = "dr"
[train]
steps = 101
lr = 1e-3
warmup_steps = 11
{extra}
[output]
dir = "runs/x"
export = "out/x"
"#
            ),
        )
    }

    #[test]
    fn schedule_warms_up_linearly_then_decays_by_cosine_to_a_hundredth() {
        let c = cfg("").unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12 * b.max(1.0);
        // Warm-up start and end.
        assert!(close(c.lr_at(0), 1e-3 / 11.0), "{}", c.lr_at(0));
        assert!(close(c.lr_at(10), 1e-3));
        // Midpoint of the decay: 90 decay steps (t = 11..=100), half way at t = 55.
        assert!(close(c.lr_at(55), 0.5 * (1e-3 + 1e-5)), "{}", c.lr_at(55));
        // End: the last step runs at peak / 100.
        assert!(close(c.lr_at(100), 1e-5), "{}", c.lr_at(100));
        // Monotone after the peak.
        assert!((11..100).all(|t| c.lr_at(t + 1) <= c.lr_at(t)));
    }

    #[test]
    fn defaults_follow_the_design() {
        let c = cfg("").unwrap();
        assert_eq!(c.loss.kind, LossKind::AttnDistillHybrid);
        assert_eq!(c.loss.lambdas, Lambdas::default());
        assert_eq!(c.rank(), 768);
        assert_eq!(c.train.weight_decay, 0.01);
        assert_eq!(c.train.grad_clip, 1.0);
        assert_eq!(
            (c.model.init, c.model.init_ridge),
            (FThetaInit::LeastSquares, 1e-4)
        );
    }

    #[test]
    fn bad_configs_are_refused_with_the_file_named() {
        let e = cfg("bogus = 1").unwrap_err().to_string();
        assert!(e.starts_with("f.toml") && e.contains("bogus"), "{e}");
        let e = FThetaTrainConfig::parse(
            Path::new("f.toml"),
            "[data]\ndataset='d'\n[model]\nverifier='v'\ndrafter='d'\n[train]\nsteps=5\nlr=1\nwarmup_steps=5\n[output]\ndir='a'\nexport='b'\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("warmup_steps"), "{e}");
        let e = FThetaTrainConfig::parse(
            Path::new("f.toml"),
            "[data]\ndataset='d'\n[model]\nverifier='v'\ndrafter='d'\ninit='least_squares'\ninit_ridge=-1\n[train]\nsteps=5\nlr=1\n[output]\ndir='a'\nexport='b'\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("init_ridge"), "{e}");
    }
}
