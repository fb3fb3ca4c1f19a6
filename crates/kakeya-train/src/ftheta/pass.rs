//! What a pass of f_θ's loss reads on the device ([`PassInputs`]): each group's targets, the
//! training loss's weights and the drafter's side, uploaded before the pass launches anything.

use burn::tensor::{Device, Tensor, TensorData};

use super::FThetaTrainConfig;
use super::data::SeqData;
use super::loss::LossWeights;
use super::targets::{GroupTargets, TargetData};

/// What a pass's loss reads on the device: each group's targets, the training loss's weights
/// (none for diagnostics) and the drafter's K and V side, `[R, width]` each, padded like the
/// targets' rows.
#[derive(Debug, Clone)]
pub struct PassInputs {
    /// Each group's targets.
    pub tgs: Vec<GroupTargets>,
    /// Each group's [`GroupTargets::loss_weights`] (empty for diagnostics).
    pub weights: Vec<LossWeights>,
    /// The drafter's K and V rows.
    pub sides: [Tensor<2>; 2],
}

impl PassInputs {
    /// A training pass's inputs: the targets prepared ahead (`host`, one per group) uploaded,
    /// then [`Self::new`].
    pub fn training(
        batch: &[&SeqData],
        host: Vec<TargetData>,
        cfg: &FThetaTrainConfig,
        device: &Device,
    ) -> Self {
        let tgs = host.into_iter().map(|h| h.upload(device)).collect();
        Self::new(batch, tgs, cfg, device, false)
    }

    /// The targets `tgs` of the sequences `batch` with their weights (unless `diagnostics`)
    /// and drafter side uploaded (before anything launches: on a GPU an upload queued behind
    /// kernels may wait for them).
    pub fn new(
        batch: &[&SeqData],
        tgs: Vec<GroupTargets>,
        cfg: &FThetaTrainConfig,
        device: &Device,
        diagnostics: bool,
    ) -> Self {
        let (kind, lambdas, normalize) = (
            cfg.loss.kind,
            &cfg.loss.lambdas,
            cfg.loss.normalize_attention,
        );
        let weights = match diagnostics {
            true => Vec::new(),
            false => tgs
                .iter()
                .map(|tg| tg.loss_weights(kind, lambdas, normalize, device))
                .collect(),
        };
        // The rows the targets hold: the sequences', then padding.
        let rows = tgs[0].rows.k_pos.len();
        let side = |pick: &dyn Fn(&SeqData) -> &[f32]| {
            let mut all: Vec<f32> = batch.iter().flat_map(|s| pick(s).iter().copied()).collect();
            let width = all.len() / batch.iter().map(|s| s.len).sum::<usize>().max(1);
            all.resize(rows * width, 0.0);
            let cols = all.len() / rows.max(1);
            Tensor::from_data(TensorData::new(all, [rows, cols]), device)
        };
        let sides = [side(&|s| &s.dk), side(&|s| &s.dv)];
        Self {
            tgs,
            weights,
            sides,
        }
    }

    /// Every device tensor, flattened (views of the same buffers, off the autodiff graph), in a
    /// fixed order, with its shape.
    pub fn tensors(&self) -> Vec<(Vec<usize>, Tensor<1>)> {
        let mut all = Vec::new();
        for tg in &self.tgs {
            tg.tensors(&mut all);
        }
        for w in &self.weights {
            w.tensors(&mut all);
        }
        for s in &self.sides {
            push_flat(&mut all, s);
        }
        all
    }
}

/// `t`'s shape and its flat view (off the autodiff graph: the inputs are constants), onto
/// `all`.
pub fn push_flat<const D: usize>(all: &mut Vec<(Vec<usize>, Tensor<1>)>, t: &Tensor<D>) {
    let dims = t.dims().to_vec();
    let n = t.shape().num_elements();
    all.push((dims, t.clone().inner().reshape([n])));
}
