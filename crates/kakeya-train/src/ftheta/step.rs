//! One f_θ training step and the held-out evaluation, as functions of the parameters: the
//! query draw, the per-sequence targets and loss, the batch loss, the clipped AdamW update
//! (shared with the drafter trainer through [`crate::optim`]) and the per-layer-type
//! diagnostics. The loop in [`super::train`] calls these; tests drive them directly.

use burn::tensor::{AllocationProperty, Device, Tensor, TensorData};
use kakeya_models::{FTheta, GemmaModel};
use kakeya_weights::FThetaConfig;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::config::FThetaTrainConfig;
use super::data::SeqData;
use super::frozen::GroupShape;
use super::loss::{Diagnostics, GroupTargets, Rows, group_loss, group_terms, layer_loss};
pub use super::loss::{GroupFrozen, LayerFrozen};
use super::params::FThetaParams;
use super::pass::PassInputs;
use super::targets::{HostTargets, TargetData};
use super::train::FEval;
use crate::optim::{AdamW, Moments, backward_and_step, sum_all};

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

fn rows_of(data: &[f32], width: usize, pick: &[usize]) -> Vec<f32> {
    let mut out = Vec::with_capacity(pick.len() * width);
    for &r in pick {
        out.extend_from_slice(&data[r * width..(r + 1) * width]);
    }
    out
}

/// What gathering a group's targets needs of it: its verifier layers and its host side
/// (plain data, for the reader's thread).
#[derive(Debug, Clone)]
pub struct GroupLayout {
    ids: Vec<usize>,
    shape: GroupShape,
}

/// The layouts of `groups`, in order.
pub fn layouts(groups: &[GroupFrozen]) -> Vec<GroupLayout> {
    groups
        .iter()
        .map(|g| GroupLayout {
            ids: g.ids.clone(),
            shape: g.shape().clone(),
        })
        .collect()
}

/// One group's targets for a batch of sequences (`q_pos[i]`: the queries of `batch[i]`), their
/// rows one after the other, padded to multiples of `pad` ([`Rows::pad`]), prepared on the
/// host ([`HostTargets`]; with `raw`, the raw keys and values too).
fn gather(
    batch: &[&SeqData],
    g: &GroupLayout,
    q_pos: &[Vec<usize>],
    (attention, raw): (bool, bool),
    pad: usize,
) -> HostTargets {
    let mut rows = Rows::default();
    for (s, qp) in batch.iter().zip(q_pos) {
        rows.push(s.len, qp);
    }
    rows.pad(pad);
    let mut h = HostTargets::new(&g.shape, g.ids.len(), rows, batch.len(), attention, raw);
    for &id in &g.ids {
        for (s, qp) in batch.iter().zip(q_pos) {
            let d = &s.layers[id];
            let pick = |x: &[f32]| rows_of(x, x.len() / s.len, qp);
            let (q, o) = match attention {
                true => (Some(pick(&d.q)), Some(pick(&d.o))),
                false => (None, None),
            };
            h.push(&g.shape, &d.k, &d.v, q.as_deref(), o.as_deref());
        }
        h.end_member(&g.shape);
    }
    h
}

/// A step's host work, done ahead of it (on the reader's thread in training): per pass of
/// [`Passes`], how many of the step's sequences it takes and each group's gathered targets.
#[derive(Debug, Clone)]
pub struct Prepared {
    passes: Vec<(usize, Vec<TargetData>)>,
}

impl Prepared {
    /// The step's one pass's targets (every sequence of the step: on a GPU,
    /// [`Passes::for_device`]), moved out, or the step back where it takes several.
    pub fn into_single_pass(mut self) -> Result<Vec<TargetData>, Self> {
        match self.passes.len() {
            1 => Ok(self.passes.pop().expect("one pass").1),
            _ => Err(self),
        }
    }

    /// Moves every target buffer of `steps` into `device`'s transfer memory, in one call on
    /// the calling thread, and returns their bytes and how many of them are now pinned. On
    /// CUDA that memory is pinned host memory, which the upload then copies from directly;
    /// elsewhere (and where CubeCL's pinned pool is spent) the buffers stay as they are.
    /// Without it, CubeCL copies each buffer into pinned memory at upload, on its one device
    /// thread, where the step's launches queue behind the copy. The trainer stages a round of
    /// steps at once from its reader's one long-lived thread: CubeCL keeps a pinned pool per
    /// stream (a thread's id modulo 128), and each staging call waits for the device thread's
    /// queue.
    pub fn stage<'a>(
        steps: impl IntoIterator<Item = &'a mut Prepared>,
        device: &Device,
    ) -> (usize, usize) {
        let mut buffers: Vec<&mut TensorData> = steps
            .into_iter()
            .flat_map(|p| p.passes.iter_mut())
            .flat_map(|(_, tgs)| tgs.iter_mut())
            .flat_map(TargetData::buffers)
            .collect();
        device.staging(buffers.iter_mut().map(|b| &mut **b));
        buffers.iter().fold((0, 0), |(all, pinned), b| {
            let n = b.bytes().len();
            let is = matches!(b.bytes().property(), AllocationProperty::Pinned);
            (all + n, pinned + if is { n } else { 0 })
        })
    }
}

/// [`Prepared`] for 0-based step `t` over `batch`: the query draw and the gathering of
/// [`batch_loss`], without the device.
pub fn prepare_step(
    layouts: &[GroupLayout],
    batch: &[SeqData],
    cfg: &FThetaTrainConfig,
    t: usize,
    passes: Passes,
) -> Prepared {
    let attention = cfg.loss.kind.needs_attention();
    let passes = batch
        .chunks(passes.sequences.max(1))
        .map(|part| {
            let part: Vec<&SeqData> = part.iter().collect();
            let q: Vec<Vec<usize>> = part
                .iter()
                .map(|s| {
                    let n = cfg.loss.queries_per_sequence;
                    queries(cfg.train.seed, t, s.seq, s.len, n)
                })
                .collect();
            let tgs = layouts
                .iter()
                // The losses without attention go through the terms, which read raw targets.
                .map(|g| gather(&part, g, &q, (attention, !attention), passes.pad).into_data())
                .collect();
            (part.len(), tgs)
        })
        .collect();
    Prepared { passes }
}

/// The sum over the layers of the per-layer losses of a batch of sequences, each term the sum
/// over the sequences of its per-sequence mean (f_θ's decoders of a width group in one
/// product, a group's terms over every sequence in one pass), and each layer's diagnostics (by
/// layer index; one sequence only) when asked (`inputs` made with `diagnostics`).
pub fn sequence_loss(
    model: &FTheta,
    groups: &[GroupFrozen],
    inputs: &PassInputs,
    cfg: &FThetaTrainConfig,
    diagnostics: bool,
) -> (Tensor<1>, Vec<(usize, Diagnostics)>) {
    let (kind, lambdas, normalize) = (
        cfg.loss.kind,
        &cfg.loss.lambdas,
        cfg.loss.normalize_attention,
    );
    let (tgs, weights) = (&inputs.tgs, &inputs.weights);
    let device = inputs.sides[0].device();
    let [dk, dv] = inputs.sides.clone();
    let (xk, xv) = model.inputs(dk, dv);
    let zk = model.k.encode(xk);
    let zv = model.v.encode(xv);
    let mut total: Option<Tensor<1>> = None;
    let mut diags = Vec::new();
    // Each decoder group's outputs once, `[L, n, width]`; a loss group takes its members' rows.
    let k_all: Vec<Tensor<3>> = model.k.dec.iter().map(|d| d.forward(zk.clone())).collect();
    let v_all: Vec<Tensor<3>> = model.v.dec.iter().map(|d| d.forward(zv.clone())).collect();
    for (i, (fr, tg)) in groups.iter().zip(tgs).enumerate() {
        let (g, rows) = decoder_rows(model, &fr.ids);
        let pick = |all: &Tensor<3>| match &rows {
            None => all.clone(),
            Some(r) => {
                let ids: Vec<i64> = r.iter().map(|&i| i as i64).collect();
                let n = ids.len();
                all.clone()
                    .select(0, Tensor::from_data(TensorData::new(ids, [n]), &device))
            }
        };
        let (k_hat, v_hat) = (pick(&k_all[g]), pick(&v_all[g]));
        let loss = if diagnostics {
            let terms = group_terms(fr, tg, k_hat, v_hat);
            diags.extend(fr.ids.iter().copied().zip(terms.diagnostics()));
            sum_all(layer_loss(kind, lambdas, normalize, &terms))
        } else {
            let w = &weights[i];
            group_loss(fr, tg, w, k_hat, v_hat, (kind, lambdas, normalize))
        };
        total = Some(match total {
            Some(t) => t + loss,
            None => loss,
        });
    }
    (total.expect("the verifier has layers"), diags)
}

/// Which of f_θ's decoder groups predicts the layers `ids`, and their rows in its output
/// (`None`: all of them, in order).
fn decoder_rows(model: &FTheta, ids: &[usize]) -> (usize, Option<Vec<usize>>) {
    let (g, d) = model
        .k
        .dec
        .iter()
        .enumerate()
        .find(|(_, d)| d.layers.contains(&ids[0]))
        .expect("f_θ predicts every layer the loss reads");
    if d.layers == ids {
        return (g, None);
    }
    let rows = ids
        .iter()
        .map(|l| {
            d.layers
                .iter()
                .position(|x| x == l)
                .expect("a loss group lies within one decoder group")
        })
        .collect();
    (g, Some(rows))
}

/// The frozen layers stacked in groups the loss runs at once: f_θ's decoder groups
/// ([`FThetaConfig::width_groups`]), each split further by attention shape where its layers
/// differ (heads, head width, scale, value norm: equal KV widths need not mean equal shapes).
pub fn frozen_groups(layers: &[LayerFrozen], config: &FThetaConfig) -> Vec<GroupFrozen> {
    let shape = |l: &LayerFrozen| {
        (
            l.heads,
            l.kv_heads,
            l.head_dim,
            l.scale.to_bits(),
            l.v_norm.is_some(),
        )
    };
    let mut groups = Vec::new();
    for (_, ids) in config.width_groups() {
        let mut split: Vec<(_, Vec<usize>)> = Vec::new();
        for l in ids {
            match split.iter_mut().find(|(s, _)| *s == shape(&layers[l])) {
                Some((_, members)) => members.push(l),
                None => split.push((shape(&layers[l]), vec![l])),
            }
        }
        for (_, ids) in split {
            let members = ids.iter().map(|&l| layers[l].clone()).collect();
            groups.push(GroupFrozen::new(ids, members));
        }
    }
    groups
}

/// The verifier's frozen attention pieces of every layer f_θ predicts (those with K/V of
/// their own: Gemma 4's KV-sharing layers, the last ones, are left out) on `device` (the
/// autodiff twin when training: they never require gradients).
pub fn frozen_layers(verifier: &GemmaModel, device: &Device) -> Vec<LayerFrozen> {
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
    frozen: &[GroupFrozen],
    batch: &[SeqData],
    cfg: &FThetaTrainConfig,
    t: usize,
    device: &Device,
) -> Tensor<1> {
    batch_loss_in(
        model,
        frozen,
        batch,
        cfg,
        t,
        device,
        Passes::for_device(device),
    )
}

/// How [`batch_loss`] splits a step's sequences into passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Passes {
    /// Sequences per pass.
    pub sequences: usize,
    /// Rows and queries of a pass padded to a multiple of this ([`Rows::pad`]).
    pub pad: usize,
}

impl Passes {
    /// On a GPU, where a pass is bound by its launches and each new shape costs kernel
    /// compilations, every sequence in one pass padded to multiples of 128 rows; on the CPU,
    /// one sequence a pass, unpadded (a joint pass would only add the masked-out
    /// cross-sequence attention scores).
    pub fn for_device(device: &Device) -> Self {
        if kakeya_models::gpu::is_gpu(device) {
            Self {
                sequences: usize::MAX,
                pad: 128,
            }
        } else {
            Self {
                sequences: 1,
                pad: 1,
            }
        }
    }
}

/// [`batch_loss`] in the given passes (the value is the same up to f32 rounding however the
/// sequences are split and padded).
pub fn batch_loss_in(
    model: &FTheta,
    frozen: &[GroupFrozen],
    batch: &[SeqData],
    cfg: &FThetaTrainConfig,
    t: usize,
    device: &Device,
    passes: Passes,
) -> Tensor<1> {
    let prepared = prepare_step(&layouts(frozen), batch, cfg, t, passes);
    prepared_loss(model, frozen, batch, prepared, cfg, device)
}

/// [`batch_loss`] of a step prepared ahead ([`prepare_step`] over the same `batch`): each
/// pass's targets uploaded, then its loss. Of `batch` only the lengths and the drafter's side
/// are read (the reader drops the verifier's tensors once they are prepared).
pub fn prepared_loss(
    model: &FTheta,
    frozen: &[GroupFrozen],
    batch: &[SeqData],
    prepared: Prepared,
    cfg: &FThetaTrainConfig,
    device: &Device,
) -> Tensor<1> {
    let mut total: Option<Tensor<1>> = None;
    let mut first = 0;
    for (n, host) in prepared.passes {
        let part: Vec<&SeqData> = batch[first..first + n].iter().collect();
        first += n;
        let started = std::time::Instant::now();
        let inputs = PassInputs::training(&part, host, cfg, device);
        let uploaded = started.elapsed();
        let (l, _) = sequence_loss(model, frozen, &inputs, cfg, false);
        tracing::debug!(
            upload_ms = uploaded.as_secs_f64() * 1e3,
            loss_ms = (started.elapsed() - uploaded).as_secs_f64() * 1e3,
            "a pass's targets uploaded and its loss queued (host time)"
        );
        total = Some(match total {
            Some(x) => x + l,
            None => l,
        });
    }
    let layers: usize = frozen.iter().map(|g| g.ids.len()).sum();
    total
        .expect("at least one sequence per step")
        .div_scalar((batch.len() * layers) as f64)
}

/// The update of 0-based step `t`: back-propagates `loss` to `leaves` (see
/// [`crate::run::leaves`]), clips the global gradient norm to `train.grad_clip` and applies
/// AdamW at the schedule's learning rate, with weight decay on every tensor as
/// torch.optim.AdamW does by default. Returns the learning rate and the gradient norm before
/// clipping (a [`crate::TrainError::Device`] where the device failed to run the step).
pub fn optimizer_step(
    cfg: &FThetaTrainConfig,
    t: usize,
    loss: Tensor<1>,
    leaves: &[Tensor<2>],
    params: &mut FThetaParams,
    moments: &mut [Moments],
) -> crate::error::Result<(f64, f64)> {
    let (opt, clip) = adamw(cfg, t);
    let (_, norm) = backward_and_step(
        loss,
        leaves,
        &mut params.tensors,
        moments,
        &opt,
        clip,
        t + 1,
        &|_| true,
    )
    .read()?;
    Ok((opt.lr, norm))
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
fn by_type(per_layer: &[Diagnostics], global_layers: &[bool], global: bool) -> Diagnostics {
    let picked: Vec<&Diagnostics> = per_layer
        .iter()
        .zip(global_layers)
        .filter(|(_, g)| **g == global)
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
/// The trainer's held-out figures come from here; a [`crate::TrainError::Device`] where the
/// device failed to run them.
pub fn evaluate(
    model: &FTheta,
    frozen: &[GroupFrozen],
    held: &[SeqData],
    cfg: &FThetaTrainConfig,
    step: usize,
    oracle: bool,
) -> crate::error::Result<FEval> {
    let device = frozen[0].layers[0].o_proj.device();
    let layers: usize = frozen.iter().map(|g| g.ids.len()).sum();
    let mut global_layers = vec![false; layers];
    for g in frozen {
        for (&id, fr) in g.ids.iter().zip(&g.layers) {
            global_layers[id] = fr.is_global();
        }
    }
    let mut sums = vec![Diagnostics::default(); layers];
    let mut loss = 0.0;
    let mut nq = 0;
    let (shapes, attention) = (layouts(frozen), cfg.loss.kind.needs_attention());
    for s in held {
        let q = evenly(s.len, cfg.output.eval_queries);
        nq += q.len();
        let tgs: Vec<GroupTargets> = shapes
            .iter()
            .map(|g| {
                gather(&[s], g, std::slice::from_ref(&q), (attention, true), 1).upload(&device)
            })
            .collect();
        let (l, diags) = if oracle {
            let mut diags = Vec::new();
            let mut total = 0.0;
            for (fr, tg) in frozen.iter().zip(&tgs) {
                let (k, v) = tg.kv.clone().expect("uploaded raw");
                let t = group_terms(fr, tg, k, v);
                let l = layer_loss(
                    cfg.loss.kind,
                    &cfg.loss.lambdas,
                    cfg.loss.normalize_attention,
                    &t,
                );
                total += f64::from(crate::run::read_f32(sum_all(l))?[0]);
                diags.extend(fr.ids.iter().copied().zip(t.diagnostics()));
            }
            (total / layers as f64, diags)
        } else {
            let inputs = PassInputs::new(&[s], tgs, cfg, &device, true);
            let (l, d) = sequence_loss(model, frozen, &inputs, cfg, true);
            (f64::from(crate::run::read_f32(l)?[0]) / layers as f64, d)
        };
        loss += l;
        for (id, d) in diags {
            let acc = &mut sums[id];
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
    Ok(FEval {
        step,
        loss: loss / n,
        sliding: by_type(&per_layer, &global_layers, false),
        global: by_type(&per_layer, &global_layers, true),
        per_layer,
        sequences: held.len(),
        queries: nq,
    })
}
