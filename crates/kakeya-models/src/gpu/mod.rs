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
}

/// The shape of `x · Wᵀ`: `[T, in]`, `[out, in]` → `[T, out]`.
#[cfg(all(feature = "cube", feature = "fusion"))]
fn linear_shape(x: &burn::tensor::Shape, weight: &burn::tensor::Shape) -> burn::tensor::Shape {
    burn::tensor::Shape::new([x[0], weight[0]])
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
