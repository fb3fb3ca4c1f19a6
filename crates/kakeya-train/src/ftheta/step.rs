//! One f_θ training step and the held-out evaluation, as functions of the parameters: the
//! query draw, the per-sequence targets and loss, the batch loss, the clipped AdamW update
//! (shared with the drafter trainer through [`crate::optim`]) and the per-layer-type
//! diagnostics. The loop in [`super::train`] calls these; tests drive them directly.

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::{FTheta, Gemma3Model};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::config::FThetaTrainConfig;
use super::data::SeqData;
pub use super::loss::LayerFrozen;
use super::loss::{Diagnostics, LayerTargets, layer_loss, layer_terms};
use super::params::FThetaParams;
use super::train::FEval;
use crate::optim::{AdamW, Moments, backward_and_step};

/// Query positions of a training sequence of `len` positions at 0-based step `step`: `count`
/// distinct positions drawn from `(seed, step, seq)`, sorted.
fn queries(seed: u64, step: usize, seq: usize, len: usize, count: usize) -> Vec<usize> {
    let mut rng = StdRng::seed_from_u64(
        seed ^ ((step as u64) << 20 ^ seq as u64).wrapping_mul(0xD1B5_4A32_D192_ED03),
    );
    let mut all: Vec<usize> = (0..len).collect();
    let n = count.min(len);
    for i in 0..n {
        let j = rng.random_range(i..len);
        all.swap(i, j);
    }
    let mut q = all[..n].to_vec();
    q.sort_unstable();
    q
}

fn evenly(len: usize, count: usize) -> Vec<usize> {
    if count >= len {
        return (0..len).collect();
    }
    let mut q: Vec<usize> = (0..count).map(|i| (i + 1) * len / count - 1).collect();
    q.dedup();
    q
}

fn rows(data: &[f32], width: usize, pick: &[usize]) -> Vec<f32> {
    let mut out = Vec::with_capacity(pick.len() * width);
    for &r in pick {
        out.extend_from_slice(&data[r * width..(r + 1) * width]);
    }
    out
}

fn tensor(data: Vec<f32>, rows: usize, device: &Device) -> Tensor<2> {
    let cols = data.len() / rows.max(1);
    Tensor::from_data(TensorData::new(data, [rows, cols]), device)
}

/// Per-layer targets of one sequence on `device`.
fn targets(s: &SeqData, q_pos: &[usize], attention: bool, device: &Device) -> Vec<LayerTargets> {
    s.layers
        .iter()
        .map(|l| {
            let (q_raw, o) = if attention {
                let qw = l.q.len() / s.len;
                let ow = l.o.len() / s.len;
                (
                    Some(tensor(rows(&l.q, qw, q_pos), q_pos.len(), device)),
                    Some(tensor(rows(&l.o, ow, q_pos), q_pos.len(), device)),
                )
            } else {
                (None, None)
            };
            LayerTargets {
                q_raw,
                q_pos: q_pos.to_vec(),
                k: tensor(l.k.clone(), s.len, device),
                v: tensor(l.v.clone(), s.len, device),
                o,
            }
        })
        .collect()
}

/// Mean loss over the layers of one sequence, and the per-layer terms' diagnostics.
fn sequence_loss(
    model: &FTheta,
    frozen: &[LayerFrozen],
    s: &SeqData,
    tgs: &[LayerTargets],
    cfg: &FThetaTrainConfig,
    device: &Device,
    diagnostics: bool,
) -> (Tensor<1>, Vec<Diagnostics>) {
    let (xk, xv) = model.inputs(
        tensor(s.dk.clone(), s.len, device),
        tensor(s.dv.clone(), s.len, device),
    );
    let zk = model.k.encode(xk);
    let zv = model.v.encode(xv);
    let mut total: Option<Tensor<1>> = None;
    let mut diags = Vec::new();
    for (l, (fr, tg)) in frozen.iter().zip(tgs).enumerate() {
        let k_hat = model.k.decode(zk.clone(), l);
        let v_hat = model.v.decode(zv.clone(), l);
        let terms = layer_terms(fr, tg, k_hat, v_hat);
        let loss = layer_loss(
            cfg.loss.kind,
            &cfg.loss.lambdas,
            cfg.loss.normalize_attention,
            &terms,
        );
        if diagnostics {
            diags.push(terms.diagnostics());
        }
        total = Some(match total {
            Some(t) => t + loss,
            None => loss,
        });
    }
    (
        total
            .expect("the verifier has layers")
            .div_scalar(frozen.len() as f64),
        diags,
    )
}

/// The verifier's frozen attention pieces of every layer f_θ predicts (those with K/V of
/// their own: Gemma 4's KV-sharing layers, the last ones, are left out) on `device` (the
/// autodiff twin when training: they never require gradients).
pub fn frozen_layers(verifier: &Gemma3Model, device: &Device) -> Vec<LayerFrozen> {
    verifier
        .layers
        .iter()
        .take(verifier.config.own_kv_widths().len())
        .map(|l| LayerFrozen::from_attention(&l.attn, device))
        .collect()
}

/// The training loss of 0-based step `t`: per sequence of `batch`, f_θ's K/V at every position
/// and the configured loss at `queries_per_sequence` query positions drawn from
/// `(seed, t, sequence)`, averaged over verifier layers and then over the sequences.
pub fn batch_loss(
    model: &FTheta,
    frozen: &[LayerFrozen],
    batch: &[SeqData],
    cfg: &FThetaTrainConfig,
    t: usize,
    device: &Device,
) -> Tensor<1> {
    let attention = cfg.loss.kind.needs_attention();
    let mut total: Option<Tensor<1>> = None;
    for s in batch {
        let q = queries(
            cfg.train.seed,
            t,
            s.seq,
            s.len,
            cfg.loss.queries_per_sequence,
        );
        let tgs = targets(s, &q, attention, device);
        let (l, _) = sequence_loss(model, frozen, s, &tgs, cfg, device, false);
        total = Some(match total {
            Some(x) => x + l,
            None => l,
        });
    }
    total
        .expect("at least one sequence per step")
        .div_scalar(batch.len() as f64)
}

/// The update of 0-based step `t`: back-propagates `loss` to `leaves` (see [`leaves`]), clips
/// the global gradient norm to `train.grad_clip` and applies AdamW at the schedule's learning
/// rate, with weight decay on every tensor as torch.optim.AdamW does by default. Returns the
/// learning rate and the gradient norm before clipping.
pub fn optimizer_step(
    cfg: &FThetaTrainConfig,
    t: usize,
    loss: Tensor<1>,
    leaves: &[Tensor<2>],
    params: &mut FThetaParams,
    moments: &mut [Moments],
) -> (f64, f64) {
    let (opt, clip) = adamw(cfg, t);
    let norm = backward_and_step(
        loss,
        leaves,
        &mut params.tensors,
        moments,
        &opt,
        clip,
        t + 1,
        &|_| true,
    );
    (opt.lr, norm)
}

/// The AdamW settings of 0-based step `t` and the global clip.
pub fn adamw(cfg: &FThetaTrainConfig, t: usize) -> (AdamW, f64) {
    let o = &cfg.train;
    let opt = AdamW {
        lr: cfg.lr_at(t),
        beta1: o.beta1,
        beta2: o.beta2,
        eps: o.eps,
        weight_decay: o.weight_decay,
    };
    (opt, o.grad_clip)
}

/// Averages per-layer diagnostics by layer type (global or sliding).
fn by_type(per_layer: &[Diagnostics], frozen: &[LayerFrozen], global: bool) -> Diagnostics {
    let picked: Vec<&Diagnostics> = per_layer
        .iter()
        .zip(frozen)
        .filter(|(_, f)| f.is_global() == global)
        .map(|(d, _)| d)
        .collect();
    let n = picked.len().max(1) as f64;
    let mean = |f: &dyn Fn(&Diagnostics) -> f64| picked.iter().map(|d| f(d)).sum::<f64>() / n;
    Diagnostics {
        mse_o_ratio: mean(&|d| d.mse_o_ratio),
        kdir: mean(&|d| d.kdir),
        vdir: mean(&|d| d.vdir),
        kmag: mean(&|d| d.kmag),
        vmag: mean(&|d| d.vmag),
        k_rel_mse: mean(&|d| d.k_rel_mse),
        v_rel_mse: mean(&|d| d.v_rel_mse),
    }
}

/// Evaluates on every held-out sequence (evenly spaced queries), without autodiff. With
/// `oracle`, the verifier's own K/V stand in for f_θ's (the floor of the recomputation).
/// The trainer's held-out figures come from here.
pub fn evaluate(
    model: &FTheta,
    frozen: &[LayerFrozen],
    held: &[SeqData],
    cfg: &FThetaTrainConfig,
    step: usize,
    oracle: bool,
) -> FEval {
    let device = frozen[0].o_proj.device();
    let layers = frozen.len();
    let mut sums = vec![Diagnostics::default(); layers];
    let mut loss = 0.0;
    let mut nq = 0;
    for s in held {
        let q = evenly(s.len, cfg.output.eval_queries);
        nq += q.len();
        let tgs = targets(s, &q, cfg.loss.kind.needs_attention(), &device);
        let (l, diags) = if oracle {
            let mut diags = Vec::new();
            let mut total = 0.0;
            for (fr, tg) in frozen.iter().zip(&tgs) {
                let t = layer_terms(fr, tg, tg.k.clone(), tg.v.clone());
                total += f64::from(
                    layer_loss(
                        cfg.loss.kind,
                        &cfg.loss.lambdas,
                        cfg.loss.normalize_attention,
                        &t,
                    )
                    .into_scalar::<f32>(),
                );
                diags.push(t.diagnostics());
            }
            (total / layers as f64, diags)
        } else {
            let (l, d) = sequence_loss(model, frozen, s, &tgs, cfg, &device, true);
            (f64::from(l.into_scalar::<f32>()), d)
        };
        loss += l;
        for (acc, d) in sums.iter_mut().zip(diags) {
            acc.mse_o_ratio += d.mse_o_ratio;
            acc.kdir += d.kdir;
            acc.vdir += d.vdir;
            acc.kmag += d.kmag;
            acc.vmag += d.vmag;
            acc.k_rel_mse += d.k_rel_mse;
            acc.v_rel_mse += d.v_rel_mse;
        }
    }
    let n = held.len().max(1) as f64;
    let per_layer: Vec<Diagnostics> = sums
        .into_iter()
        .map(|d| Diagnostics {
            mse_o_ratio: d.mse_o_ratio / n,
            kdir: d.kdir / n,
            vdir: d.vdir / n,
            kmag: d.kmag / n,
            vmag: d.vmag / n,
            k_rel_mse: d.k_rel_mse / n,
            v_rel_mse: d.v_rel_mse / n,
        })
        .collect();
    FEval {
        step,
        loss: loss / n,
        sliding: by_type(&per_layer, frozen, false),
        global: by_type(&per_layer, frozen, true),
        per_layer,
        sequences: held.len(),
        queries: nq,
    }
}
