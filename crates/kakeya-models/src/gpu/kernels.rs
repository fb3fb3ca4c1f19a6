//! The CubeCL kernels behind [`super::DecodeKernels`], written once for every CubeCL runtime
//! (CUDA, wgpu/Vulkan/Metal). f32 throughout; every reduction runs in a fixed order that does
//! not depend on how many rows a launch carries, so a row's result is the same bits in a
//! one-row decode step and in an eight-row verify block.

use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units of a row kernel's cube (a power of two).
const ROW_UNITS: usize = 128;
/// Units of [`argmax_rows_kernel`]'s cube (a power of two).
const ARGMAX_UNITS: usize = 256;
/// Units that share one output of [`linear_rows_kernel`] (a power of two).
const LANES: usize = 32;
/// Outputs one cube of [`linear_rows_kernel`] computes.
const OUTPUTS_PER_CUBE: usize = 8;
/// Most cubes along one axis of a launch grid (the common limit of CUDA's y/z and wgpu).
const GRID_AXIS: usize = 65_535;

/// Sums `part[0..CUBE_DIM]` into `part[0]` (a fixed tree; every unit of the cube must call
/// it). The halving count starts from the runtime `CUBE_DIM`: a loop variable that starts as a
/// comptime value fails CubeCL 0.11's IR verification ("expected cube.ptr, found cube.index").
#[cube]
fn tree_sum(part: &mut Shared<[f32]>, unit: usize) {
    let mut s = CUBE_DIM as usize / 2;
    while s > 0 {
        if unit < s {
            let sum = part[unit] + part[unit + s];
            part[unit] = sum;
        }
        sync_cube();
        s /= 2;
    }
}

/// One cube per row: `out = x / sqrt(mean(x²) + eps) · scale`.
#[cube(launch)]
fn rms_norm_kernel(
    x: &[f32],
    scale: &[f32],
    out: &mut [f32],
    rows: usize,
    dim: usize,
    inv_dim: f32,
    eps: f32,
    #[comptime] units: usize,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let base = row * dim;
    let chunks = dim.div_ceil(units);
    let mut part = Shared::<[f32]>::new_slice(units);
    let mut acc = f32::new(0.0);
    for c in 0..chunks {
        let i = c * units + unit;
        if i < dim {
            let v = x[base + i];
            acc += v * v;
        }
    }
    part[unit] = acc;
    sync_cube();
    tree_sum(&mut part, unit);
    let inv = f32::new(1.0) / f32::sqrt(part[0] * inv_dim + eps);
    for c in 0..chunks {
        let j = c * units + unit;
        if j < dim {
            out[base + j] = x[base + j] * inv * scale[j];
        }
    }
}

/// `out = gelu_tanh(gate) · up`, element-wise, in the form of [`crate::activation::gelu_tanh`].
#[cube(launch)]
fn gelu_mul_kernel(gate: &[f32], up: &[f32], out: &mut [f32], len: usize) {
    let i = ABSOLUTE_POS;
    if i < len {
        let g = gate[i];
        let u2 = (g + g * g * g * 0.044_715f32) * 1.595_769_2_f32;
        out[i] = g * (1.0f32 / (1.0f32 + f32::exp(-u2))) * up[i];
    }
}

/// Half-split RoPE, one unit per rotated pair, in the form of [`crate::rope::Rope::apply`].
#[cube(launch)]
fn rope_kernel(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    out: &mut [f32],
    pairs: usize,
    t: usize,
    half: usize,
) {
    let i = ABSOLUTE_POS;
    if i < pairs {
        let row = i / half;
        let j = i % half;
        let at = (row % t) * half + j;
        let (c, s) = (cos[at], sin[at]);
        let lo = row * 2 * half + j;
        let (x1, x2) = (x[lo], x[lo + half]);
        out[lo] = x1 * c - x2 * s;
        out[lo + half] = x2 * c + x1 * s;
    }
}

/// `part[0] = max(part[0..CUBE_DIM])` (as [`tree_sum`]).
#[cube]
fn tree_max(part: &mut Shared<[f32]>, unit: usize) {
    let mut s = CUBE_DIM as usize / 2;
    while s > 0 {
        if unit < s && part[unit + s] > part[unit] {
            let m = part[unit + s];
            part[unit] = m;
        }
        sync_cube();
        s /= 2;
    }
}

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

/// `out[r, o] = Σ_k x[r, k] · w[o, k]` for a few rows: [`LANES`] units per output stride
/// over `k` and sum in a fixed tree, so each row's result is independent of `rows`.
#[cube(launch)]
fn linear_rows_kernel(
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    rows: usize,
    k: usize,
    n: usize,
    #[comptime] lanes: usize,
    #[comptime] outputs: usize,
) {
    let unit = UNIT_POS as usize;
    let lane = unit % lanes;
    let o = CUBE_POS * outputs + unit / lanes;
    let live = o < n;
    let mut part = Shared::<[f32]>::new_slice(lanes * outputs);
    let group = unit - lane;
    let chunks = k.div_ceil(lanes);
    for r in 0..rows {
        let mut acc = f32::new(0.0);
        if live {
            let xr = r * k;
            let wo = o * k;
            for c in 0..chunks {
                let i = c * lanes + lane;
                if i < k {
                    acc += x[xr + i] * w[wo + i];
                }
            }
        }
        part[unit] = acc;
        sync_cube();
        // A runtime count: the tree's loop variable must not be a comptime value.
        let mut s = CUBE_DIM as usize / outputs / 2;
        while s > 0 {
            if lane < s {
                let sum = part[unit] + part[unit + s];
                part[unit] = sum;
            }
            sync_cube();
            s /= 2;
        }
        if live && lane == 0 {
            out[r * n + o] = part[group];
        }
        sync_cube();
    }
}

/// A launch grid of `cubes` cubes (split over two axes past [`GRID_AXIS`]).
fn grid(cubes: usize) -> CubeCount {
    let x = cubes.min(GRID_AXIS);
    let y = cubes.div_ceil(GRID_AXIS);
    CubeCount::Static(x as u32, y as u32, 1)
}

/// An uninitialised output with dense rows. Burn's `empty_device_dtype` may pad each row to
/// the device's pitch (CUDA does), and these kernels index rows as `row · dim`; the inputs are
/// made dense by `into_contiguous`.
fn dense_output(
    client: cubecl::client::Client,
    device: burn_cubecl::CubeDevice,
    shape: Shape,
    dtype: DType,
) -> CubeTensor {
    empty_device_contiguous_dtype(client, device, shape, dtype)
}

fn f32_only(t: &CubeTensor, what: &str) {
    assert_eq!(
        t.dtype,
        DType::F32,
        "{what}: the decode kernels take f32 tensors"
    );
}

/// See [`super::DecodeKernels::rms_norm_rows`].
pub(super) fn rms_norm_rows(x: CubeTensor, scale: CubeTensor, eps: f32) -> CubeTensor {
    f32_only(&x, "rms_norm_rows");
    let x = into_contiguous(x);
    let scale = into_contiguous(scale);
    let shape = x.meta.shape().clone();
    let dim = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / dim.max(1);
    let out = dense_output(x.client.clone(), x.device.clone(), shape, x.dtype);
    if rows == 0 {
        return out;
    }
    rms_norm_kernel::launch(
        &x.client,
        grid(rows),
        CubeDim::new_1d(ROW_UNITS as u32),
        x.clone().into_buffer_arg(),
        scale.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        rows,
        dim,
        1.0 / dim as f32,
        eps,
        ROW_UNITS,
    );
    out
}

/// See [`super::DecodeKernels::gelu_mul`].
pub(super) fn gelu_mul(gate: CubeTensor, up: CubeTensor) -> CubeTensor {
    f32_only(&gate, "gelu_mul");
    let gate = into_contiguous(gate);
    let up = into_contiguous(up);
    let shape = gate.meta.shape().clone();
    let len = shape.num_elements();
    let out = dense_output(gate.client.clone(), gate.device.clone(), shape, gate.dtype);
    if len == 0 {
        return out;
    }
    let units = 256usize;
    gelu_mul_kernel::launch(
        &gate.client,
        grid(len.div_ceil(units)),
        CubeDim::new_1d(units as u32),
        gate.clone().into_buffer_arg(),
        up.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        len,
    );
    out
}

/// See [`super::DecodeKernels::rope`].
pub(super) fn rope(x: CubeTensor, cos: CubeTensor, sin: CubeTensor) -> CubeTensor {
    f32_only(&x, "rope");
    let x = into_contiguous(x);
    let (cos, sin) = (into_contiguous(cos), into_contiguous(sin));
    let shape = x.meta.shape().clone();
    let (t, d) = (shape[1], shape[2]);
    let pairs = shape.num_elements() / 2;
    let out = dense_output(x.client.clone(), x.device.clone(), shape, x.dtype);
    if pairs == 0 {
        return out;
    }
    let units = 256usize;
    rope_kernel::launch(
        &x.client,
        grid(pairs.div_ceil(units)),
        CubeDim::new_1d(units as u32),
        x.clone().into_buffer_arg(),
        cos.into_buffer_arg(),
        sin.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        pairs,
        t,
        d / 2,
    );
    out
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
    let (client, device, dtype) = (q.client.clone(), q.device.clone(), q.dtype);
    let out = dense_output(
        client.clone(),
        device.clone(),
        Shape::new([t, heads * d]),
        dtype,
    );
    if heads * t == 0 {
        return out;
    }
    let scratch = dense_output(client.clone(), device, Shape::new([heads * t, keys]), dtype);
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

/// See [`super::DecodeKernels::argmax_rows`].
pub(super) fn argmax_rows(x: CubeTensor) -> CubeTensor {
    f32_only(&x, "argmax_rows");
    let x = into_contiguous(x);
    let (rows, cols) = (x.meta.shape()[0], x.meta.shape()[1]);
    assert!(
        cols < 1 << 24,
        "argmax_rows: {cols} columns do not fit an f32 index"
    );
    let out = dense_output(
        x.client.clone(),
        x.device.clone(),
        Shape::new([rows]),
        x.dtype,
    );
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

/// See [`super::DecodeKernels::linear_rows`].
pub(super) fn linear_rows(x: CubeTensor, weight: CubeTensor) -> CubeTensor {
    f32_only(&x, "linear_rows");
    let x = into_contiguous(x);
    let weight = into_contiguous(weight);
    let (rows, k) = (x.meta.shape()[0], x.meta.shape()[1]);
    let n = weight.meta.shape()[0];
    assert_eq!(
        weight.meta.shape()[1],
        k,
        "linear_rows: x is [rows, {k}], w is [n, k]"
    );
    let out = dense_output(
        x.client.clone(),
        x.device.clone(),
        Shape::new([rows, n]),
        x.dtype,
    );
    if rows == 0 || n == 0 {
        return out;
    }
    linear_rows_kernel::launch(
        &x.client,
        grid(n.div_ceil(OUTPUTS_PER_CUBE)),
        CubeDim::new_1d((LANES * OUTPUTS_PER_CUBE) as u32),
        x.clone().into_buffer_arg(),
        weight.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        rows,
        k,
        n,
        LANES,
        OUTPUTS_PER_CUBE,
    );
    out
}

/// The unfused backend's half of [`super::DecodeKernels`] (Burn's fusion, when on, wraps it).
impl super::DecodeKernels for CubeBackend {
    fn rms_norm_rows(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        eps: f32,
    ) -> FloatTensor<Self> {
        rms_norm_rows(x, scale, eps)
    }

    fn gelu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        gelu_mul(gate, up)
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rope(x, cos, sin)
    }

    fn linear_rows(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        linear_rows(x, weight)
    }

    fn argmax_rows(x: FloatTensor<Self>) -> FloatTensor<Self> {
        argmax_rows(x)
    }

    fn attention_rows(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
        lo0: usize,
        dlo: usize,
        hi0: usize,
        dhi: usize,
    ) -> FloatTensor<Self> {
        attention_rows(q, k, v, scale, lo0, dlo, hi0, dhi)
    }
}
