//! The trainers' optimiser step on a GPU: one AdamW update of a parameter tensor as one kernel
//! (the kernel itself: `optim.rs`), where Burn's composed update launches about fifteen.

#[cfg(feature = "cube")]
use burn::backend::Dispatch;
use burn::tensor::Tensor;

#[cfg(feature = "cube")]
use super::DecodeKernels;
#[cfg(feature = "cube")]
use super::{applies, writes_in_place};

/// The hyper-parameters of one AdamW update ([`adamw`]), as the trainers compute them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamwStep {
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Learning rate.
    pub lr: f64,
    /// `1 − β₁ᵗ`.
    pub bias1: f64,
    /// `1 − β₂ᵗ`.
    pub bias2: f64,
    /// `lr · weight decay` (0: no decay for this tensor).
    pub lr_decay: f64,
}

/// One AdamW update on a GPU in one kernel: `Some((p, m, v))` after the step where the kernels
/// apply. The same arithmetic, in the same order, as `kakeya_train::optim::AdamW::update` with
/// the gradient first multiplied by `scale[0]` (the global clip's factor, left on the device).
///
/// # Shapes
/// - `p`, `g`, `m`, `v`: `[r, c]`, `scale`: `[1]` → three `[r, c]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn adamw(
    p: &Tensor<2>,
    g: &Tensor<2>,
    scale: &Tensor<1>,
    m: &Tensor<2>,
    v: &Tensor<2>,
    h: &AdamwStep,
) -> Option<(Tensor<2>, Tensor<2>, Tensor<2>)> {
    on_gpu!(applies(p), {
        let out: Tensor<3> = Tensor::from_dispatch(<Dispatch as DecodeKernels>::adamw(
            p.clone().into_dispatch(),
            g.clone().into_dispatch(),
            scale.clone().into_dispatch(),
            m.clone().into_dispatch(),
            v.clone().into_dispatch(),
            h.beta1 as f32,
            (1.0 - h.beta1) as f32,
            h.beta2 as f32,
            (1.0 - h.beta2) as f32,
            h.eps as f32,
            h.lr as f32,
            h.bias1 as f32,
            h.bias2 as f32,
            h.lr_decay as f32,
        ));
        let [r, c] = p.dims();
        let plane = |i: usize| out.clone().slice([i..i + 1, 0..r, 0..c]).reshape([r, c]);
        (plane(0), plane(1), plane(2))
    })
}

/// [`adamw`] written back into `p`, `m` and `v` in place (dense buffers the caller owns,
/// written whoever else holds them), the step's `[lr, 1 − β₁ᵗ, 1 − β₂ᵗ, lr · weight decay]`
/// read from `hyper` (β₁, β₂ and ε from `h`; its step fields are not read); `decay` false: no
/// weight decay for this tensor. `Some(())` where the kernels apply and write in place (not
/// under Burn's fusion).
///
/// # Shapes
/// - `p`, `g`, `m`, `v`: `[r, c]`, `scale`: `[1]`, `hyper`: `[4]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
#[allow(clippy::too_many_arguments)]
pub fn adamw_in_place(
    p: &Tensor<2>,
    g: &Tensor<2>,
    scale: &Tensor<1>,
    (m, v): (&Tensor<2>, &Tensor<2>),
    hyper: &Tensor<1>,
    h: &AdamwStep,
    decay: bool,
) -> Option<()> {
    on_gpu!(writes_in_place(p), {
        let _ = <Dispatch as DecodeKernels>::adamw_in_place(
            p.clone().into_dispatch(),
            g.clone().into_dispatch(),
            scale.clone().into_dispatch(),
            m.clone().into_dispatch(),
            v.clone().into_dispatch(),
            hyper.clone().into_dispatch(),
            h.beta1 as f32,
            (1.0 - h.beta1) as f32,
            h.beta2 as f32,
            (1.0 - h.beta2) as f32,
            h.eps as f32,
            decay,
        );
    })
}
