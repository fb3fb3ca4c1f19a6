//! Decode kernels for the GPU devices (CUDA, wgpu): one kernel where Burn's composition of
//! tensor ops launches several, and a few-row matrix product in full f32.
//!
//! A decode step of the 270M model on an H200 launched ≈ 1 685 kernels (`docs/gpu.md`): each
//! RMSNorm was seven element-wise kernels, the tanh GELU eight, and every one-row projection
//! went through a tensor-core matmul built for many rows (≈ 43 µs each, TF32 operands). Here
//! RMSNorm and `gelu(gate)·up` are one kernel each, and products of up to
//! [`GPU_ROWS_MAX`] input rows take [`DecodeKernels::linear_rows`]: each output is a fixed-order
//! f32 sum, the same bits whatever the row count (so a verify block's rows equal the decode
//! steps they stand for in the projections, as on the CPU).
//!
//! The kernels run on Burn's CubeCL backend through a backend extension; on the CPU and under
//! autodiff the callers keep Burn's composed ops ([`applies`] says which).

#[cfg(feature = "cube")]
use burn::backend::{Dispatch, backend_extension, tensor::FloatTensor};
use burn::tensor::Tensor;

#[cfg(feature = "cube")]
mod kernels;

/// Inputs of at most this many rows take [`DecodeKernels::linear_rows`] on a GPU (decode steps,
/// verify blocks); longer ones (prefill) Burn's matmul.
pub const GPU_ROWS_MAX: usize = 16;

/// The GPU kernels, on Burn's CubeCL backend (and its fused form).
#[cfg(feature = "cube")]
#[backend_extension(Cube: cfg(feature = "cube"), Fusion: cfg(feature = "fusion"))]
pub trait DecodeKernels: burn::backend::Backend {
    /// RMSNorm over the last dimension with a stored multiplier.
    ///
    /// # Shapes
    /// - `x`: `[..., dim]`, `scale`: `[dim]` → `[..., dim]`
    #[fusion(dtype = x, shape = x)]
    fn rms_norm_rows(x: FloatTensor<Self>, scale: FloatTensor<Self>, eps: f32)
    -> FloatTensor<Self>;

    /// `gelu_tanh(gate) · up`.
    ///
    /// # Shapes
    /// - `gate`, `up`: the same shape → that shape
    #[fusion(dtype = gate, shape = gate)]
    fn gelu_mul(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Half-split RoPE ([`crate::rope::Rope::apply`]).
    ///
    /// # Shapes
    /// - `x`: `[heads, T, d]`; `cos`, `sin`: `[T, d/2]` → `[heads, T, d]`
    #[fusion(dtype = x, shape = x)]
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// `x · Wᵀ` for a few rows, full f32, each row's result independent of the row count.
    ///
    /// # Shapes
    /// - `x`: `[T, in]`, `weight`: `[out, in]` → `[T, out]`
    #[fusion(dtype = x, shape = linear_shape(x, weight))]
    fn linear_rows(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Per row, the index of its largest entry (the first on ties), as an f32 (exact for
    /// fewer than 2²⁴ columns).
    ///
    /// # Shapes
    /// - `x`: `[T, V]` → `[T]`
    #[fusion(dtype = x, shape = argmax_shape(x))]
    fn argmax_rows(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Grouped-query attention of a few rows, each over its own run of keys: row `i` sees
    /// keys `lo0 + i·dlo .. hi0 + i·dhi` (a decode step: one row; a verify block: a causal
    /// run that grows by one key a row). f32, the same bits for a row whatever `T` is.
    ///
    /// # Shapes
    /// - `q`: `[heads, T, d]`; `k`, `v`: `[kv_heads, S, d]` → `[T, heads · d]`
    #[allow(clippy::too_many_arguments)]
    #[fusion(dtype = q, shape = attention_shape(q))]
    fn attention_rows(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f32,
        lo0: usize,
        dlo: usize,
        hi0: usize,
        dhi: usize,
    ) -> FloatTensor<Self>;
}

/// The shape of `x · Wᵀ`: `[T, in]`, `[out, in]` → `[T, out]`.
#[cfg(all(feature = "cube", feature = "fusion"))]
fn linear_shape(x: &burn::tensor::Shape, weight: &burn::tensor::Shape) -> burn::tensor::Shape {
    burn::tensor::Shape::new([x[0], weight[0]])
}

/// The shape of a row-wise argmax: `[T, V]` → `[T]`.
#[cfg(all(feature = "cube", feature = "fusion"))]
fn argmax_shape(x: &burn::tensor::Shape) -> burn::tensor::Shape {
    burn::tensor::Shape::new([x[0]])
}

/// The shape of [`DecodeKernels::attention_rows`]'s output: `[heads, T, d]` → `[T, heads · d]`.
#[cfg(all(feature = "cube", feature = "fusion"))]
fn attention_shape(q: &burn::tensor::Shape) -> burn::tensor::Shape {
    burn::tensor::Shape::new([q[1], q[0] * q[2]])
}

/// Whether the GPU kernels take this tensor: it lives on a CubeCL device (CUDA, wgpu) and
/// carries no autodiff graph (training keeps Burn's differentiable ops).
pub fn applies<const D: usize>(x: &Tensor<D>) -> bool {
    #[cfg(feature = "cube")]
    {
        let device = x.device();
        !device.is_autodiff()
            && matches!(device.as_dispatch(), burn::backend::DispatchDevice::Cube(_))
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = x;
        false
    }
}

/// [`DecodeKernels::rms_norm_rows`] on tensors, or `None` where the kernels do not apply.
///
/// # Shapes
/// - `x`: `[..., dim]`, `scale`: `[dim]` → `[..., dim]`
pub fn rms_norm<const D: usize>(x: &Tensor<D>, scale: &Tensor<1>, eps: f64) -> Option<Tensor<D>> {
    #[cfg(not(feature = "cube"))]
    return {
        let _ = (x, scale, eps);
        None
    };
    #[cfg(feature = "cube")]
    applies(x).then(|| {
        let y = <Dispatch as DecodeKernels>::rms_norm_rows(
            x.clone().into_dispatch(),
            scale.clone().into_dispatch(),
            eps as f32,
        );
        Tensor::from_dispatch(y)
    })
}

/// [`DecodeKernels::gelu_mul`] on tensors, or `None` where the kernels do not apply.
///
/// # Shapes
/// - `gate`, `up`: the same shape → that shape
pub fn gelu_mul<const D: usize>(gate: &Tensor<D>, up: &Tensor<D>) -> Option<Tensor<D>> {
    #[cfg(not(feature = "cube"))]
    return {
        let _ = (gate, up);
        None
    };
    #[cfg(feature = "cube")]
    applies(gate).then(|| {
        let y = <Dispatch as DecodeKernels>::gelu_mul(
            gate.clone().into_dispatch(),
            up.clone().into_dispatch(),
        );
        Tensor::from_dispatch(y)
    })
}

/// [`DecodeKernels::rope`] on tensors, or `None` where the kernels do not apply.
///
/// # Shapes
/// - `x`: `[heads, T, d]`; `cos`, `sin`: `[T, d/2]` → `[heads, T, d]`
pub fn rope(x: &Tensor<3>, cos: &Tensor<2>, sin: &Tensor<2>) -> Option<Tensor<3>> {
    #[cfg(not(feature = "cube"))]
    return {
        let _ = (x, cos, sin);
        None
    };
    #[cfg(feature = "cube")]
    applies(x).then(|| {
        let y = <Dispatch as DecodeKernels>::rope(
            x.clone().into_dispatch(),
            cos.clone().into_dispatch(),
            sin.clone().into_dispatch(),
        );
        Tensor::from_dispatch(y)
    })
}

/// [`DecodeKernels::linear_rows`] on tensors when the kernels apply and `x` has at most
/// [`GPU_ROWS_MAX`] rows; `None` otherwise.
///
/// # Shapes
/// - `x`: `[T, in]`, `weight`: `[out, in]` → `[T, out]`
pub fn linear_rows(x: &Tensor<2>, weight: &Tensor<2>) -> Option<Tensor<2>> {
    #[cfg(not(feature = "cube"))]
    return {
        let _ = (x, weight);
        None
    };
    #[cfg(feature = "cube")]
    (x.dims()[0] <= GPU_ROWS_MAX && applies(x)).then(|| {
        let y = <Dispatch as DecodeKernels>::linear_rows(
            x.clone().into_dispatch(),
            weight.clone().into_dispatch(),
        );
        Tensor::from_dispatch(y)
    })
}

/// [`DecodeKernels::argmax_rows`] on tensors (only the `T` ids come back to the host), or `None`
/// where the kernels do not apply.
///
/// # Shapes
/// - `logits`: `[T, V]` → `T` ids
pub fn argmax_rows(logits: &Tensor<2>) -> Option<Vec<u32>> {
    #[cfg(not(feature = "cube"))]
    return {
        let _ = logits;
        None
    };
    #[cfg(feature = "cube")]
    applies(logits).then(|| {
        let ids = <Dispatch as DecodeKernels>::argmax_rows(logits.clone().into_dispatch());
        Tensor::<1>::from_dispatch(ids)
            .into_data()
            .try_into_vec::<f32>()
            .expect("argmax ids are written as f32")
            .into_iter()
            .map(|i| i as u32)
            .collect()
    })
}

/// Which keys each row of [`attention_rows`] sees: row `i` the keys `lo + i·dlo .. hi + i·dhi`
/// of the concatenated K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRuns {
    /// Row 0's first key.
    pub lo: usize,
    /// How far each further row's first key moves (0 or 1).
    pub dlo: usize,
    /// Row 0's end (exclusive).
    pub hi: usize,
    /// How far each further row's end moves (0 or 1).
    pub dhi: usize,
}

impl KeyRuns {
    /// The runs as this form when every row's keys are `ranges[i]` and they move by the same
    /// step from row to row; `None` otherwise (or with no rows).
    pub fn from_ranges(ranges: &[std::ops::Range<usize>]) -> Option<Self> {
        let first = ranges.first()?;
        let step = |a: usize, b: usize| b.checked_sub(a).filter(|d| *d <= 1);
        let (dlo, dhi) = match ranges.get(1) {
            Some(r) => (step(first.start, r.start)?, step(first.end, r.end)?),
            None => (0, 0),
        };
        let runs = Self {
            lo: first.start,
            dlo,
            hi: first.end,
            dhi,
        };
        ranges
            .iter()
            .enumerate()
            .all(|(i, r)| {
                r.start == runs.lo + i * dlo && r.end == runs.hi + i * dhi && r.start < r.end
            })
            .then_some(runs)
    }
}

/// [`DecodeKernels::attention_rows`] on tensors, or `None` where the kernels do not apply.
///
/// # Shapes
/// - `q`: `[heads, T, d]`; `k`, `v`: `[kv_heads, S, d]` → `[T, heads · d]`
pub fn attention_rows(
    q: &Tensor<3>,
    k: &Tensor<3>,
    v: &Tensor<3>,
    scale: f64,
    runs: KeyRuns,
) -> Option<Tensor<2>> {
    #[cfg(not(feature = "cube"))]
    return {
        let _ = (q, k, v, scale, runs);
        None
    };
    #[cfg(feature = "cube")]
    applies(q).then(|| {
        let y = <Dispatch as DecodeKernels>::attention_rows(
            q.clone().into_dispatch(),
            k.clone().into_dispatch(),
            v.clone().into_dispatch(),
            scale as f32,
            runs.lo,
            runs.dlo,
            runs.hi,
            runs.dhi,
        );
        Tensor::from_dispatch(y)
    })
}
