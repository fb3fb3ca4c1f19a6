//! The drafter training loop: data and vocabulary, fresh or resumed state, steps, held-out
//! evaluation, periodic checkpoints, export, report and curves.
//!
//! Resuming is exact: every step's batch is drawn from an RNG seeded by `(seed, step)`, the
//! schedule is a function of the step, and the state (weights, Adam moments, step, history)
//! is saved in f32 — so a run interrupted after any checkpoint and resumed reaches the same
//! weights as an uninterrupted one.

use std::path::PathBuf;

use burn::tensor::Tensor;
use kakeya_capture::Dataset;
use kakeya_models::GemmaModel;
use kakeya_weights::DFlashConfig;
use kakeya_weights::dflash::default_target_layers;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::config::DrafterTrainConfig;
use crate::data::{self, Sequence, TrainData};
use crate::drafter::{self, Batch, DrafterParams, Frozen};
use crate::error::{Result, TrainError};
use crate::optim::AdamW;
use crate::plot;
use crate::run::{self, Cadence, Trainer};

pub use crate::run::{StepRecord, TrainOptions};

/// One held-out evaluation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    /// Steps done when evaluated.
    pub step: usize,
    /// Weighted cross-entropy on the held-out anchors.
    pub loss: f64,
    /// Simulated mean acceptance length under greedy verification (tokens committed per
    /// block: accepted drafts + the verifier's own token), `1..=B`.
    pub acceptance_length: f64,
    /// Share of blocks whose drafts `1..=k` were all accepted, per slot `k`.
    pub per_slot_acceptance: Vec<f64>,
    /// Anchors evaluated.
    pub anchors: usize,
}

/// What [`train_drafter`] reports as it goes.
pub type Event = crate::run::Event<EvalRecord>;

/// The drafter's own part of the saved state: the draft vocabulary it was trained with.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Vocab {
    d2t: Option<Vec<u32>>,
}

/// The run's report (`report.json`).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The config.
    pub config: DrafterTrainConfig,
    /// Drafter hyper-parameters as exported.
    pub drafter: serde_json::Value,
    /// Trainable parameters.
    pub parameters: usize,
    /// Training / held-out sequences and generated positions.
    pub data: serde_json::Value,
    /// Share of generated tokens the draft vocabulary covers (train, held-out).
    pub draft_vocab_coverage: (f64, f64),
    /// Device.
    pub device: String,
    /// Median seconds per step of this invocation.
    pub secs_per_step: f64,
    /// Evaluations, the first before any training.
    pub evals: Vec<EvalRecord>,
    /// Per-step records.
    pub steps: Vec<StepRecord>,
    /// Exported drafter folder.
    pub export: PathBuf,
    /// Per aux channel, the divisor the training inputs had (folded into the exported `fc`).
    pub input_scales: Vec<f32>,
}

/// Everything prepared before the first step: checked inputs, data, vocabulary, shape.
pub struct Prepared {
    /// Split data.
    pub data: TrainData,
    /// Draft vocabulary (draft id → verifier id), when reduced.
    pub d2t: Option<Vec<u32>>,
    /// The drafter's shape.
    pub config: DFlashConfig,
    fingerprint: String,
}

/// Checks the dataset against the config and the verifier and loads it. Errors here come
/// before anything is trained or written.
pub fn prepare(
    cfg: &DrafterTrainConfig,
    verifier: &GemmaModel,
    verifier_sha: &str,
) -> Result<Prepared> {
    let v = &verifier.config;
    let m = &cfg.model;
    let targets = m
        .target_layers
        .clone()
        .unwrap_or_else(|| default_target_layers(v.num_hidden_layers, m.layers));
    if let Some(&bad) = targets.iter().find(|&&l| l >= v.num_hidden_layers) {
        return Err(TrainError::invalid(
            &m.verifier,
            format!(
                "target layer {bad} does not exist (the verifier has {} layers)",
                v.num_hidden_layers
            ),
        ));
    }
    if m.mask_token as usize >= v.vocab_size {
        return Err(TrainError::invalid(
            &m.verifier,
            format!(
                "mask_token {} is outside the vocabulary of {}",
                m.mask_token, v.vocab_size
            ),
        ));
    }
    let dir = &cfg.data.dataset;
    let ds = Dataset::open(dir)?;
    data::check_dataset(&ds, dir, &targets, verifier_sha, v.hidden_size)?;
    let data = data::load(&ds, &targets, cfg.data.heldout_every)?;
    if data.train.is_empty() || data.heldout.is_empty() {
        return Err(TrainError::invalid(
            dir,
            format!(
                "{} training and {} held-out sequences with generated tokens: need at least one of each",
                data.train.len(),
                data.heldout.len()
            ),
        ));
    }
    let d2t = (m.draft_vocab > 0 && m.draft_vocab < v.vocab_size)
        .then(|| data::draft_vocab(&data.train, m.draft_vocab, v.vocab_size));
    let config = DFlashConfig {
        hidden_size: v.hidden_size,
        intermediate_size: m.intermediate,
        num_hidden_layers: m.layers,
        num_attention_heads: m.heads,
        num_key_value_heads: m.kv_heads,
        head_dim: m.head_dim,
        rms_norm_eps: 1e-6,
        rope_theta: m.rope_theta,
        vocab_size: v.vocab_size,
        max_position_embeddings: v.max_position_embeddings,
        block_size: m.block_size,
        mask_token_id: m.mask_token,
        target_layer_ids: targets,
        num_target_layers: v.num_hidden_layers,
        draft_vocab_size: d2t.as_ref().map(Vec::len),
        layer_windows: vec![None; m.layers],
    };
    let shards: Vec<&str> = ds
        .manifest()
        .shards
        .iter()
        .map(|s| s.sha256.as_str())
        .collect();
    let fingerprint =
        serde_json::to_string(&(&cfg.data, &cfg.model, &cfg.train, verifier_sha, &shards))
            .expect("fingerprint serialises");
    Ok(Prepared {
        data,
        d2t,
        config,
        fingerprint,
    })
}

/// Trains (or resumes) a drafter as `cfg` says, exports it, and writes `report.json` and
/// `curves.png` into the run folder.
pub fn train_drafter(
    cfg: &DrafterTrainConfig,
    verifier: &GemmaModel,
    prep: Prepared,
    opts: &TrainOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<Report> {
    let device = opts.device.clone();
    let Prepared {
        data,
        d2t,
        config,
        fingerprint,
    } = prep;
    let out = &cfg.output.dir;
    let mut opened = run::open(
        out,
        opts.resume,
        &fingerprint,
        (config.expected_tensors(), &device),
        |named| DrafterParams::from_named(config.clone(), named),
        || {
            let params = match &cfg.model.init {
                Some(dir) => DrafterParams::from_checkpoint(&config, dir, &data.scales, &device)?,
                None => DrafterParams::init(config.clone(), cfg.train.seed, &device),
            };
            Ok((params, Vocab { d2t: d2t.clone() }))
        },
    )?;
    if opened.state.extra.d2t != d2t {
        return Err(TrainError::invalid(
            &out.join("state"),
            "the saved draft vocabulary differs from the one the data gives",
        ));
    }
    let mut trainer = DrafterRun {
        cfg,
        // On the training device (the verifier may sit on another: the CPU that captured).
        frozen: Frozen::new(
            verifier.embed.clone(),
            config.hidden_size,
            d2t.as_deref(),
            &device,
        ),
        data: &data,
    };
    let cadence = Cadence {
        steps: cfg.train.steps,
        eval_every: cfg.output.eval_every,
        checkpoint_every: cfg.output.checkpoint_every,
    };
    let secs = run::run_steps(&mut trainer, &mut opened, out, cadence, opts, on_event)?;
    let (params, state) = (opened.params, opened.state);
    let ck = params.to_checkpoint(d2t.clone(), &data.scales);
    crate::state::replace_dir(&cfg.output.export, |dir| {
        ck.write_dir_as(dir, cfg.output.export_dtype)
            .map_err(TrainError::from)
    })?;
    let generated = |s: &[Sequence]| -> usize { s.iter().map(|q| q.len() - q.first_gen).sum() };
    let report = Report {
        config: cfg.clone(),
        drafter: config.to_json(),
        parameters: params.count(),
        data: serde_json::json!({
            "dataset": cfg.data.dataset,
            "train_sequences": data.train.len(),
            "heldout_sequences": data.heldout.len(),
            "train_generated_positions": generated(&data.train),
            "heldout_generated_positions": generated(&data.heldout),
            "saturated_aux_values": data.saturated,
        }),
        draft_vocab_coverage: match &d2t {
            Some(m) => (
                data::coverage(&data.train, m),
                data::coverage(&data.heldout, m),
            ),
            None => (1.0, 1.0),
        },
        device: format!("{device:?}"),
        secs_per_step: run::median_secs(secs),
        evals: state.evals.clone(),
        steps: state.steps.clone(),
        export: cfg.output.export.clone(),
        input_scales: data.scales.clone(),
    };
    let png = plot::curves(&state.steps, &state.evals, config.block_size);
    run::write_outputs(out, &report, &png)?;
    Ok(report)
}

/// The batch of 0-based step `t`: `sequences_per_step` distinct training sequences (drawn in
/// proportion to their anchors) and `anchors_per_sequence` anchors in each.
fn pick<'a>(
    train: &'a [Sequence],
    cfg: &DrafterTrainConfig,
    t: usize,
) -> Vec<(&'a Sequence, Vec<usize>)> {
    let mut rng =
        StdRng::seed_from_u64(cfg.train.seed ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let weights: Vec<usize> = train.iter().map(|s| s.anchor_range().len()).collect();
    let total: usize = weights.iter().sum();
    let want = cfg.train.sequences_per_step.min(train.len());
    let mut chosen: Vec<usize> = Vec::with_capacity(want);
    let mut tries = 0;
    while chosen.len() < want && tries < 100 * want {
        tries += 1;
        let mut u = rng.random_range(0..total);
        let mut i = 0;
        while u >= weights[i] {
            u -= weights[i];
            i += 1;
        }
        if !chosen.contains(&i) {
            chosen.push(i);
        }
    }
    chosen
        .into_iter()
        .map(|i| {
            let r = train[i].anchor_range();
            let mut a: Vec<usize> = (0..cfg.train.anchors_per_sequence)
                .map(|_| rng.random_range(r.clone()))
                .collect();
            a.sort_unstable();
            (&train[i], a)
        })
        .collect()
}

/// The drafter's part of the shared loop ([`run::run_steps`]).
struct DrafterRun<'a> {
    cfg: &'a DrafterTrainConfig,
    frozen: Frozen,
    data: &'a TrainData,
}

impl Trainer for DrafterRun<'_> {
    type Params = DrafterParams;
    type Eval = EvalRecord;

    fn loss(
        &mut self,
        t: usize,
        params: &DrafterParams,
        leaves: &[Tensor<2>],
    ) -> Result<Tensor<1>> {
        let picks = pick(&self.data.train, self.cfg, t);
        let batch = Batch::build(self.data.width, params.config.block_size, &picks);
        let logits = params.forward(leaves, &self.frozen, &batch);
        Ok(drafter::weighted_ce(&logits, &batch, &self.frozen, self.cfg.train.gamma).0)
    }

    fn optimizer(&self, t: usize) -> (AdamW, f64) {
        let o = &self.cfg.train;
        let opt = AdamW {
            lr: self.cfg.lr_at(t),
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            weight_decay: o.weight_decay,
        };
        (opt, o.grad_clip)
    }

    /// No decay on norm multipliers (1-D tensors).
    fn decays(&self, shape: &[usize]) -> bool {
        shape.len() > 1
    }

    fn evaluate(&mut self, step: usize, params: &DrafterParams) -> Result<EvalRecord> {
        evaluate(params, &self.frozen, self.data, self.cfg, step)
    }
}

/// Held-out metrics over anchors spread evenly across the held-out sequences (full blocks
/// only), with the current weights and no autodiff.
fn evaluate(
    params: &DrafterParams,
    frozen: &Frozen,
    data: &TrainData,
    cfg: &DrafterTrainConfig,
    step: usize,
) -> Result<EvalRecord> {
    let bsz = params.config.block_size;
    let mut all: Vec<(usize, usize)> = Vec::new();
    for (i, s) in data.heldout.iter().enumerate() {
        let r = s.anchor_range();
        let end = (s.len() + 1).saturating_sub(bsz).min(r.end);
        all.extend((r.start..end).map(|a| (i, a)));
    }
    let stride = all.len().div_ceil(cfg.output.eval_anchors).max(1);
    let chosen: Vec<(usize, usize)> = all.into_iter().step_by(stride).collect();
    let weights = run::values(&params.tensors);
    let (mut loss_sum, mut w_sum, mut acc_sum) = (0.0, 0.0, 0usize);
    let mut per_slot = vec![0usize; bsz - 1];
    let mut start = 0;
    while start < chosen.len() {
        let seq = chosen[start].0;
        let mut end = start;
        while end < chosen.len() && chosen[end].0 == seq && end - start < 64 {
            end += 1;
        }
        let anchors: Vec<usize> = chosen[start..end].iter().map(|&(_, a)| a).collect();
        let batch = Batch::build(data.width, bsz, &[(&data.heldout[seq], anchors)]);
        let logits = params.forward(&weights, frozen, &batch);
        let (loss, w) = drafter::weighted_ce(&logits, &batch, frozen, cfg.train.gamma);
        loss_sum += f64::from(crate::run::read_f32(loss)?[0]) * w;
        w_sum += w;
        for (drafts, targets) in frozen.greedy(&logits, bsz - 1).iter().zip(&batch.targets) {
            let a = drafter::acceptance(drafts, targets);
            acc_sum += a;
            for c in per_slot.iter_mut().take(a - 1) {
                *c += 1;
            }
        }
        start = end;
    }
    let n = chosen.len().max(1) as f64;
    Ok(EvalRecord {
        step,
        loss: loss_sum / w_sum.max(1e-12),
        acceptance_length: acc_sum as f64 / n,
        per_slot_acceptance: per_slot.iter().map(|&c| c as f64 / n).collect(),
        anchors: chosen.len(),
    })
}
