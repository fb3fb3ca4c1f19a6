//! The greedy argmax of logit rows on the device (behind [`super::DecodeKernels::argmax_rows`]).

use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::kernels::{dense_output, f32_only, grid};

/// Units of [`argmax_rows_kernel`]'s cube (a power of two).
const ARGMAX_UNITS: usize = 256;

/// One cube per row: the index of the row's largest entry, the first on ties (NaN never
/// wins), written as an f32 (exact below 2²⁴).
#[cube(launch)]
fn argmax_rows_kernel(
    x: &[f32],
    out: &mut [f32],
    rows: usize,
    cols: usize,
    #[comptime] units: usize,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let base = row * cols;
    let mut vals = Shared::<[f32]>::new_slice(units);
    let mut ids = Shared::<[u32]>::new_slice(units);
    // (WGSL has no infinity literal: a unit's first entry seeds its search instead.)
    let mut best = f32::new(f32::MIN);
    let mut at = u32::new(4_294_967_295i64);
    for c in 0..cols.div_ceil(units) {
        let i = c * units + unit;
        if i < cols {
            let v = x[base + i];
            // Each unit sees its indices in increasing order: strictly larger only.
            if at == u32::MAX || v > best {
                best = v;
                at = u32::cast_from(i);
            }
        }
    }
    vals[unit] = best;
    ids[unit] = at;
    sync_cube();
    let mut s = CUBE_DIM as usize / 2;
    while s > 0 {
        if unit < s {
            let (v, i) = (vals[unit + s], ids[unit + s]);
            let (b, j) = (vals[unit], ids[unit]);
            // A unit that saw no entry (index MAX) never wins and always loses.
            if i != u32::MAX && (j == u32::MAX || v > b || (v == b && i < j)) {
                vals[unit] = v;
                ids[unit] = i;
            }
        }
        sync_cube();
        s /= 2;
    }
    if unit == 0 {
        out[row] = f32::cast_from(ids[0]);
    }
}

/// See [`super::DecodeKernels::argmax_rows`].
pub(super) fn argmax_rows(x: CubeTensor) -> CubeTensor {
    f32_only(&x, "argmax_rows");
    let x = into_contiguous(x);
    let (rows, cols) = (x.meta.shape()[0], x.meta.shape()[1]);
    assert!(
        cols < 1 << 24,
        "argmax_rows: {cols} columns do not fit an f32 index"
    );
    let out = dense_output(&x, Shape::new([rows]));
    if rows == 0 || cols == 0 {
        return out;
    }
    argmax_rows_kernel::launch(
        &x.client,
        grid(rows),
        CubeDim::new_1d(ARGMAX_UNITS as u32),
        x.clone().into_buffer_arg(),
        out.clone().into_buffer_arg(),
        rows,
        cols,
        ARGMAX_UNITS,
    );
    out
}
