//! The f_θ training step recorded once and replayed (`[train] graph`, on a GPU): on CUDA one
//! graph launch a step instead of the ~200 launches the host issues one by one (the step was
//! bound by issuing them: docs/benchmarks.md, "f_θ training and its step time"). Burn's
//! [`capture`] records the step's launches into a CUDA graph and [`Graph::replay`] re-runs
//! them against the buffers they used when recorded. CubeCL records on wgpu too (its command
//! buffers), so lavapipe replays real recordings; on a device that records nothing a replay
//! would re-run the step, and the trainer then issues its steps one by one instead.
//!
//! What a recorded step reads and writes must therefore stay in the same buffers from step to
//! step: the pass's inputs ([`PassInputs`]) are copied into the buffers the recording read
//! ([`gpu::copy_into`]); the parameters and AdamW's moments are updated in place
//! ([`gpu::adamw_in_place`]); and what changes between steps besides the data — the learning
//! rate and the bias corrections — is read from a small buffer ([`AdamW::at`]) rewritten
//! before each replay. A step of a new input shape (the padded rows differ) is recorded anew;
//! recording runs the step four times (three to settle the memory pools, one recorded), so
//! the parameters and moments are copied before and put back after.

use std::sync::{Arc, Mutex, MutexGuard};

use burn::tensor::{Device, Graph, Tensor, TensorData, capture};
use kakeya_models::gpu::{self, AdamwStep};

use super::FThetaTrainConfig;
use super::frozen::GroupFrozen;
use super::params::FThetaParams;
use super::pass::PassInputs;
use super::step::{adamw, sequence_loss};
use crate::optim::{Moments, StepValues, clip_factor_on_device, gradients};
use crate::run::{Params, leaves};

/// One recorded step: its input buffers and the graph.
struct Recorded {
    /// The step's sequences and the shapes of [`PassInputs::tensors`]: what a step must match
    /// to replay it (the sequence count is baked into the recorded launches' scalars; the
    /// shapes alone can agree for different counts, the rows being padded).
    key: (usize, Vec<Vec<usize>>),
    /// The buffers the recording reads, flattened.
    inputs: Vec<Tensor<1>>,
    graph: Graph<Tensor<1>, Box<dyn FnMut() -> Tensor<1>>>,
}

/// Held while a step is recorded, and by whatever else would ask the device's thread for work
/// from another thread meanwhile (the f_θ reader's staging): on CUDA a recording fails when a
/// call it cannot record — a new page of pinned memory for the reader — reaches the driver
/// while it is open.
#[derive(Debug, Clone, Default)]
pub struct RecordingGate(Arc<Mutex<()>>);

impl RecordingGate {
    /// Waits for the gate and holds it until the guard drops.
    pub fn hold(&self) -> MutexGuard<'_, ()> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The trainer's recorded steps (one per input shape) and the buffer of the step's
/// `[lr, 1 − β₁ᵗ, 1 − β₂ᵗ, lr · weight decay]`.
pub struct Replayer {
    device: Device,
    hyper: Tensor<1>,
    recorded: Vec<Recorded>,
    gate: RecordingGate,
}

impl Replayer {
    /// Where a step can be replayed: `device` (the plain device of the autodiff one the step
    /// runs on) writes in place ([`gpu::writes_in_place`]: a GPU, without Burn's fusion) and
    /// the config asks for it. `gate` is held while a step is recorded.
    pub fn new(cfg: &FThetaTrainConfig, device: &Device, gate: RecordingGate) -> Option<Self> {
        let hyper = Tensor::<1>::zeros([4], device);
        (cfg.train.graph && gpu::writes_in_place(&hyper)).then(|| Self {
            device: device.clone(),
            hyper,
            recorded: Vec::new(),
            gate,
        })
    }

    /// Whether every recording so far is a graph the device replays in one launch (CUDA);
    /// false where a replay re-runs the step (wgpu), which only adds the inputs' copies.
    pub fn replays_graphs(&self) -> bool {
        self.recorded.iter().all(|r| r.graph.is_hardware())
    }

    /// Step `t` (0-based) over `inputs` (one pass of the step's every sequence, `sequences` of
    /// them, on the autodiff device), recorded first where no recording takes inputs of these
    /// shapes: the loss and the update, `params` and `moments` updated in place. Returns the
    /// loss and the gradient norm before clipping, on the device.
    pub fn step(
        &mut self,
        t: usize,
        (params, moments): (&FThetaParams, &[Moments]),
        (frozen, cfg): (&[GroupFrozen], &FThetaTrainConfig),
        inputs: PassInputs,
        sequences: usize,
    ) -> StepValues {
        let (opt, clip) = adamw(cfg, t);
        let h = opt.at(t + 1, true);
        let fresh = Tensor::<1>::from_data(
            TensorData::new(
                vec![
                    h.lr as f32,
                    h.bias1 as f32,
                    h.bias2 as f32,
                    h.lr_decay as f32,
                ],
                [4],
            ),
            &self.device,
        );
        written(gpu::copy_into(&self.hyper, &fresh));
        let tensors = inputs.tensors();
        let key = (sequences, tensors.iter().map(|(s, _)| s.clone()).collect());
        let at = match self.recorded.iter().position(|r| r.key == key) {
            Some(i) => {
                for (dst, (_, src)) in self.recorded[i].inputs.iter().zip(&tensors) {
                    written(gpu::copy_into(dst, src));
                }
                i
            }
            None => {
                let layers: usize = frozen.iter().map(|g| g.ids.len()).sum();
                let step = StepGraph {
                    params: params.clone(),
                    moments: moments.to_vec(),
                    frozen: frozen.to_vec(),
                    cfg: cfg.clone(),
                    inputs,
                    hyper: self.hyper.clone(),
                    clip,
                    adam: h,
                    mean_over: (sequences * layers) as f64,
                };
                // Recording runs the step four times: the state before it is put back after.
                let kept: Vec<Tensor<2>> = state(params, moments)
                    .map(|x| x.clone().mul_scalar(1.0))
                    .collect();
                let run: Box<dyn FnMut() -> Tensor<1>> = Box::new(move || step.run());
                let graph = {
                    let _alone = self.gate.hold();
                    capture(&self.device, run)
                };
                for (x, k) in state(params, moments).zip(&kept) {
                    written(gpu::copy_into(x, k));
                }
                // Whether the device recorded a graph (CUDA) or a replay re-runs the step.
                tracing::info!(
                    step = t + 1,
                    inputs = key.1.len(),
                    sequences,
                    graph = graph.is_hardware(),
                    "f_θ step recorded for replay"
                );
                self.recorded.push(Recorded {
                    key,
                    inputs: tensors.into_iter().map(|(_, x)| x).collect(),
                    graph,
                });
                self.recorded.len() - 1
            }
        };
        // SAFETY: every buffer the recording read or wrote is held: the inputs by
        // `self.recorded`, the parameters and moments by the trainer and by the recorded closure
        // (its clones), the hyper-parameters by `self`; the intermediates were recorded on pages
        // the graph guards. Nothing else runs on them until the step's values are read back.
        #[allow(unsafe_code)] // the replay: see SAFETY above
        let out = unsafe { self.recorded[at].graph.replay() }.clone();
        StepValues(out)
    }
}

/// The parameters', then the moments' tensors.
fn state<'a>(
    params: &'a FThetaParams,
    moments: &'a [Moments],
) -> impl Iterator<Item = &'a Tensor<2>> {
    params
        .tensors()
        .iter()
        .map(|(_, _, p)| p)
        .chain(moments.iter().flat_map(|m| [&m.m, &m.v]))
}

/// A copy or update in place that ran ([`Replayer::new`] checked where they do).
fn written(done: Option<()>) {
    done.expect("in-place writes run where the replayer was made");
}

/// What a recorded step holds (clones of the trainer's tensors: the same buffers).
struct StepGraph {
    params: FThetaParams,
    moments: Vec<Moments>,
    frozen: Vec<GroupFrozen>,
    cfg: FThetaTrainConfig,
    inputs: PassInputs,
    hyper: Tensor<1>,
    clip: f64,
    /// AdamW's β₁, β₂ and ε (its per-step values come from `hyper`).
    adam: AdamwStep,
    /// The loss is the mean over the step's sequences and the verifier's layers.
    mean_over: f64,
}

impl StepGraph {
    /// The step: loss, gradients, global clip and AdamW in place, as
    /// [`crate::optim::backward_and_step`] does them on a GPU, with the same kernels.
    ///
    /// # Shapes
    /// - returns `[2]`: the loss, the gradient norm before clipping
    fn run(&self) -> Tensor<1> {
        let leaves = leaves(self.params.tensors());
        let model = self.params.model(&leaves);
        let (loss, _) = sequence_loss(&model, &self.frozen, &self.inputs, &self.cfg, false);
        let loss = loss.div_scalar(self.mean_over);
        let plain: Vec<&Tensor<2>> = self.params.tensors().iter().map(|(_, _, p)| p).collect();
        let (value, grads, squared) = gradients(loss, &leaves, &plain, true);
        let norm = squared.sqrt();
        let scale = clip_factor_on_device(&norm, self.clip);
        for ((p, g), mom) in plain.iter().zip(&grads).zip(&self.moments) {
            written(gpu::adamw_in_place(
                p,
                g,
                &scale,
                (&mom.m, &mom.v),
                &self.hyper,
                &self.adam,
                true,
            ));
        }
        Tensor::cat(vec![value, norm], 0)
    }
}
