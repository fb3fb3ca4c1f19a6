//! A few rows' grouped-query attention in one kernel ([`super::DecodeKernels::attention_rows`]).

use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::ChunkSlots;
use super::kernels::{
    ELEMENT_UNITS, ROW_UNITS, dense_output, f32_only, grid, sequence, tree_max, tree_sum,
};

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

/// A row's scores in `scratch[sb..sb + n]` turned into `exp(score − max)` in place (`m`: the
/// largest score this unit saw); returns their sum, after which every unit may read every
/// entry. The whole cube calls it; the trees run in a fixed order ([`tree_max`], [`tree_sum`]).
#[cube]
fn exp_scores(
    scratch: &mut [f32],
    sb: usize,
    n: usize,
    m: f32,
    part: &mut Shared<[f32]>,
    unit: usize,
    #[comptime] units: usize,
) -> f32 {
    part[unit] = m;
    sync_cube();
    tree_max(part, unit);
    let max = part[0];
    sync_cube();
    let mut sum = f32::new(0.0);
    for c in 0..n.div_ceil(units) {
        let j = c * units + unit;
        if j < n {
            let p = f32::exp(scratch[sb + j] - max);
            scratch[sb + j] = p;
            sum += p;
        }
    }
    part[unit] = sum;
    sync_cube();
    tree_sum(part, unit, CUBE_DIM as usize);
    let total = part[0];
    // Every unit reads every score next: the scratch writes must be visible cube-wide.
    sync_storage();
    total
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
    let total = exp_scores(scratch, sb, n, m, &mut part, unit, units);
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

/// One sequence's chunk of a stacked forward in one kernel: its rows' K/V written into the
/// sequence's cache buffers, and each row's attention over the positions it sees. One cube per
/// (query head, row). The chunk's first position `start` is read from the stacked rows'
/// positions on the device, and the scratch's width is the cache's slots plus the chunk's
/// rows, so the launch's arguments stay the same from one decode step to the next. Row `i` of
/// the chunk (stacked row `row0 + i`, position `p = start + i`)
/// sees positions `lo ..= p`, `lo = p + 1 − window` for a sliding layer past its window, else
/// 0. Position `s < start` is read from the cache, slot `(s − origin) % modulus` of its
/// `slots`; `s ≥ start` from the chunk's own rows (which this launch also writes to the cache:
/// no cube reads a slot another writes). The sums run as in [`attention_rows_kernel`]: keys in
/// position order, the same chunking and trees, so a row's bits equal that kernel's over the
/// same keys.
#[cube(launch)]
fn span_attention_kernel(
    q: &[f32],
    k_new: &[f32],
    v_new: &[f32],
    cache_k: &mut [f32],
    cache_v: &mut [f32],
    positions: &[f32],
    scratch: &mut [f32],
    out: &mut [f32],
    shape: Sequence<usize>,
    at: Sequence<usize>,
    scale: f32,
    #[comptime] units: usize,
) {
    // shape: stacked rows, chunk rows, heads, query heads per KV head, head width, scratch
    // width; at: first stacked row, where the stacked rows' positions start in `positions`,
    // ring origin, slot modulus, cache slots, window (0: none).
    let (rows, t, heads) = (*shape.index(0), *shape.index(1), *shape.index(2));
    let (groups, d, keys) = (*shape.index(3), *shape.index(4), *shape.index(5));
    let (row0, first, origin) = (*at.index(0), *at.index(1), *at.index(2));
    let (modulus, slots, window) = (*at.index(3), *at.index(4), *at.index(5));
    // The chunk's first position, read on the device: a replayed step reads the one written
    // for it.
    let start = usize::cast_from(u32::cast_from(positions[first + row0]));
    let cube = CUBE_POS;
    if cube >= heads * t {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let (h, i) = (cube / t, cube % t);
    let kvh = h / groups;
    let p = start + i;
    let own = (kvh * rows + row0 + i) * d;
    // The row's own K/V into its slot, by the first query head of the KV head.
    if h % groups == 0 {
        let dst = (kvh * slots + (p - origin) % modulus) * d;
        for c in 0..d.div_ceil(units) {
            let e = c * units + unit;
            if e < d {
                cache_k[dst + e] = k_new[own + e];
                cache_v[dst + e] = v_new[own + e];
            }
        }
    }
    let mut lo = 0;
    if window > 0 && p + 1 > window {
        lo = p + 1 - window;
    }
    let n = p + 1 - lo;
    let qb = (h * rows + row0 + i) * d;
    let sb = cube * keys;
    let chunks = n.div_ceil(units);
    let mut part = Shared::<[f32]>::new_slice(units);
    let mut m = f32::new(f32::MIN);
    for c in 0..chunks {
        let j = c * units + unit;
        if j < n {
            let s = lo + j;
            let mut dot = f32::new(0.0);
            if s >= start {
                let kb = (kvh * rows + row0 + s - start) * d;
                for e in 0..d {
                    dot += q[qb + e] * k_new[kb + e];
                }
            } else {
                let kb = (kvh * slots + (s - origin) % modulus) * d;
                for e in 0..d {
                    dot += q[qb + e] * cache_k[kb + e];
                }
            }
            let score = dot * scale;
            scratch[sb + j] = score;
            if score > m {
                m = score;
            }
        }
    }
    let total = exp_scores(scratch, sb, n, m, &mut part, unit, units);
    for c in 0..d.div_ceil(units) {
        let e = c * units + unit;
        if e < d {
            let mut acc = f32::new(0.0);
            for j in 0..n {
                let s = lo + j;
                if s >= start {
                    acc += scratch[sb + j] * v_new[(kvh * rows + row0 + s - start) * d + e];
                } else {
                    acc +=
                        scratch[sb + j] * cache_v[(kvh * slots + (s - origin) % modulus) * d + e];
                }
            }
            out[((row0 + i) * heads + h) * d + e] = acc / total;
        }
    }
}

/// See [`super::DecodeKernels::span_attention`]. `out` is `None` for the first chunk of a
/// forward (a dense output is allocated), else the earlier chunks' output, written in place.
#[allow(clippy::too_many_arguments)]
pub(super) fn span_attention(
    q: CubeTensor,
    k_new: CubeTensor,
    v_new: CubeTensor,
    cache_k: CubeTensor,
    cache_v: CubeTensor,
    (positions, first): (CubeTensor, usize),
    out: Option<CubeTensor>,
    scale: f32,
    at: ChunkSlots,
) -> CubeTensor {
    f32_only(&q, "span_attention");
    f32_only(&positions, "span_attention");
    let (q, k_new, v_new) = (
        into_contiguous(q),
        into_contiguous(k_new),
        into_contiguous(v_new),
    );
    let (heads, rows, d) = (q.meta.shape()[0], q.meta.shape()[1], q.meta.shape()[2]);
    let kv_heads = k_new.meta.shape()[0];
    let slots = cache_k.meta.shape()[1];
    assert!(
        kv_heads > 0 && heads % kv_heads == 0,
        "span_attention: {heads} heads over {kv_heads} KV heads"
    );
    assert!(
        heads > 0 && cache_k.is_contiguous() && cache_v.is_contiguous() && at.row0 + at.t <= rows,
        "span_attention: the cache buffers must be dense (see unique_dense), the chunk within the rows"
    );
    assert!(
        at.start >= at.origin && at.t > 0 && (at.start + at.t - 1 - at.origin) % at.modulus < slots,
        "span_attention: a chunk of {} at {} past a cache of {slots} slots (origin {}, mod {})",
        at.t,
        at.start,
        at.origin,
        at.modulus
    );
    let out = out.unwrap_or_else(|| dense_output(&q, Shape::new([rows, heads * d])));
    // The most keys a row sees (the last row's, at most its window), within the width.
    let keys = slots + at.t;
    let last = at.start + at.t - 1;
    let seen = match at.window {
        0 => last + 1,
        w => w.min(last + 1),
    };
    assert!(
        seen <= keys && first + at.row0 + at.t <= positions.meta.shape().num_elements(),
        "span_attention: {seen} keys past a scratch of {keys}, or rows past the positions"
    );
    let positions = into_contiguous(positions);
    let scratch = dense_output(&q, Shape::new([heads * at.t, keys]));
    span_attention_kernel::launch(
        &q.client.clone(),
        grid(heads * at.t),
        CubeDim::new_1d(ROW_UNITS as u32),
        q.into_buffer_arg(),
        k_new.into_buffer_arg(),
        v_new.into_buffer_arg(),
        cache_k.into_buffer_arg(),
        cache_v.into_buffer_arg(),
        positions.into_buffer_arg(),
        scratch.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        sequence(&[rows, at.t, heads, heads / kv_heads, d, keys]),
        sequence(&[at.row0, first, at.origin, at.modulus, slots, at.window]),
        scale,
        ROW_UNITS,
    );
    out
}

/// Copies `src` into `dst` element by element (both dense, one length).
#[cube(launch)]
fn copy_kernel(src: &[f32], dst: &mut [f32], n: usize) {
    let i = CUBE_POS * CUBE_DIM as usize + UNIT_POS as usize;
    if i < n {
        dst[i] = src[i];
    }
}

/// `src` copied into `dst`'s buffer in place, whoever else holds it (both dense, one size);
/// returns `dst`.
pub(super) fn copy_into(dst: CubeTensor, src: CubeTensor) -> CubeTensor {
    f32_only(&dst, "copy_into");
    f32_only(&src, "copy_into");
    let n = dst.meta.shape().num_elements();
    assert!(
        dst.is_contiguous() && src.meta.shape().num_elements() == n,
        "copy_into: a dense destination {:?} of the source's size {:?}",
        dst.meta.shape(),
        src.meta.shape()
    );
    copy(into_contiguous(src), dst)
}

/// `x` itself when nothing else holds its buffer and its rows are dense, else a dense copy:
/// what a kernel may then write in place.
pub(super) fn unique_dense(x: CubeTensor) -> CubeTensor {
    if x.can_mut() && x.is_nonoverlapping() && x.is_contiguous() && x.is_contiguous_buffer() {
        return x;
    }
    f32_only(&x, "unique_dense");
    let src = into_contiguous(x);
    let dst = dense_output(&src, src.meta.shape().clone());
    copy(src, dst)
}

/// Dense `src`'s elements into dense `dst` (`dst`'s count of them); returns `dst`.
fn copy(src: CubeTensor, dst: CubeTensor) -> CubeTensor {
    let n = dst.meta.shape().num_elements();
    if n > 0 {
        copy_kernel::launch(
            &src.client.clone(),
            grid(n.div_ceil(ELEMENT_UNITS)),
            CubeDim::new_1d(ELEMENT_UNITS as u32),
            src.into_buffer_arg(),
            dst.clone().into_buffer_arg(),
            n,
        );
    }
    dst
}
