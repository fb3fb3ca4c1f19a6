//! The row kernels behind [`super::DecodeKernels`] (RMSNorm with a residual add or RoPE after
//! it, RoPE, the tanh GELU gate; the argmax is `super::argmax`) and what every kernel here shares: launch grids,
//! dense outputs, the fixed-order reductions. Written once for every CubeCL runtime (CUDA,
//! wgpu/Vulkan/Metal); f32 throughout; every reduction runs in an order that does not depend on
//! how many rows a launch carries.

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// Units of a row kernel's cube (a power of two).
pub(super) const ROW_UNITS: usize = 128;
/// Units of an element-wise kernel's cube.
pub(super) const ELEMENT_UNITS: usize = 256;
/// Most cubes along one axis of a launch grid (the common limit of CUDA's y/z and wgpu).
const GRID_AXIS: usize = 65_535;

/// Sums each group of `width` consecutive entries of `part` into the group's first entry, in
/// a fixed tree (`width` a power of two; every unit of the cube must call it). `width` is a
/// runtime value on purpose: a halving loop variable that starts as a comptime value fails
/// CubeCL 0.11's IR verification ("expected cube.ptr, found cube.index").
#[cube]
pub(super) fn tree_sum(part: &mut Shared<[f32]>, unit: usize, width: usize) {
    let lane = unit % width;
    let mut s = width / 2;
    while s > 0 {
        if lane < s {
            let sum = part[unit] + part[unit + s];
            part[unit] = sum;
        }
        sync_cube();
        s /= 2;
    }
}

/// `part[0] = max(part[0..CUBE_DIM])` (a fixed tree, as [`tree_sum`] over the whole cube).
#[cube]
pub(super) fn tree_max(part: &mut Shared<[f32]>, unit: usize) {
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

/// `1 / sqrt(mean(x[base..base + dim]²) + eps)`, by the whole cube (`part` is its scratch).
#[cube]
fn inv_rms(
    x: &[f32],
    base: usize,
    dim: usize,
    inv_dim: f32,
    eps: f32,
    part: &mut Shared<[f32]>,
    #[comptime] units: usize,
) -> f32 {
    let unit = UNIT_POS as usize;
    let mut acc = f32::new(0.0);
    for c in 0..dim.div_ceil(units) {
        let i = c * units + unit;
        if i < dim {
            let v = x[base + i];
            acc += v * v;
        }
    }
    part[unit] = acc;
    sync_cube();
    tree_sum(part, unit, CUBE_DIM as usize);
    f32::new(1.0) / f32::sqrt(part[0] * inv_dim + eps)
}

/// One cube per row: `out = x / sqrt(mean(x²) + eps) · scale`, plus `residual` when `add`.
#[cube(launch)]
fn rms_norm_kernel(
    x: &[f32],
    scale: &[f32],
    residual: &[f32],
    out: &mut [f32],
    rows: usize,
    dim: usize,
    inv_dim: f32,
    eps: f32,
    #[comptime] units: usize,
    #[comptime] add: bool,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let base = row * dim;
    let mut part = Shared::<[f32]>::new_slice(units);
    let inv = inv_rms(x, base, dim, inv_dim, eps, &mut part, units);
    for c in 0..dim.div_ceil(units) {
        let j = c * units + unit;
        if j < dim {
            let y = x[base + j] * inv * scale[j];
            if add {
                out[base + j] = residual[base + j] + y;
            } else {
                out[base + j] = y;
            }
        }
    }
}

/// One cube per row: `h = residual + rms_norm(x)·scale` into plane 0 of `out`, then
/// `rms_norm(h)·next` into plane 1 — a sublayer's output onto the residual stream and the next
/// sublayer's input norm, the same operations in the same order as [`rms_norm_kernel`] twice.
#[cube(launch)]
fn rms_norm_add_norm_kernel(
    x: &[f32],
    scale: &[f32],
    residual: &[f32],
    next: &[f32],
    out: &mut [f32],
    rows: usize,
    dim: usize,
    inv_dim: f32,
    eps: f32,
    next_eps: f32,
    #[comptime] units: usize,
) {
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let base = row * dim;
    let plane = rows * dim;
    let mut part = Shared::<[f32]>::new_slice(units);
    let inv = inv_rms(x, base, dim, inv_dim, eps, &mut part, units);
    // `h`'s squares summed as `inv_rms` sums them: the same entries per unit, in order.
    let mut acc = f32::new(0.0);
    for c in 0..dim.div_ceil(units) {
        let j = c * units + unit;
        if j < dim {
            let h = residual[base + j] + x[base + j] * inv * scale[j];
            out[base + j] = h;
            acc += h * h;
        }
    }
    sync_cube();
    part[unit] = acc;
    sync_cube();
    tree_sum(&mut part, unit, CUBE_DIM as usize);
    let inv = f32::new(1.0) / f32::sqrt(part[0] * inv_dim + next_eps);
    // Each unit reads back only the entries it wrote.
    for c in 0..dim.div_ceil(units) {
        let j = c * units + unit;
        if j < dim {
            out[plane + base + j] = out[base + j] * inv * next[j];
        }
    }
}

/// One head vector: RMSNorm of `x[base..base + d]` with `scale`, then half-split RoPE with
/// the row's `cos`/`sin` at `at`, into `out[obase..obase + d]` (the same operations, in the
/// same order, as [`crate::norm::RmsNorm::forward`] then [`crate::rope::Rope::apply`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn norm_rope_row(
    x: &[f32],
    base: usize,
    scale: &[f32],
    eps: f32,
    cos: &[f32],
    sin: &[f32],
    at: usize,
    out: &mut [f32],
    obase: usize,
    d: usize,
    inv_dim: f32,
    part: &mut Shared<[f32]>,
    #[comptime] units: usize,
) {
    let unit = UNIT_POS as usize;
    let half = d / 2;
    let inv = inv_rms(x, base, d, inv_dim, eps, part, units);
    for c in 0..half.div_ceil(units) {
        let j = c * units + unit;
        if j < half {
            let x1 = x[base + j] * inv * scale[j];
            let x2 = x[base + half + j] * inv * scale[half + j];
            let (cj, sj) = (cos[at + j], sin[at + j]);
            out[obase + j] = x1 * cj - x2 * sj;
            out[obase + half + j] = x2 * cj + x1 * sj;
        }
    }
}

/// One cube per output row of `[H, T, d]`: a head vector's RMSNorm, then RoPE at its
/// position ([`norm_rope_row`]). Rows below `split` (heads `0..split / T`) read `x` with
/// `scale_x`, the others `y` with `scale_y` (queries and keys in one launch); head `h` at
/// position index `i` of an input starts at `h · head_stride + i · row_stride` (`strides`:
/// x's then y's), so the heads-first views of a projection's rows are read in place.
#[cube(launch)]
fn rms_norm_rope_kernel(
    x: &[f32],
    y: &[f32],
    scale_x: &[f32],
    scale_y: &[f32],
    cos: &[f32],
    sin: &[f32],
    out: &mut [f32],
    shape: Sequence<usize>,
    strides: Sequence<usize>,
    inv_dim: f32,
    eps_x: f32,
    eps_y: f32,
    #[comptime] units: usize,
) {
    // shape: rows, split, T, d.
    let (rows, split, t, d) = (
        *shape.index(0),
        *shape.index(1),
        *shape.index(2),
        *shape.index(3),
    );
    let row = CUBE_POS;
    if row >= rows {
        terminate!();
    }
    let mut part = Shared::<[f32]>::new_slice(units);
    let (h, i) = (row / t, row % t);
    let at = i * (d / 2);
    if row < split {
        let base = h * *strides.index(0) + i * *strides.index(1);
        norm_rope_row(
            x,
            base,
            scale_x,
            eps_x,
            cos,
            sin,
            at,
            out,
            row * d,
            d,
            inv_dim,
            &mut part,
            units,
        );
    } else {
        let base = (h - split / t) * *strides.index(2) + i * *strides.index(3);
        norm_rope_row(
            y,
            base,
            scale_y,
            eps_y,
            cos,
            sin,
            at,
            out,
            row * d,
            d,
            inv_dim,
            &mut part,
            units,
        );
    }
}

/// `out[r, j] = gelu_tanh(gu[r, j]) · gu[r, inner + j]`, element-wise, in the form of
/// [`crate::activation::gelu_tanh`].
#[cube(launch)]
fn gelu_mul_halves_kernel(gu: &[f32], out: &mut [f32], len: usize, inner: usize) {
    let i = ABSOLUTE_POS;
    if i < len {
        let at = (i / inner) * 2 * inner + i % inner;
        let g = gu[at];
        let u2 = (g + g * g * g * 0.044_715f32) * 1.595_769_2_f32;
        out[i] = g * (1.0f32 / (1.0f32 + f32::exp(-u2))) * gu[at + inner];
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

/// A launch grid of `cubes` cubes (split over two axes past [`GRID_AXIS`]).
pub(super) fn grid(cubes: usize) -> CubeCount {
    let x = cubes.min(GRID_AXIS);
    let y = cubes.div_ceil(GRID_AXIS);
    CubeCount::Static(x as u32, y as u32, 1)
}

/// An uninitialised output of `like`'s device and dtype with dense rows. Burn's
/// `empty_device_dtype` may pad each row to the device's pitch (CUDA does), and these kernels
/// index rows as `row · dim`; their inputs are made dense by `into_contiguous`.
pub(super) fn dense_output(like: &CubeTensor, shape: Shape) -> CubeTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, like.dtype)
}

/// Refuses anything but f32 (what every kernel here reads and writes).
pub(super) fn f32_only(t: &CubeTensor, what: &str) {
    assert_eq!(
        t.dtype,
        DType::F32,
        "{what}: the decode kernels take f32 tensors"
    );
}

/// See [`super::DecodeKernels::rms_norm_rows`] and [`super::DecodeKernels::rms_norm_add`].
pub(super) fn rms_norm(
    x: CubeTensor,
    scale: CubeTensor,
    eps: f32,
    residual: Option<CubeTensor>,
) -> CubeTensor {
    f32_only(&x, "rms_norm");
    let x = into_contiguous(x);
    let scale = into_contiguous(scale);
    let shape = x.meta.shape().clone();
    let dim = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / dim.max(1);
    let out = dense_output(&x, shape);
    if rows == 0 {
        return out;
    }
    let add = residual.is_some();
    // Without a residual the kernel reads none: `x` stands in for the unused binding.
    let residual = residual.map_or_else(|| x.clone(), into_contiguous);
    rms_norm_kernel::launch(
        &x.client,
        grid(rows),
        CubeDim::new_1d(ROW_UNITS as u32),
        x.clone().into_buffer_arg(),
        scale.into_buffer_arg(),
        residual.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        rows,
        dim,
        1.0 / dim as f32,
        eps,
        ROW_UNITS,
        add,
    );
    out
}

/// See [`super::DecodeKernels::rms_norm_add_norm`].
pub(super) fn rms_norm_add_norm(
    x: CubeTensor,
    scale: CubeTensor,
    (eps, next_eps): (f32, f32),
    residual: CubeTensor,
    next: CubeTensor,
) -> CubeTensor {
    f32_only(&x, "rms_norm_add_norm");
    let (x, residual) = (into_contiguous(x), into_contiguous(residual));
    let (scale, next) = (into_contiguous(scale), into_contiguous(next));
    let shape = x.meta.shape().clone();
    let dim = shape[shape.num_dims() - 1];
    let rows = shape.num_elements() / dim.max(1);
    let out = dense_output(&x, Shape::new([2, rows, dim]));
    if rows == 0 {
        return out;
    }
    rms_norm_add_norm_kernel::launch(
        &x.client,
        grid(rows),
        CubeDim::new_1d(ROW_UNITS as u32),
        x.clone().into_buffer_arg(),
        scale.into_buffer_arg(),
        residual.into_buffer_arg(),
        next.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        rows,
        dim,
        1.0 / dim as f32,
        eps,
        next_eps,
        ROW_UNITS,
    );
    out
}

/// A `[heads, T, d]` input as the norm-RoPE kernel reads it: its own buffer where each head
/// vector is dense (strides `(head, row)`), else a dense copy.
fn head_rows(x: CubeTensor) -> (CubeTensor, [usize; 2]) {
    let x = if x.meta.strides()[2] == 1 {
        x
    } else {
        into_contiguous(x)
    };
    let s = x.meta.strides();
    let strides = [s[0], s[1]];
    (x, strides)
}

/// See [`super::DecodeKernels::rms_norm_rope`] and [`super::DecodeKernels::qk_norm_rope`]:
/// `x` (and `y` when given, its rows after x's) normed and rotated, `[H_x (+ H_y), T, d]`.
pub(super) fn rms_norm_rope(
    (x, scale_x, eps_x): (CubeTensor, CubeTensor, f32),
    y: Option<(CubeTensor, CubeTensor, f32)>,
    cos: CubeTensor,
    sin: CubeTensor,
) -> CubeTensor {
    f32_only(&x, "rms_norm_rope");
    let (x, sx) = head_rows(x);
    let scale_x = into_contiguous(scale_x);
    let (cos, sin) = (into_contiguous(cos), into_contiguous(sin));
    let (hx, t, d) = (x.meta.shape()[0], x.meta.shape()[1], x.meta.shape()[2]);
    // Without `y`, every row is x's: `x` stands in for the unused bindings.
    let (hy, y, sy, scale_y, eps_y) = match y {
        Some((y, scale, eps)) => {
            let (y, sy) = head_rows(y);
            assert!(
                y.meta.shape()[1] == t && y.meta.shape()[2] == d,
                "rms_norm_rope: two inputs of other rows or widths"
            );
            (y.meta.shape()[0], y, sy, into_contiguous(scale), eps)
        }
        None => (0, x.clone(), sx, scale_x.clone(), eps_x),
    };
    let rows = (hx + hy) * t;
    let out = dense_output(&x, Shape::new([hx + hy, t, d]));
    if rows == 0 {
        return out;
    }
    rms_norm_rope_kernel::launch(
        &x.client.clone(),
        grid(rows),
        CubeDim::new_1d(ROW_UNITS as u32),
        x.into_buffer_arg(),
        y.into_buffer_arg(),
        scale_x.into_buffer_arg(),
        scale_y.into_buffer_arg(),
        cos.into_buffer_arg(),
        sin.into_buffer_arg(),
        out.clone().into_buffer_arg(),
        sequence(&[rows, hx * t, t, d]),
        sequence(&[sx[0], sx[1], sy[0], sy[1]]),
        1.0 / d as f32,
        eps_x,
        eps_y,
        ROW_UNITS,
    );
    out
}

/// A kernel's `Sequence<usize>` argument.
pub(super) fn sequence(values: &[usize]) -> SequenceArg<usize> {
    let mut s = SequenceArg::new();
    for &v in values {
        s.push(v);
    }
    s
}

/// See [`super::DecodeKernels::gelu_mul_halves`].
pub(super) fn gelu_mul_halves(gu: CubeTensor) -> CubeTensor {
    f32_only(&gu, "gelu_mul_halves");
    let gu = into_contiguous(gu);
    let (rows, inner) = (gu.meta.shape()[0], gu.meta.shape()[1] / 2);
    let out = dense_output(&gu, Shape::new([rows, inner]));
    let len = rows * inner;
    if len == 0 {
        return out;
    }
    gelu_mul_halves_kernel::launch(
        &gu.client,
        grid(len.div_ceil(ELEMENT_UNITS)),
        CubeDim::new_1d(ELEMENT_UNITS as u32),
        gu.clone().into_buffer_arg(),
        out.clone().into_buffer_arg(),
        len,
        inner,
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
    let out = dense_output(&x, shape);
    if pairs == 0 {
        return out;
    }
    rope_kernel::launch(
        &x.client,
        grid(pairs.div_ceil(ELEMENT_UNITS)),
        CubeDim::new_1d(ELEMENT_UNITS as u32),
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
