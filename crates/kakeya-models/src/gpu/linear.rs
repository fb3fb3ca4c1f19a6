//! Few-row products in full f32 ([`super::DecodeKernels::linear_rows`]): up to three weights
//! that read the same input in one launch (q/k/v, gate/up), their outputs side by side.

use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::kernels::{dense_output, f32_only, grid, tree_sum};

/// Units that share one output (a power of two).
const LANES: usize = 32;
/// Outputs one cube computes.
const OUTPUTS_PER_CUBE: usize = 8;

/// This lane's part of `x[xr..xr + k] · w[wo..wo + k]`: every `lanes`-th term from `lane`.
#[cube]
fn lane_dot(
    x: &[f32],
    xr: usize,
    w: &[f32],
    wo: usize,
    k: usize,
    lane: usize,
    #[comptime] lanes: usize,
) -> f32 {
    let mut acc = f32::new(0.0);
    for c in 0..k.div_ceil(lanes) {
        let i = c * lanes + lane;
        if i < k {
            acc += x[xr + i] * w[wo + i];
        }
    }
    acc
}

/// `out[r, o] = Σ_k x[r, k] · W[o, k]` for a few rows, `W` the rows of `w0`, then `w1`, then
/// `w2` (`n0 + n1 + n2` outputs). [`LANES`] units per output stride over `k` and sum in a fixed
/// tree, so each row's result is independent of `rows`.
#[cube(launch)]
fn linear_rows_kernel(
    x: &[f32],
    w0: &[f32],
    w1: &[f32],
    w2: &[f32],
    out: &mut [f32],
    rows: usize,
    k: usize,
    n0: usize,
    n1: usize,
    n2: usize,
    #[comptime] lanes: usize,
    #[comptime] outputs: usize,
) {
    let unit = UNIT_POS as usize;
    let lane = unit % lanes;
    let n = n0 + n1 + n2;
    let o = CUBE_POS * outputs + unit / lanes;
    let mut part = Shared::<[f32]>::new_slice(lanes * outputs);
    let group = unit - lane;
    for r in 0..rows {
        let xr = r * k;
        let mut acc = f32::new(0.0);
        if o < n0 {
            acc = lane_dot(x, xr, w0, o * k, k, lane, lanes);
        } else if o < n0 + n1 {
            acc = lane_dot(x, xr, w1, (o - n0) * k, k, lane, lanes);
        } else if o < n {
            acc = lane_dot(x, xr, w2, (o - n0 - n1) * k, k, lane, lanes);
        }
        part[unit] = acc;
        sync_cube();
        // Each output's lanes summed into the group's first entry (the width a runtime value).
        tree_sum(&mut part, unit, CUBE_DIM as usize / outputs);
        if o < n && lane == 0 {
            out[r * n + o] = part[group];
        }
        sync_cube();
    }
}

/// See [`super::DecodeKernels::linear_rows`]: the first `parts` (1 to 3) weights.
pub(super) fn linear_rows(x: CubeTensor, weights: [CubeTensor; 3], parts: usize) -> CubeTensor {
    f32_only(&x, "linear_rows");
    assert!(
        (1..=3).contains(&parts),
        "linear_rows: 1 to 3 weights, not {parts}"
    );
    let x = into_contiguous(x);
    let (rows, k) = (x.meta.shape()[0], x.meta.shape()[1]);
    let ws = weights.map(into_contiguous);
    let mut n = [0; 3];
    for (p, w) in ws.iter().enumerate().take(parts) {
        assert_eq!(
            w.meta.shape()[1],
            k,
            "linear_rows: x is [rows, {k}], w{p} is [n, k]"
        );
        n[p] = w.meta.shape()[0];
    }
    let total: usize = n.iter().sum();
    let out = dense_output(&x, Shape::new([rows, total]));
    if rows == 0 || total == 0 {
        return out;
    }
    let [w0, w1, w2] = ws;
    linear_rows_kernel::launch(
        &x.client,
        grid(total.div_ceil(OUTPUTS_PER_CUBE)),
        CubeDim::new_1d((LANES * OUTPUTS_PER_CUBE) as u32),
        x.clone().into_buffer_arg(),
        w0.into_buffer_arg(),
        w1.into_buffer_arg(),
        w2.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        rows,
        k,
        n[0],
        n[1],
        n[2],
        LANES,
        OUTPUTS_PER_CUBE,
    );
    out
}
