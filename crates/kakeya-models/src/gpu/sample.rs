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
//!
//! With a top-k or top-p cut the host orders the kept tokens most likely first (the larger
//! logit, then the lower id), and so does [`sample_sorted_kernel`], without sorting: each cut
//! and the draw is "the first token, in that order, where a running count or mass reaches a
//! target", found by bisection on the logits' order keys (32 passes over the row, each a
//! fixed-order sum), then among equal logits by a walk in id order as above.

use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::kernels::{dense_output, f32_only, grid, tree_max, tree_sum};

/// Most units of a sampling cube (a power of two; fewer where the device allows fewer). More
/// units mean shorter chunks: Mesa's lavapipe stops an invocation after 65 535 loop
/// iterations in all, and [`sample_sorted_kernel`] walks its chunk ≈ 110 times (with 1 024
/// units, rows of up to ≈ 600 000 entries fit that).
const SAMPLE_UNITS: usize = 1024;

/// Where a search runs: the row's logits, its maximum, and this unit's chunk.
#[derive(CubeType, Clone, Copy)]
struct RowView {
    base: usize,
    lo: usize,
    hi: usize,
    max: f32,
    temperature: f32,
}

/// Row `row`'s view for this unit: its contiguous chunk of the row (`cols.div_ceil(units)`
/// entries, fewer or none at the end) and the row's maximum (a fixed tree; `part` is the
/// cube's scratch). Every unit calls it.
#[cube]
fn row_view(
    x: &[f32],
    row: usize,
    cols: usize,
    temperature: f32,
    part: &mut Shared<[f32]>,
    #[comptime] units: usize,
) -> RowView {
    let unit = UNIT_POS as usize;
    let chunk = cols.div_ceil(units);
    let mut lo = unit * chunk;
    if lo > cols {
        lo = cols;
    }
    let mut hi = lo + chunk;
    if hi > cols {
        hi = cols;
    }
    let base = row * cols;
    // WGSL has no infinity literal: the lowest finite f32 seeds the maximum.
    let mut m = f32::new(f32::MIN);
    for i in lo..hi {
        let v = x[base + i];
        if v > m {
            m = v;
        }
    }
    part[unit] = m;
    sync_cube();
    tree_max(part, unit);
    let max = part[0];
    sync_cube();
    RowView {
        base,
        lo,
        hi,
        max,
        temperature,
    }
}

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
    let mut part = Shared::<[f32]>::new_slice(units);
    let mut lasts = Shared::<[f32]>::new_slice(units);
    let mut before = Shared::<[f32]>::new_slice(units);
    // [the drawn id, the row's total mass]
    let mut picked = Shared::<[f32]>::new_slice(2usize);
    let view = row_view(x, row, cols, temperature, &mut part, units);
    let (base, lo, hi, max) = (view.base, view.lo, view.hi, view.max);

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

/// The order key of a logit: a larger key for a larger value (the IEEE order on the bits).
#[cube]
fn order_key(v: f32) -> u32 {
    let bits = u32::reinterpret(v);
    let mut key = bits | 0x8000_0000u32;
    if bits >= 0x8000_0000u32 {
        key = 0xffff_ffffu32 - bits;
    }
    key
}

/// Whether a running total `g` reaches `target` (`strict`: passes it).
#[cube]
fn meets(g: f32, target: f32, strict: bool) -> bool {
    let mut r = g >= target;
    if strict {
        r = g > target;
    }
    r
}

/// The row's entries a search looks at: the prefix, most likely first, that ends at the entry
/// of key `vb` and id `ib` (`vb` 0, `ib` `u32::MAX`: all), holding a key of at least `t`.
#[cube]
fn within(key: u32, id: u32, vb: u32, ib: u32, t: u32) -> bool {
    key >= t && (key > vb || (key == vb && id <= ib))
}

/// An entry's share of a count (1) or of the mass (`exp((l − max) / T)`).
#[cube]
fn share(v: f32, view: &RowView, mass: bool) -> f32 {
    let mut w = f32::new(1.0);
    if mass {
        w = f32::exp((v - view.max) / view.temperature);
    }
    w
}

/// The count or mass of the entries [`within`] the prefix `(vb, ib)` with a key of at least
/// `t`, summed over the cube in a fixed order (every unit calls it; all get the total).
#[cube]
fn total_from(
    x: &[f32],
    view: &RowView,
    mass: bool,
    vb: u32,
    ib: u32,
    t: u32,
    part: &mut Shared<[f32]>,
) -> f32 {
    let unit = UNIT_POS as usize;
    let mut acc = f32::new(0.0);
    for i in view.lo..view.hi {
        let v = x[view.base + i];
        if within(order_key(v), u32::cast_from(i), vb, ib, t) {
            acc += share(v, view, mass);
        }
    }
    part[unit] = acc;
    sync_cube();
    tree_sum(part, unit, CUBE_DIM as usize);
    let total = part[0];
    sync_cube();
    total
}

/// The first entry, most likely first, of the prefix `(vb, ib)` where the running count or
/// mass reaches `target` (`strict`: passes it); its key into `found[0]`, its id into
/// `found[1]` (as f32). The key by bisection (the largest `t` whose entries of key `≥ t`
/// reach the target), then among the entries of that key a walk in id order, chunk by chunk.
#[cube]
#[allow(clippy::too_many_arguments)]
fn find_first(
    x: &[f32],
    view: &RowView,
    mass: bool,
    vb: u32,
    ib: u32,
    target: f32,
    strict: bool,
    part: &mut Shared<[f32]>,
    lasts: &mut Shared<[f32]>,
    before: &mut Shared<[f32]>,
    found: &mut Shared<[f32]>,
) {
    let unit = UNIT_POS as usize;
    let mut key = 0u32;
    for b in 0..32u32 {
        let cand = key | (1u32 << (31u32 - b));
        if meets(
            total_from(x, view, mass, vb, ib, cand, part),
            target,
            strict,
        ) {
            key = cand;
        }
    }
    let mut above = f32::new(0.0);
    if key < 0xffff_ffffu32 {
        above = total_from(x, view, mass, vb, ib, key + 1, part);
    }
    // The entries of that key, in id order: each chunk's share, then the chunk that reaches
    // the target walks to the entry (the last entry of the key where rounding finds none).
    let mut m = f32::new(0.0);
    let mut last = f32::new(-1.0);
    for i in view.lo..view.hi {
        let v = x[view.base + i];
        let k = order_key(v);
        if k == key && within(k, u32::cast_from(i), vb, ib, key) {
            m += share(v, view, mass);
            last = f32::cast_from(i);
        }
    }
    part[unit] = m;
    lasts[unit] = last;
    sync_cube();
    if unit == 0 {
        let mut acc = above;
        let mut fallback = f32::new(0.0);
        for k in 0..CUBE_DIM as usize {
            before[k] = acc;
            acc += part[k];
            if lasts[k] >= 0.0 {
                fallback = lasts[k];
            }
        }
        found[0] = f32::reinterpret(key);
        found[1] = fallback;
    }
    sync_cube();
    let a0 = before[unit];
    // `a0 + m` is the very sum unit 0 computed for the next chunk's start.
    if !meets(a0, target, strict) && meets(a0 + m, target, strict) {
        let mut a = a0;
        let mut at = last;
        let mut done = false;
        for i in view.lo..view.hi {
            let v = x[view.base + i];
            let k = order_key(v);
            if !done && k == key && within(k, u32::cast_from(i), vb, ib, key) {
                a += share(v, view, mass);
                if meets(a, target, strict) {
                    done = true;
                    at = f32::cast_from(i);
                }
            }
        }
        found[1] = at;
    }
    sync_cube();
}

/// One cube per row: the host sampler's draw with a top-k and/or top-p cut — the `top_k`
/// most likely tokens (0: all), then the shortest most-likely-first prefix holding `top_p` of
/// their mass (1: all), then inverse CDF in that order at `u[row]` times the kept mass — as an
/// f32 id.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn sample_sorted_kernel(
    x: &[f32],
    u: &[f32],
    out: &mut [f32],
    rows: usize,
    cols: usize,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    #[comptime] units: usize,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let mut part = Shared::<[f32]>::new_slice(units);
    let mut lasts = Shared::<[f32]>::new_slice(units);
    let mut before = Shared::<[f32]>::new_slice(units);
    let mut found = Shared::<[f32]>::new_slice(2usize);
    let view = row_view(x, row, cols, temperature, &mut part, units);
    let unit = UNIT_POS as usize;
    // The kept prefix ends at the entry of key `vb`, id `ib` (all entries at first).
    let mut vb = 0u32;
    let mut ib = u32::new(4_294_967_295i64);
    if top_k > 0 && top_k < cols {
        let k = f32::cast_from(top_k);
        find_first(
            x,
            &view,
            false,
            vb,
            ib,
            k,
            false,
            &mut part,
            &mut lasts,
            &mut before,
            &mut found,
        );
        vb = u32::reinterpret(found[0]);
        ib = u32::cast_from(found[1]);
    }
    if top_p < 1.0 {
        let z = total_from(x, &view, true, vb, ib, 0u32, &mut part);
        find_first(
            x,
            &view,
            true,
            vb,
            ib,
            top_p * z,
            false,
            &mut part,
            &mut lasts,
            &mut before,
            &mut found,
        );
        vb = u32::reinterpret(found[0]);
        ib = u32::cast_from(found[1]);
    }
    let z = total_from(x, &view, true, vb, ib, 0u32, &mut part);
    // Strictly below the kept mass, which the prefix's first key already reaches.
    let mut target = u[row] * z;
    if target >= z {
        target = z * 0.999_999_9;
    }
    find_first(
        x,
        &view,
        true,
        vb,
        ib,
        target,
        true,
        &mut part,
        &mut lasts,
        &mut before,
        &mut found,
    );
    if unit == 0 {
        out[row] = found[1];
    }
}

/// See [`super::DecodeKernels::sample_rows`].
pub(super) fn sample_rows(
    x: CubeTensor,
    u: CubeTensor,
    temperature: f32,
    top_k: usize,
    top_p: f32,
) -> CubeTensor {
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
    let most = x.client.properties().hardware.max_units_per_cube as usize;
    // The largest power of two the device allows (the trees halve the cube).
    let units = SAMPLE_UNITS.min(1 << most.max(1).ilog2());
    if top_k == 0 && top_p >= 1.0 {
        sample_rows_kernel::launch(
            &x.client,
            grid(rows),
            CubeDim::new_1d(units as u32),
            x.clone().into_buffer_arg(),
            u.into_buffer_arg(),
            out.clone().into_buffer_arg(),
            rows,
            cols,
            temperature,
            units,
        );
    } else {
        sample_sorted_kernel::launch(
            &x.client,
            grid(rows),
            CubeDim::new_1d(units as u32),
            x.clone().into_buffer_arg(),
            u.into_buffer_arg(),
            out.clone().into_buffer_arg(),
            rows,
            cols,
            temperature,
            top_k,
            top_p,
            units,
        );
    }
    out
}
