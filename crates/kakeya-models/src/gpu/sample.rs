//! Sampling at a temperature on the device: one cube per row draws the token the host sampler
//! (`kakeya_runtime::Sampler`) draws from the same logits and uniform — inverse-CDF sampling
//! over `softmax(logits / T)` in token-id order — so only the ids come back to the host.
//!
//! The cube splits the row into one contiguous chunk per unit. It finds the row's maximum,
//! then each unit's mass `Σ exp((l − max) / T)` over its chunk (in id order); one unit turns
//! the chunks' masses into running sums, so the chunks' intervals `[before, before + mass)`
//! tile `[0, total)` exactly (each bound is one sum, computed once); the unit whose interval
//! holds `u · total` walks its chunk in id order to the entry where the running mass passes
//! it. The host does the same in f64, the device in f32: the two agree except where `u · total`
//! falls within rounding of a boundary between two tokens.

use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::kernels::{dense_output, f32_only, grid, tree_max};

/// Units of [`sample_rows_kernel`]'s cube (a power of two).
const SAMPLE_UNITS: usize = 256;

/// One cube per row: the token drawn from `softmax(x[row] / temperature)` by inverse CDF in id
/// order at `u[row] · total`, written as an f32 (exact below 2²⁴). Where rounding leaves
/// `u · total` past every interval, the last entry of nonzero weight (the host's rule too).
#[cube(launch)]
fn sample_rows_kernel(
    x: &[f32],
    u: &[f32],
    out: &mut [f32],
    rows: usize,
    cols: usize,
    temperature: f32,
    #[comptime] units: usize,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let base = row * cols;
    let chunk = cols.div_ceil(units);
    let mut lo = unit * chunk;
    if lo > cols {
        lo = cols;
    }
    let mut hi = lo + chunk;
    if hi > cols {
        hi = cols;
    }
    let mut part = Shared::<[f32]>::new_slice(units);
    let mut lasts = Shared::<[f32]>::new_slice(units);
    let mut before = Shared::<[f32]>::new_slice(units);
    // [the drawn id, the row's total mass]
    let mut picked = Shared::<[f32]>::new_slice(2usize);

    // The row's maximum (WGSL has no infinity literal: the lowest finite f32 seeds it).
    let mut m = f32::new(f32::MIN);
    for i in lo..hi {
        let v = x[base + i];
        if v > m {
            m = v;
        }
    }
    part[unit] = m;
    sync_cube();
    tree_max(&mut part, unit);
    let max = part[0];
    sync_cube();

    // Each chunk's mass, and its last entry of nonzero weight (-1: none).
    let mut mass = f32::new(0.0);
    let mut last = f32::new(-1.0);
    for i in lo..hi {
        let w = f32::exp((x[base + i] - max) / temperature);
        mass += w;
        if w > 0.0 {
            last = f32::cast_from(i);
        }
    }
    part[unit] = mass;
    lasts[unit] = last;
    sync_cube();
    if unit == 0 {
        let mut acc = f32::new(0.0);
        let mut fallback = f32::new(0.0);
        for k in 0..units {
            before[k] = acc;
            acc += part[k];
            if lasts[k] >= 0.0 {
                fallback = lasts[k];
            }
        }
        picked[0] = fallback;
        picked[1] = acc;
    }
    sync_cube();
    let target = u[row] * picked[1];
    let start = before[unit];
    // `start + mass` is the very sum unit 0 computed for the next chunk's start.
    if mass > 0.0 && start <= target && target < start + mass {
        let r = target - start;
        let mut acc = f32::new(0.0);
        let mut at = last;
        let mut found = false;
        for i in lo..hi {
            let w = f32::exp((x[base + i] - max) / temperature);
            acc += w;
            if !found && w > 0.0 && acc > r {
                found = true;
                at = f32::cast_from(i);
            }
        }
        picked[0] = at;
    }
    sync_cube();
    if unit == 0 {
        out[row] = picked[0];
    }
}

/// See [`super::DecodeKernels::sample_rows`].
pub(super) fn sample_rows(x: CubeTensor, u: CubeTensor, temperature: f32) -> CubeTensor {
    f32_only(&x, "sample_rows");
    f32_only(&u, "sample_rows");
    let (x, u) = (into_contiguous(x), into_contiguous(u));
    let (rows, cols) = (x.meta.shape()[0], x.meta.shape()[1]);
    assert!(
        cols < 1 << 24,
        "sample_rows: {cols} columns do not fit an f32 index"
    );
    assert_eq!(
        u.meta.shape().num_elements(),
        rows,
        "sample_rows: one uniform per row"
    );
    let out = dense_output(&x, Shape::new([rows]));
    if rows == 0 || cols == 0 {
        return out;
    }
    sample_rows_kernel::launch(
        &x.client,
        grid(rows),
        CubeDim::new_1d(SAMPLE_UNITS as u32),
        x.clone().into_buffer_arg(),
        u.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        rows,
        cols,
        temperature,
        SAMPLE_UNITS,
    );
    out
}
