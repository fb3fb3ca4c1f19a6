//! A few rows' grouped-query attention in one kernel ([`super::DecodeKernels::attention_rows`]).

use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::kernels::{ROW_UNITS, dense_output, f32_only, grid, tree_max, tree_sum};

/// One cube per (query head, row): `softmax(q·kᵀ·scale)·v` over keys `lo..hi` of the head's
/// KV head, with `lo = lo0 + i·dlo`, `hi = hi0 + i·dhi` for row `i`. The scores wait in
/// `scratch` (`[heads · T, keys]`); each row's sums run in a fixed order whatever `T` is.
#[cube(launch)]
fn attention_rows_kernel(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    scratch: &mut [f32],
    out: &mut [f32],
    t: usize,
    heads: usize,
    groups: usize,
    keys: usize,
    d: usize,
    scale: f32,
    lo0: usize,
    dlo: usize,
    hi0: usize,
    dhi: usize,
    #[comptime] units: usize,
) {
    let cube = CUBE_POS;
    if cube >= heads * t {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let (h, i) = (cube / t, cube % t);
    let (lo, hi) = (lo0 + i * dlo, hi0 + i * dhi);
    let qb = cube * d;
    let kb = (h / groups) * keys * d;
    let sb = cube * keys;
    let chunks = (hi - lo).div_ceil(units);
    let mut part = Shared::<[f32]>::new_slice(units);
    let mut m = f32::new(f32::MIN);
    for c in 0..chunks {
        let s = lo + c * units + unit;
        if s < hi {
            let mut dot = f32::new(0.0);
            for j in 0..d {
                dot += q[qb + j] * k[kb + s * d + j];
            }
            let score = dot * scale;
            scratch[sb + s] = score;
            if score > m {
                m = score;
            }
        }
    }
    part[unit] = m;
    sync_cube();
    tree_max(&mut part, unit);
    let max = part[0];
    sync_cube();
    let mut sum = f32::new(0.0);
    for c in 0..chunks {
        let s = lo + c * units + unit;
        if s < hi {
            let e = f32::exp(scratch[sb + s] - max);
            scratch[sb + s] = e;
            sum += e;
        }
    }
    part[unit] = sum;
    sync_cube();
    tree_sum(&mut part, unit);
    let total = part[0];
    // Every unit reads every score next: the scratch writes must be visible cube-wide.
    sync_storage();
    for c in 0..d.div_ceil(units) {
        let j = c * units + unit;
        if j < d {
            let mut acc = f32::new(0.0);
            for s in lo..hi {
                acc += scratch[sb + s] * v[kb + s * d + j];
            }
            out[(i * heads + h) * d + j] = acc / total;
        }
    }
}

/// See [`super::DecodeKernels::attention_rows`].
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_rows(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    scale: f32,
    lo0: usize,
    dlo: usize,
    hi0: usize,
    dhi: usize,
) -> CubeTensor {
    f32_only(&q, "attention_rows");
    let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
    let (heads, t, d) = (q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2]);
    let (kv_heads, keys) = (k.meta.shape()[0], k.meta.shape()[1]);
    assert!(
        kv_heads > 0 && heads % kv_heads == 0 && hi0 + t.saturating_sub(1) * dhi <= keys,
        "attention_rows: {heads} heads over {kv_heads} KV heads, rows reach past {keys} keys"
    );
    let client = q.client.clone();
    let out = dense_output(&q, Shape::new([t, heads * d]));
    if heads * t == 0 {
        return out;
    }
    let scratch = dense_output(&q, Shape::new([heads * t, keys]));
    attention_rows_kernel::launch(
        &client,
        grid(heads * t),
        CubeDim::new_1d(ROW_UNITS as u32),
        q.into_buffer_arg(),
        k.into_buffer_arg(),
        v.into_buffer_arg(),
        scratch.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        t,
        heads,
        heads / kv_heads,
        keys,
        d,
        scale,
        lo0,
        dlo,
        hi0,
        dhi,
        ROW_UNITS,
    );
    out
}
