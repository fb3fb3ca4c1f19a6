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
/// the new parameter, first moment and second moment as three planes of `n`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel(
    p: &[f32],
    g: &[f32],
    scale: &[f32],
    m: &[f32],
    v: &[f32],
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
) {
    let i = ABSOLUTE_POS;
    if i < n {
        let gi = g[i] * scale[0];
        let mi = m[i] * beta1 + gi * one_minus_beta1;
        let vi = v[i] * beta2 + gi * gi * one_minus_beta2;
        let step = (mi / bias1) / (f32::sqrt(vi / bias2) + eps);
        let pi = p[i];
        let decayed = pi - pi * lr_decay;
        out[i] = decayed - step * lr;
        out[n + i] = mi;
        out[2 * n + i] = vi;
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
        scale.into_buffer_arg(),
        m.into_buffer_arg(),
        v.into_buffer_arg(),
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
    );
    out
}
