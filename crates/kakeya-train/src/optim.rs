//! AdamW (decoupled weight decay, bias-corrected moments) with a global gradient-norm clip,
//! over plain tensors (no autodiff): the trainer owns parameters, moments and the step.

use burn::tensor::Tensor;
use kakeya_models::gpu::{self, AdamwStep};

/// The learning-rate schedule of both trainers, at 0-based step `t` of `steps`: linear warm-up
/// from `peak / warmup` to `peak` over the first `warmup` steps, then a half cosine from `peak`
/// down to `floor`, reached at the last step.
pub fn warmup_cosine(t: usize, steps: usize, warmup: usize, peak: f64, floor: f64) -> f64 {
    if t < warmup {
        return peak * (t + 1) as f64 / warmup as f64;
    }
    let span = steps.saturating_sub(warmup).max(1) as f64;
    let progress = ((t + 1 - warmup) as f64 / span).min(1.0);
    floor + 0.5 * (peak - floor) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// Moments of one parameter.
#[derive(Debug, Clone)]
pub struct Moments {
    /// First moment.
    pub m: Tensor<2>,
    /// Second moment.
    pub v: Tensor<2>,
}

impl Moments {
    /// Zero moments for a parameter shaped like `p` (Adam's start).
    pub fn zeros_like(p: &Tensor<2>) -> Self {
        Self {
            m: p.zeros_like(),
            v: p.zeros_like(),
        }
    }
}

/// AdamW hyper-parameters of one update.
#[derive(Debug, Clone, Copy)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

/// `Σ‖g‖²` over all gradients, summed on the device.
///
/// # Shapes
/// - `grads`: each `[r, c]` → `[1]`
pub fn squared_norm(grads: &[Tensor<2>]) -> Tensor<1> {
    // Each gradient's sum of squares, then their sum (the CPU's way: no copy of the gradients;
    // a GPU joins them first, `squared_norm_joined`).
    grads
        .iter()
        .map(|g| g.clone().square().sum())
        .reduce(|a, b| a + b)
        .expect("at least one gradient")
}

/// Σ of every element of `x`, in the same order every run on every device. Burn's `sum()` on a
/// GPU adds the partial sums of several cubes with atomic adds, in whatever order they land, so
/// its last bits (and every update computed from them) vary run to run there; here each row of
/// 4 096 elements is summed by one cube, then the rows' sums likewise.
///
/// # Shapes
/// - `x`: any → `[1]`
pub(crate) fn sum_all<const D: usize>(x: Tensor<D>) -> Tensor<1> {
    const ROW: usize = 4096;
    let n = x.shape().num_elements();
    let flat = x.reshape([n]);
    if n <= ROW {
        return flat.sum_dim(0);
    }
    let rows = n.div_ceil(ROW);
    let pad = rows * ROW - n;
    let flat = if pad > 0 {
        let zeros = Tensor::zeros([pad], &flat.device());
        Tensor::cat(vec![flat, zeros], 0)
    } else {
        flat
    };
    flat.reshape([rows, ROW])
        .sum_dim(1)
        .reshape([rows])
        .sum_dim(0)
}

/// [`squared_norm`] in a few launches on a GPU, whatever the number of gradients: all of them
/// joined into one vector (a copy each), then squared and summed once (the sum in another order
/// than [`squared_norm`]'s).
///
/// # Shapes
/// - `grads`: each `[r, c]` → `[1]`
fn squared_norm_joined(grads: &[Tensor<2>]) -> Tensor<1> {
    let flat: Vec<Tensor<1>> = grads
        .iter()
        .map(|g| g.clone().reshape([g.shape().num_elements()]))
        .collect();
    sum_all(Tensor::cat(flat, 0).square())
}

/// `(Σ‖g‖²)^½` over all gradients: one read-back, not one per tensor (each a round trip on a
/// GPU).
pub fn global_norm(grads: &[Tensor<2>]) -> f64 {
    f64::from(squared_norm(grads).into_scalar::<f32>()).sqrt()
}

/// The factor that brings a gradient norm down to `clip` (1 when below it or `clip` is 0).
pub fn clip_factor(norm: f64, clip: f64) -> f64 {
    if clip > 0.0 && norm > clip {
        clip / (norm + 1e-6)
    } else {
        1.0
    }
}

/// [`clip_factor`] on the device, from the norm there (no read-back; f32 arithmetic).
///
/// # Shapes
/// - `norm`: `[1]` → `[1]`
pub(crate) fn clip_factor_on_device(norm: &Tensor<1>, clip: f64) -> Tensor<1> {
    if clip <= 0.0 {
        return norm.ones_like();
    }
    let f = norm.clone().add_scalar(1e-6).recip().mul_scalar(clip);
    f.mask_fill(norm.clone().lower_equal_elem(clip), 1.0)
}

/// A step's training loss and gradient norm before clipping, left on the device until the
/// trainer reads them (one read-back a step: on a GPU each read waits for the queue to drain).
#[derive(Debug, Clone)]
pub struct StepValues(pub(crate) Tensor<1>);

impl StepValues {
    /// `(loss, gradient norm)`, read back; a [`crate::TrainError::Device`] where the device
    /// failed to run the step.
    pub fn read(self) -> crate::error::Result<(f64, f64)> {
        let v = crate::run::read_f32(self.0)?;
        Ok((f64::from(v[0]), f64::from(v[1])))
    }
}

impl AdamW {
    /// The hyper-parameters of the update at 1-based step `t` (bias corrections; `lr · weight
    /// decay`, 0 without `decay`).
    pub fn at(&self, t: usize, decay: bool) -> AdamwStep {
        let lr_decay = if decay && self.weight_decay > 0.0 {
            self.lr * self.weight_decay
        } else {
            0.0
        };
        AdamwStep {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            lr: self.lr,
            bias1: 1.0 - self.beta1.powi(t as i32),
            bias2: 1.0 - self.beta2.powi(t as i32),
            lr_decay,
        }
    }

    /// One update of `p` with gradient `g` at 1-based step `t`; `decay` says whether weight
    /// decay applies (not to norm multipliers). On a GPU the update is one kernel that first
    /// multiplies `g` by `gpu_scale` (the clip's factor, left on the device; none: 1); elsewhere
    /// `g` comes already clipped and `gpu_scale` is not read.
    ///
    /// # Shapes
    /// - `p`, `g`: `[r, c]`, `gpu_scale`: `[1]` → `[r, c]`
    pub fn update(
        &self,
        p: Tensor<2>,
        g: Tensor<2>,
        gpu_scale: Option<&Tensor<1>>,
        mom: &mut Moments,
        t: usize,
        decay: bool,
    ) -> Tensor<2> {
        let h = self.at(t, decay);
        let (bc1, bc2, lr_decay) = (h.bias1, h.bias2, h.lr_decay);
        // On a GPU the whole update is one kernel (the same arithmetic in the same order).
        if gpu::is_gpu(&p.device()) {
            let ones;
            let scale = match gpu_scale {
                Some(s) => s,
                None => {
                    ones = Tensor::<1>::ones([1], &p.device());
                    &ones
                }
            };
            if let Some((p, m, v)) = gpu::adamw(&p, &g, scale, &mom.m, &mom.v, &h) {
                (mom.m, mom.v) = (m, v);
                return p;
            }
        }
        mom.m = mom
            .m
            .clone()
            .mul_scalar(self.beta1)
            .add(g.clone().mul_scalar(1.0 - self.beta1));
        mom.v = mom
            .v
            .clone()
            .mul_scalar(self.beta2)
            .add(g.square().mul_scalar(1.0 - self.beta2));
        let step = mom
            .m
            .clone()
            .div_scalar(bc1)
            .div(mom.v.clone().div_scalar(bc2).sqrt().add_scalar(self.eps));
        let p = if lr_decay > 0.0 {
            p.clone().sub(p.mul_scalar(lr_decay))
        } else {
            p
        };
        p.sub(step.mul_scalar(self.lr))
    }
}

/// Back-propagates `loss` to `leaves` (gradient-tracking copies of `params`, in order): the
/// loss's value off the graph, each parameter's gradient (zeros where the loss does not reach
/// it) and their squared global norm (on a GPU in a few launches, [`squared_norm_joined`]).
///
/// # Shapes
/// - `loss`: `[1]` (autodiff), `leaves` and `params`: each `[r, c]` → `[1]`, the gradients,
///   `[1]`
pub(crate) fn gradients(
    loss: Tensor<1>,
    leaves: &[Tensor<2>],
    params: &[&Tensor<2>],
    on_gpu: bool,
) -> (Tensor<1>, Vec<Tensor<2>>, Tensor<1>) {
    let value = loss.clone().inner().reshape([1]);
    let grads = loss.backward();
    let grads: Vec<Tensor<2>> = leaves
        .iter()
        .zip(params)
        .map(|(leaf, p)| leaf.grad(&grads).unwrap_or_else(|| p.zeros_like()))
        .collect();
    let squared = if on_gpu {
        squared_norm_joined(&grads)
    } else {
        squared_norm(&grads)
    };
    (value, grads, squared)
}

/// Back-propagates `loss` to `leaves` (gradient-tracking copies of `params`, in order), clips
/// the global gradient norm to `clip`, and applies one AdamW update at 1-based step `t`;
/// `decay(shape)` says whether a tensor takes weight decay. Returns the loss and the norm before
/// clipping, still on the device: on a GPU nothing in the step waits for the device (the clip's
/// factor is computed there and goes into the update kernel); on the CPU, where a read costs
/// nothing, the factor is read and the gradients scaled on the host's side as before.
///
/// # Shapes
/// - `loss`: `[1]` (autodiff), `leaves` and `params`: each `[r, c]`
#[allow(clippy::too_many_arguments)] // the step's inputs, each used once
pub fn backward_and_step(
    loss: Tensor<1>,
    leaves: &[Tensor<2>],
    params: &mut [(String, Vec<usize>, Tensor<2>)],
    moments: &mut [Moments],
    opt: &AdamW,
    clip: f64,
    t: usize,
    decay: &dyn Fn(&[usize]) -> bool,
) -> StepValues {
    let on_gpu = gpu::is_gpu(&loss.device());
    let plain: Vec<&Tensor<2>> = params.iter().map(|(_, _, p)| p).collect();
    let (value, grads, squared) = gradients(loss, leaves, &plain, on_gpu);
    let norm = squared.clone().sqrt();
    let (factor, gpu_scale) = if on_gpu {
        (1.0, Some(clip_factor_on_device(&norm, clip)))
    } else {
        let n = f64::from(squared.into_scalar::<f32>()).sqrt();
        (clip_factor(n, clip), None)
    };
    for (((_, shape, p), g), mom) in params.iter_mut().zip(grads).zip(moments) {
        let g = if factor < 1.0 {
            g.mul_scalar(factor)
        } else {
            g
        };
        *p = opt.update(p.clone(), g, gpu_scale.as_ref(), mom, t, decay(shape));
    }
    StepValues(Tensor::cat(vec![value, norm], 0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    #[test]
    fn sum_all_adds_every_element_at_any_length() {
        let d = Device::flex();
        for n in [1usize, 7, 4096, 4097, 10_000, 12_288] {
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let want: f64 = v.iter().map(|&x| f64::from(x)).sum();
            // f32 rounding of a sum is bounded by its terms' magnitudes, not by the result.
            let scale: f64 = v.iter().map(|&x| f64::from(x.abs())).sum();
            let t = Tensor::<2>::from_data(TensorData::new(v, [1, n]), &d);
            let got = f64::from(sum_all(t).into_scalar::<f32>());
            assert!(
                (got - want).abs() <= 1e-6 * scale,
                "{n}: {got} against {want}"
            );
        }
    }

    #[test]
    fn first_adam_step_moves_each_weight_by_lr_against_its_gradient_sign() {
        let d = Device::flex();
        let p = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, -2.0], [1, 2]), &d);
        let g = Tensor::<2>::from_data(TensorData::new(vec![0.5f32, -3.0], [1, 2]), &d);
        let mut mom = Moments {
            m: p.zeros_like(),
            v: p.zeros_like(),
        };
        let opt = AdamW {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-12,
            weight_decay: 0.0,
        };
        let out = opt.update(p, g, None, &mut mom, 1, true);
        let v = out.into_data().try_to_vec::<f32>().unwrap();
        assert!(
            (v[0] - 0.9).abs() < 1e-6 && (v[1] + 1.9).abs() < 1e-6,
            "{v:?}"
        );
    }

    #[test]
    fn clip_scales_the_global_norm_down_to_the_limit() {
        let d = Device::flex();
        let g = vec![
            Tensor::<2>::from_data(TensorData::new(vec![3.0f32], [1, 1]), &d),
            Tensor::<2>::from_data(TensorData::new(vec![4.0f32], [1, 1]), &d),
        ];
        let n = global_norm(&g);
        assert!((n - 5.0).abs() < 1e-9);
        assert!((clip_factor(n, 1.0) * n - 1.0).abs() < 1e-6);
        assert_eq!(clip_factor(n, 10.0), 1.0);
        assert_eq!(clip_factor(n, 0.0), 1.0);
    }
}
