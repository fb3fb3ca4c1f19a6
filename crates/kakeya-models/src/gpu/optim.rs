//! One AdamW update of a parameter as one kernel (the trainers' optimiser on a GPU): Burn's
//! composed update launches about fifteen element-wise kernels per parameter tensor.

use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::kernels::{ELEMENT_UNITS, dense_output, f32_only, grid};

/// The scalars of one update, as f32 (see [`super::DecodeKernels::adamw`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Scalars {
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub eps: f32,
    pub lr: f32,
    pub bias1: f32,
    pub bias2: f32,
    pub lr_decay: f32,
}

/// One unit per element, in the order of the composed update (`kakeya_train::optim::AdamW`):
/// the gradient times `scale[0]` (the global clip's factor, computed on the device: no
/// read-back), the moments, the bias-corrected step, the decoupled decay, then the step. Writes
/// the new parameter, first moment and second moment as three planes of `out`; or, `in_place`,
/// back into `p`, `m` and `v`, with the step's learning rate, bias corrections and `lr · weight
/// decay` read from `hyper` (`[lr, 1 − β₁ᵗ, 1 − β₂ᵗ, lr · wd]`; `lr_decay` then multiplies the
/// last: 1 with decay, 0 without) instead of taken as arguments: a training step replayed as one
/// recorded graph reuses its launches' arguments, and reads and writes the same buffers.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel(
    p: &mut [f32],
    g: &[f32],
    scale: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hyper: &[f32],
    out: &mut [f32],
    n: usize,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    eps: f32,
    lr: f32,
    bias1: f32,
    bias2: f32,
    lr_decay: f32,
    #[comptime] in_place: bool,
) {
    let i = ABSOLUTE_POS;
    if i < n {
        let (mut lr, mut bias1, mut bias2, mut lr_decay) = (lr, bias1, bias2, lr_decay);
        if in_place {
            lr = hyper[0];
            bias1 = hyper[1];
            bias2 = hyper[2];
            lr_decay *= hyper[3];
        }
        let gi = g[i] * scale[0];
        let mi = m[i] * beta1 + gi * one_minus_beta1;
        let vi = v[i] * beta2 + gi * gi * one_minus_beta2;
        let step = (mi / bias1) / (f32::sqrt(vi / bias2) + eps);
        let pi = p[i];
        let decayed = pi - pi * lr_decay;
        if in_place {
            p[i] = decayed - step * lr;
            m[i] = mi;
            v[i] = vi;
        } else {
            out[i] = decayed - step * lr;
            out[n + i] = mi;
            out[2 * n + i] = vi;
        }
    }
}

/// See [`super::DecodeKernels::adamw`].
pub(super) fn adamw(
    p: CubeTensor,
    g: CubeTensor,
    scale: CubeTensor,
    m: CubeTensor,
    v: CubeTensor,
    h: Scalars,
) -> CubeTensor {
    for (t, what) in [
        (&p, "p"),
        (&g, "g"),
        (&scale, "scale"),
        (&m, "m"),
        (&v, "v"),
    ] {
        f32_only(t, what);
    }
    let shape = p.meta.shape().clone();
    let n = shape.num_elements();
    for t in [&g, &m, &v] {
        assert_eq!(
            t.meta.shape().num_elements(),
            n,
            "adamw: parameter, gradient and moments differ in size"
        );
    }
    assert_eq!(
        scale.meta.shape().num_elements(),
        1,
        "adamw: the gradient's scale is one number"
    );
    let [p, g, scale, m, v] = [p, g, scale, m, v].map(into_contiguous);
    let mut dims = vec![3];
    dims.extend((0..shape.num_dims()).map(|i| shape[i]));
    let out = dense_output(&p, Shape::from(dims));
    if n == 0 {
        return out;
    }
    adamw_kernel::launch(
        &p.client,
        grid(n.div_ceil(ELEMENT_UNITS)),
        CubeDim::new_1d(ELEMENT_UNITS as u32),
        p.clone().into_buffer_arg(),
        g.into_buffer_arg(),
        // Not read out of place: `scale` stands in for `hyper`.
        scale.clone().into_buffer_arg(),
        m.into_buffer_arg(),
        v.into_buffer_arg(),
        scale.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        n,
        h.beta1,
        h.one_minus_beta1,
        h.beta2,
        h.one_minus_beta2,
        h.eps,
        h.lr,
        h.bias1,
        h.bias2,
        h.lr_decay,
        false,
    );
    out
}

/// See [`super::DecodeKernels::adamw_in_place`]: `p`, `m` and `v` must be dense buffers the
/// caller owns (written whoever else holds them).
#[allow(clippy::too_many_arguments)]
pub(super) fn adamw_in_place(
    p: CubeTensor,
    g: CubeTensor,
    scale: CubeTensor,
    m: CubeTensor,
    v: CubeTensor,
    hyper: CubeTensor,
    h: Scalars,
    decay: bool,
) -> CubeTensor {
    for (t, what) in [
        (&p, "p"),
        (&g, "g"),
        (&m, "m"),
        (&v, "v"),
        (&hyper, "hyper"),
    ] {
        f32_only(t, what);
    }
    let n = p.meta.shape().num_elements();
    for t in [&p, &m, &v] {
        assert!(
            t.is_contiguous() && t.meta.shape().num_elements() == n,
            "adamw_in_place: the parameter and moments must be dense buffers of one size"
        );
    }
    assert_eq!(
        hyper.meta.shape().num_elements(),
        4,
        "adamw_in_place: [lr, bias1, bias2, lr · wd]"
    );
    let [g, scale, hyper] = [g, scale, hyper].map(into_contiguous);
    if n == 0 {
        return p;
    }
    // Not written in place: a one-element stand-in for `out` (a writable binding may not
    // alias another).
    let unused = dense_output(&p, Shape::new([1]));
    adamw_kernel::launch(
        &p.client.clone(),
        grid(n.div_ceil(ELEMENT_UNITS)),
        CubeDim::new_1d(ELEMENT_UNITS as u32),
        p.clone().into_buffer_arg(),
        g.into_buffer_arg(),
        scale.into_buffer_arg(),
        m.into_buffer_arg(),
        v.into_buffer_arg(),
        hyper.into_buffer_arg(),
        unused.into_buffer_arg(),
        n,
        h.beta1,
        h.one_minus_beta1,
        h.beta2,
        h.one_minus_beta2,
        h.eps,
        0.0,
        0.0,
        0.0,
        if decay { 1.0 } else { 0.0 },
        true,
    );
    p
}
