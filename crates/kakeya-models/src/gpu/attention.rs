//! A few rows' grouped-query attention in one kernel ([`super::DecodeKernels::attention_rows`]).

use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::kernels::{ROW_UNITS, dense_output, f32_only, grid, tree_max, tree_sum};

/// Key `j` of row `i`: from the row's list when `indexed` (`ids` row `i` is its count, then
/// its key indices, as f32), else `lo + j`.
#[cube]
fn key_of(
    ids: &[f32],
    row: usize,
    width: usize,
    lo: usize,
    j: usize,
    #[comptime] indexed: bool,
) -> usize {
    if indexed {
        usize::cast_from(u32::cast_from(ids[row * (width + 1) + 1 + j]))
    } else {
        lo + j
    }
}

/// One cube per (query head, row): `softmax(q·kᵀ·scale)·v` over the row's keys of the head's
/// KV head — keys `lo0 + i·dlo .. hi0 + i·dhi` of row `i`, or, when `indexed`, the row's list
/// in `ids` (`[T, 1 + width]`). The scores wait in `scratch` (`[heads · T, keys]`). Keys are
/// visited in the order given (ascending: positions in order), so a row's sums run in the same
/// order whichever form named its keys and however many rows the launch carries.
#[cube(launch)]
fn attention_rows_kernel(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    ids: &[f32],
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
    width: usize,
    #[comptime] units: usize,
    #[comptime] indexed: bool,
) {
    let cube = CUBE_POS;
    if cube >= heads * t {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let (h, i) = (cube / t, cube % t);
    let lo = lo0 + i * dlo;
    let mut n = hi0 + i * dhi - lo;
    if indexed {
        n = usize::cast_from(u32::cast_from(ids[i * (width + 1)]));
    }
    let qb = cube * d;
    let kb = (h / groups) * keys * d;
    let sb = cube * keys;
    let chunks = n.div_ceil(units);
    let mut part = Shared::<[f32]>::new_slice(units);
    let mut m = f32::new(f32::MIN);
    for c in 0..chunks {
        let j = c * units + unit;
        if j < n {
            let s = key_of(ids, i, width, lo, j, indexed);
            let mut dot = f32::new(0.0);
            for e in 0..d {
                dot += q[qb + e] * k[kb + s * d + e];
            }
            let score = dot * scale;
            scratch[sb + j] = score;
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
        let j = c * units + unit;
        if j < n {
            let p = f32::exp(scratch[sb + j] - max);
            scratch[sb + j] = p;
            sum += p;
        }
    }
    part[unit] = sum;
    sync_cube();
    tree_sum(&mut part, unit, CUBE_DIM as usize);
    let total = part[0];
    // Every unit reads every score next: the scratch writes must be visible cube-wide.
    sync_storage();
    for c in 0..d.div_ceil(units) {
        let e = c * units + unit;
        if e < d {
            let mut acc = f32::new(0.0);
            for j in 0..n {
                let s = key_of(ids, i, width, lo, j, indexed);
                acc += scratch[sb + j] * v[kb + s * d + e];
            }
            out[(i * heads + h) * d + e] = acc / total;
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
    runs: [usize; 4],
    ids: Option<CubeTensor>,
) -> CubeTensor {
    f32_only(&q, "attention_rows");
    let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
    let (heads, t, d) = (q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2]);
    let (kv_heads, keys) = (k.meta.shape()[0], k.meta.shape()[1]);
    let [lo0, dlo, hi0, dhi] = runs;
    assert!(
        kv_heads > 0 && heads % kv_heads == 0,
        "attention_rows: {heads} heads over {kv_heads} KV heads"
    );
    assert!(
        ids.is_some() || hi0 + t.saturating_sub(1) * dhi <= keys,
        "attention_rows: rows reach past {keys} keys"
    );
    let out = dense_output(&q, Shape::new([t, heads * d]));
    if heads * t == 0 {
        return out;
    }
    let scratch = dense_output(&q, Shape::new([heads * t, keys]));
    let indexed = ids.is_some();
    // Without lists the kernel reads none: `q` stands in for the unused binding.
    let ids = ids.map_or_else(|| q.clone(), into_contiguous);
    let width = if indexed { ids.meta.shape()[1] - 1 } else { 0 };
    attention_rows_kernel::launch(
        &q.client.clone(),
        grid(heads * t),
        CubeDim::new_1d(ROW_UNITS as u32),
        q.into_buffer_arg(),
        k.into_buffer_arg(),
        v.into_buffer_arg(),
        ids.into_buffer_arg(),
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
        width,
        ROW_UNITS,
        indexed,
    );
    out
}
