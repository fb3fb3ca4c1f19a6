//! `kakeya train drafter` configuration (TOML). Unknown keys are refused so that a typo is named
//! rather than silently ignored. Paths are relative to the working directory.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// The whole drafter-training config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterTrainConfig {
    /// Training data.
    pub data: DataConfig,
    /// The verifier and the drafter's shape.
    pub model: DrafterModelConfig,
    /// Optimisation.
    pub train: OptimConfig,
    /// Where state, reports and the exported drafter go.
    pub output: OutputConfig,
}

/// Training data: one capture dataset (token ids + aux hidden states).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Capture dataset folder (`kakeya capture` output with `aux_LL` columns).
    pub dataset: PathBuf,
    /// Every `heldout_every`-th sequence (index `i % n == n - 1`) is held out for evaluation.
    #[serde(default = "default_heldout_every")]
    pub heldout_every: usize,
}

fn default_heldout_every() -> usize {
    10
}

/// The verifier the drafter serves and the drafter's hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterModelConfig {
    /// Verifier GGUF or safetensors folder (must be the one the dataset was captured with).
    pub verifier: PathBuf,
    /// Drafter decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Tokens per block, anchor included.
    pub block_size: usize,
    /// Verifier layers whose outputs feed the drafter; default: DFlash's rule for `layers`.
    #[serde(default)]
    pub target_layers: Option<Vec<usize>>,
    /// Reduced draft vocabulary (the most frequent tokens of the training data); 0 = the
    /// verifier's whole vocabulary.
    #[serde(default)]
    pub draft_vocab: usize,
    /// Token id that fills the slots to draft (Gemma's `<mask>` is 4).
    pub mask_token: u32,
    /// RoPE base.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// Start from this exported drafter (a z-lab folder, e.g. a committed checkpoint) instead
    /// of random weights: fine-tuning on new data. Its shape must be this section's; its
    /// draft vocabulary may differ (the head is the verifier's, rows picked by the new data).
    #[serde(default)]
    pub init: Option<PathBuf>,
}

fn default_rope_theta() -> f64 {
    1_000_000.0
}

/// AdamW with a global grad-norm clip and a cosine schedule with linear warm-up.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimConfig {
    /// Optimiser steps.
    pub steps: usize,
    /// Sequences per step.
    pub sequences_per_step: usize,
    /// Random anchors per sequence per step.
    pub anchors_per_sequence: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate of the cosine.
    #[serde(default)]
    pub min_lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: usize,
    /// Decoupled weight decay (not applied to norm weights).
    #[serde(default)]
    pub weight_decay: f64,
    /// Adam β₁.
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    /// Adam β₂.
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    /// Adam ε.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Global gradient-norm clip (0 = none).
    #[serde(default)]
    pub grad_clip: f64,
    /// Loss weight of slot `k` is `exp(-(k-1)/gamma)`.
    pub gamma: f64,
    /// Seed of initialisation and of every step's batch.
    #[serde(default)]
    pub seed: u64,
}

fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.95
}
fn default_eps() -> f64 {
    1e-8
}

/// Outputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputConfig {
    /// Run folder: training state, `report.json`, `curves.png`.
    pub dir: PathBuf,
    /// The exported drafter folder (z-lab format); replaced at the end of a run.
    pub export: PathBuf,
    /// Element type of the exported weights (`f32`, `f16`, `bf16`).
    #[serde(default)]
    pub export_dtype: kakeya_weights::StoreDtype,
    /// Save the training state every N steps (and at the end).
    pub checkpoint_every: usize,
    /// Evaluate on the held-out sequences every N steps (and at the end).
    pub eval_every: usize,
    /// Anchors evaluated (spread over the held-out sequences).
    #[serde(default = "default_eval_anchors")]
    pub eval_anchors: usize,
}

fn default_eval_anchors() -> usize {
    512
}

impl DrafterTrainConfig {
    /// Reads and checks a config file.
    pub fn load(path: &Path) -> Result<Self> {
        crate::run::load_config(path, Self::validate)
    }

    /// Parses and checks config text (`path` names it in errors).
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        crate::run::parse_config(path, text, Self::validate)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |msg: String| Err(TrainError::invalid(path, msg));
        let m = &self.model;
        let t = &self.train;
        let o = &self.output;
        if m.layers == 0 || m.heads == 0 || m.kv_heads == 0 || m.head_dim == 0 {
            return bad("model: layers, heads, kv_heads and head_dim must be positive".into());
        }
        if !m.heads.is_multiple_of(m.kv_heads) {
            return bad(format!(
                "model: heads {} is not a multiple of kv_heads {}",
                m.heads, m.kv_heads
            ));
        }
        if !m.head_dim.is_multiple_of(2) {
            return bad(format!(
                "model: head_dim {} must be even (RoPE)",
                m.head_dim
            ));
        }
        if m.block_size < 2 {
            return bad(format!(
                "model: block_size {} must be at least 2 (an anchor and a slot to draft)",
                m.block_size
            ));
        }
        if m.intermediate == 0 {
            return bad("model: intermediate must be positive".into());
        }
        if let Some(tl) = &m.target_layers
            && tl.is_empty()
        {
            return bad("model: target_layers is empty".into());
        }
        if t.steps == 0 || t.sequences_per_step == 0 || t.anchors_per_sequence == 0 {
            return bad(
                "train: steps, sequences_per_step and anchors_per_sequence must be positive".into(),
            );
        }
        if t.lr.is_nan() || t.lr <= 0.0 || t.min_lr < 0.0 || t.min_lr > t.lr {
            return bad(format!(
                "train: need 0 <= min_lr <= lr and lr > 0 (lr {}, min_lr {})",
                t.lr, t.min_lr
            ));
        }
        if t.gamma.is_nan() || t.gamma <= 0.0 {
            return bad(format!("train: gamma {} must be positive", t.gamma));
        }
        if !(0.0..1.0).contains(&t.beta1) || !(0.0..1.0).contains(&t.beta2) {
            return bad("train: beta1 and beta2 must be in [0, 1)".into());
        }
        if self.data.heldout_every < 2 {
            return bad(format!(
                "data: heldout_every {} must be at least 2",
                self.data.heldout_every
            ));
        }
        if o.checkpoint_every == 0 || o.eval_every == 0 || o.eval_anchors == 0 {
            return bad(
                "output: checkpoint_every, eval_every and eval_anchors must be positive".into(),
            );
        }
        Ok(())
    }

    /// Learning rate of 0-based step `t`: [`crate::optim::warmup_cosine`] from `lr` to
    /// `min_lr`.
    pub fn lr_at(&self, t: usize) -> f64 {
        let o = &self.train;
        crate::optim::warmup_cosine(t, o.steps, o.warmup_steps, o.lr, o.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[data]
dataset = "d"
[model]
verifier = "v.gguf"
layers = 1
heads = 4
kv_heads = 2
head_dim = 8
intermediate = 32
block_size = 4
mask_token = 4
[train]
steps = 100
sequences_per_step = 2
anchors_per_sequence = 4
lr = 1e-3
min_lr = 1e-4
warmup_steps = 10
gamma = 4.0
[output]
dir = "runs/x"
export = "runs/x/drafter"
checkpoint_every = 10
eval_every = 10
"#;

    #[test]
    fn schedule_warms_up_linearly_then_follows_the_cosine_down_to_min_lr() {
        let c = DrafterTrainConfig::parse(Path::new("c.toml"), GOOD).unwrap();
        assert!((c.lr_at(0) - 1e-4).abs() < 1e-12);
        assert!((c.lr_at(9) - 1e-3).abs() < 1e-12);
        assert!(c.lr_at(10) < 1e-3 && (c.lr_at(10) - 1e-3).abs() < 1e-6);
        // Half-way through the 90 cosine steps (t = 10..=99): the mean of lr and min_lr.
        assert!((c.lr_at(54) - 5.5e-4).abs() < 1e-12);
        // The last step runs at min_lr.
        assert!((c.lr_at(99) - 1e-4).abs() < 1e-12);
        for t in 10..99 {
            assert!(c.lr_at(t + 1) <= c.lr_at(t));
        }
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let e = DrafterTrainConfig::parse(Path::new("c.toml"), &GOOD.replace("gamma", "gama"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("c.toml") && e.contains("gama"), "{e}");
        let e = DrafterTrainConfig::parse(
            Path::new("c.toml"),
            &GOOD.replace("kv_heads = 2", "kv_heads = 3"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("not a multiple"), "{e}");
        let e = DrafterTrainConfig::parse(
            Path::new("c.toml"),
            &GOOD.replace("block_size = 4", "block_size = 1"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("block_size"), "{e}");
    }
}
