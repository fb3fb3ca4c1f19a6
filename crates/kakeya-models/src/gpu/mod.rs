//! Decode kernels for the GPU devices (CUDA, wgpu/Vulkan/Metal): one kernel where Burn's
//! composition of tensor ops launches several, few-row products and attention in full f32, and
//! the greedy argmax on the device.
//!
//! Built from Burn's generic operations, each RMSNorm is several element-wise kernels (so are
//! RoPE, the tanh GELU and softmax), every one-row projection goes through a tensor-core matmul
//! built for many rows (TF32 operands), and the argmax over the 262k-entry vocabulary is a
//! slow generic reduction (`docs/gpu.md`). Here each of these is one kernel: RMSNorm (with the residual add after it, or RoPE),
//! `gelu(gate)·up`, the argmax, a few rows' attention, and products of up to [`GPU_ROWS_MAX`]
//! input rows — q/k/v (and gate/up) in one launch. Each output of a product or of attention is
//! a fixed-order f32 sum, the same bits whatever the row count, so a verify block's rows equal
//! the decode steps they stand for there, as on the CPU.
//!
//! The kernels are a Burn backend extension (`DecodeKernels`, with the `cube` feature) on Burn's CubeCL backend; on
//! the CPU and under autodiff the callers keep Burn's composed ops ([`applies`] says which).
//! Every wrapper here returns `None` where the kernels do not apply.

#[cfg(feature = "cube")]
use burn::backend::Dispatch;
use burn::tensor::{Device, Tensor};

#[cfg(feature = "cube")]
mod argmax;
#[cfg(feature = "cube")]
mod attention;
#[cfg(feature = "cube")]
mod gather;
#[cfg(feature = "cube")]
mod kernels;
#[cfg(feature = "cube")]
mod linear;
#[cfg(feature = "cube")]
mod matmul;
#[cfg(feature = "cube")]
mod ops;
#[cfg(feature = "cube")]
mod optim;
#[cfg(feature = "cube")]
mod sample;

#[cfg(feature = "cube")]
pub use ops::DecodeKernels;

/// Inputs of at most this many rows take the few-row kernels on a GPU (decode steps, verify
/// blocks); longer ones (prefill) Burn's matmul.
pub const GPU_ROWS_MAX: usize = 16;

/// Whether the GPU kernels take this tensor: it lives on a CubeCL device (CUDA, wgpu) and
/// carries no autodiff graph (training keeps Burn's differentiable ops).
pub fn applies<const D: usize>(x: &Tensor<D>) -> bool {
    kernels_on(&x.device())
}

/// Whether the GPU kernels take tensors on `device`: a CubeCL device (CUDA, wgpu) without an
/// autodiff graph.
pub fn kernels_on(device: &Device) -> bool {
    #[cfg(feature = "cube")]
    {
        !device.is_autodiff()
            && matches!(device.as_dispatch(), burn::backend::DispatchDevice::Cube(_))
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

/// Whether `device` is a CubeCL device (CUDA, wgpu), with or without autodiff.
pub fn is_gpu(device: &Device) -> bool {
    #[cfg(feature = "cube")]
    {
        let inner = device.clone().without_autodiff();
        matches!(inner.as_dispatch(), burn::backend::DispatchDevice::Cube(_))
    }
    #[cfg(not(feature = "cube"))]
    {
        let _ = device;
        false
    }
}

/// `Some(call)` where the kernels apply (`when`), `None` elsewhere and in builds without a GPU.
macro_rules! on_gpu {
    ($when:expr, $call:expr) => {{
        #[cfg(feature = "cube")]
        let out = if $when { Some($call) } else { None };
        #[cfg(not(feature = "cube"))]
        let out = None;
        out
    }};
}

mod attend;
mod buffers;
mod graph;
mod inputs;
mod recordings;
mod update;
pub use attend::{ChunkSlots, KeyRuns, RowKeys, attention_rows, span_attention};
pub use buffers::{fits_one_buffer, max_buffer_bytes};
pub use graph::{DeviceGraph, buffer_of};
pub use inputs::{StepInputs, gather_rows};
pub use recordings::{Recorder, Recordings, ReplayStats};
pub use update::{AdamwStep, adamw, adamw_in_place};

/// RMSNorm over the last dimension ([`crate::norm::RmsNorm::forward`]).
///
/// # Shapes
/// - `x`: `[..., dim]`, `scale`: `[dim]` → `[..., dim]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn rms_norm<const D: usize>(x: &Tensor<D>, scale: &Tensor<1>, eps: f64) -> Option<Tensor<D>> {
    on_gpu!(applies(x), {
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::rms_norm_rows(
            x.clone().into_dispatch(),
            scale.clone().into_dispatch(),
            eps as f32,
        ))
    })
}

/// `residual + rms_norm(x)`.
///
/// # Shapes
/// - `x`, `residual`: `[..., dim]`, `scale`: `[dim]` → `[..., dim]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn rms_norm_add<const D: usize>(
    x: &Tensor<D>,
    scale: &Tensor<1>,
    eps: f64,
    residual: &Tensor<D>,
) -> Option<Tensor<D>> {
    on_gpu!(applies(x), {
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::rms_norm_add(
            x.clone().into_dispatch(),
            scale.clone().into_dispatch(),
            eps as f32,
            residual.clone().into_dispatch(),
        ))
    })
}

/// `h = residual + rms_norm(x)·scale`, then `rms_norm(h)·next`: `(h, its norm)`, one launch.
///
/// # Shapes
/// - `x`, `residual`: `[R, dim]`, `scale`, `next`: `[dim]` → two `[R, dim]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn rms_norm_add_norm(
    x: &Tensor<2>,
    (scale, eps): (&Tensor<1>, f64),
    residual: &Tensor<2>,
    (next, next_eps): (&Tensor<1>, f64),
) -> Option<(Tensor<2>, Tensor<2>)> {
    on_gpu!(applies(x), {
        let both: Tensor<3> =
            Tensor::from_dispatch(<Dispatch as DecodeKernels>::rms_norm_add_norm(
                x.clone().into_dispatch(),
                scale.clone().into_dispatch(),
                eps as f32,
                residual.clone().into_dispatch(),
                next.clone().into_dispatch(),
                next_eps as f32,
            ));
        let [r, dim] = x.dims();
        let plane = |i: usize| {
            both.clone()
                .slice([i..i + 1, 0..r, 0..dim])
                .reshape([r, dim])
        };
        (plane(0), plane(1))
    })
}

/// RMSNorm over each head vector, then half-split RoPE.
///
/// # Shapes
/// - `x`: `[heads, T, d]`, `scale`: `[d]`; `cos`, `sin`: `[T, d/2]` → `[heads, T, d]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn rms_norm_rope(
    x: &Tensor<3>,
    scale: &Tensor<1>,
    eps: f64,
    cos: &Tensor<2>,
    sin: &Tensor<2>,
) -> Option<Tensor<3>> {
    on_gpu!(applies(x), {
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::rms_norm_rope(
            x.clone().into_dispatch(),
            scale.clone().into_dispatch(),
            eps as f32,
            cos.clone().into_dispatch(),
            sin.clone().into_dispatch(),
        ))
    })
}

/// Queries and keys each through its RMSNorm, then RoPE, in one launch (the heads-first views
/// of the joint projection's columns read in place): `(q, k)`, the same bits as
/// [`rms_norm_rope`] of each.
///
/// # Shapes
/// - `q`: `[heads, T, d]`, `k`: `[kv_heads, T, d]`; `cos`, `sin`: `[T, d/2]` → the two shapes
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn qk_norm_rope(
    (q, q_scale, q_eps): (&Tensor<3>, &Tensor<1>, f64),
    (k, k_scale, k_eps): (&Tensor<3>, &Tensor<1>, f64),
    cos: &Tensor<2>,
    sin: &Tensor<2>,
) -> Option<(Tensor<3>, Tensor<3>)> {
    on_gpu!(applies(q), {
        let both: Tensor<3> = Tensor::from_dispatch(<Dispatch as DecodeKernels>::qk_norm_rope(
            q.clone().into_dispatch(),
            q_scale.clone().into_dispatch(),
            q_eps as f32,
            k.clone().into_dispatch(),
            k_scale.clone().into_dispatch(),
            k_eps as f32,
            cos.clone().into_dispatch(),
            sin.clone().into_dispatch(),
        ));
        let ([hq, t, d], hk) = (q.dims(), k.dims()[0]);
        (
            both.clone().slice([0..hq, 0..t, 0..d]),
            both.slice([hq..hq + hk, 0..t, 0..d]),
        )
    })
}

/// Half-split RoPE ([`crate::rope::Rope::apply`]).
///
/// # Shapes
/// - `x`: `[heads, T, d]`; `cos`, `sin`: `[T, d/2]` → `[heads, T, d]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn rope(x: &Tensor<3>, cos: &Tensor<2>, sin: &Tensor<2>) -> Option<Tensor<3>> {
    on_gpu!(applies(x), {
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::rope(
            x.clone().into_dispatch(),
            cos.clone().into_dispatch(),
            sin.clone().into_dispatch(),
        ))
    })
}

/// `gelu_tanh(gate) · up` with the gate columns first, then up's.
///
/// # Shapes
/// - `gu`: `[T, 2·I]` → `[T, I]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn gelu_mul_halves(gu: &Tensor<2>) -> Option<Tensor<2>> {
    on_gpu!(applies(gu), {
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::gelu_mul_halves(
            gu.clone().into_dispatch(),
        ))
    })
}

/// `x · Wᵀ` for each of 1 to 3 weights reading the same input, their outputs side by side,
/// when `x` has at most [`GPU_ROWS_MAX`] rows.
///
/// # Shapes
/// - `x`: `[T, in]`, each weight `[out_i, in]` → `[T, out_0 + …]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn linear_rows(x: &Tensor<2>, weights: &[&Tensor<2>]) -> Option<Tensor<2>> {
    assert!(
        (1..=3).contains(&weights.len()),
        "linear_rows: 1 to 3 weights"
    );
    on_gpu!(x.dims()[0] <= GPU_ROWS_MAX && applies(x), {
        // Unused slots repeat the first weight; the kernel reads only `parts` of them.
        let w = |i: usize| {
            (*weights.get(i).unwrap_or(&weights[0]))
                .clone()
                .into_dispatch()
        };
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::linear_rows(
            x.clone().into_dispatch(),
            w(0),
            w(1),
            w(2),
            weights.len(),
        ))
    })
}

/// `a · b` in f32: on a GPU with f32 operands and sums throughout (Burn's CUDA matmul stages
/// f32 as TF32 — unless `KAKEYA_GPU_TF32=1` asks for that speed), elsewhere Burn's matmul.
/// Prefill's products and its chunked attention go through here.
///
/// # Shapes
/// - `a`: `[..., m, k]`, `b`: `[..., k, n]` (batch dims equal) → `[..., m, n]`
pub fn matmul<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    let exact = on_gpu!(applies(&a) && !tf32_allowed(), {
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::matmul_f32(
            a.clone().into_dispatch(),
            b.clone().into_dispatch(),
        ))
    });
    match exact {
        Some(y) => y,
        None => a.matmul(b),
    }
}

/// `KAKEYA_GPU_TF32=1`: products of many rows on a GPU take Burn's tensor-core matmul (TF32
/// operands on CUDA: faster prefill, logits ≈ 1e-2 off f32), as PyTorch's `allow_tf32`.
#[cfg(feature = "cube")]
fn tf32_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("KAKEYA_GPU_TF32").is_ok_and(|v| v == "1"))
}

/// `src` copied into `dst`'s buffer in place (dense, one size), whoever else holds it: a
/// buffer a recorded graph reads, rewritten. `Some(())` where the kernels apply and write in
/// place.
///
/// # Shapes
/// - `dst`, `src`: `[...]` (one size)
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn copy_into<const D: usize, const E: usize>(dst: &Tensor<D>, src: &Tensor<E>) -> Option<()> {
    on_gpu!(writes_in_place(dst), {
        let _ = <Dispatch as DecodeKernels>::copy_into(
            dst.clone().into_dispatch(),
            src.clone().into_dispatch(),
        );
    })
}

/// `src`'s rows written into `dst`'s buffer in place (dense), whoever else holds it, from row
/// `idx[at]` on, an index read on the device (rows past `dst`'s end are dropped): the rows a
/// recorded step appends where each replay is told. `Some(())` where the kernels apply and
/// write in place.
///
/// # Shapes
/// - `dst`: `[rows, w]`, `src`: `[n, w]`, `idx`: `[> at]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn put_rows(dst: &Tensor<2>, src: &Tensor<2>, idx: &Tensor<1>, at: usize) -> Option<()> {
    on_gpu!(writes_in_place(dst), {
        let _ = <Dispatch as DecodeKernels>::put_rows(
            dst.clone().into_dispatch(),
            src.clone().into_dispatch(),
            idx.clone().into_dispatch(),
            at,
        );
    })
}

/// Per row, the index of its largest entry (the first on ties); only the `T` ids come back
/// to the host.
///
/// # Shapes
/// - `logits`: `[T, V]` → `T` ids
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn argmax_rows(logits: &Tensor<2>) -> Option<Vec<u32>> {
    argmax_on_device(logits).map(|ids| {
        ids.into_data()
            .try_into_vec::<f32>()
            .expect("argmax ids are written as f32")
            .into_iter()
            .map(|i| i as u32)
            .collect()
    })
}

/// [`argmax_rows`] left on the device: each row's index as an f32 (exact below 2²⁴).
///
/// # Shapes
/// - `logits`: `[T, V]` → `[T]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn argmax_on_device(logits: &Tensor<2>) -> Option<Tensor<1>> {
    on_gpu!(applies(logits), {
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::argmax_rows(
            logits.clone().into_dispatch(),
        ))
    })
}

/// Per row of `logits`, the token drawn from `softmax(row / temperature)` cut to the `top_k`
/// most likely tokens (0: all), then to the shortest most-likely-first prefix holding `top_p`
/// of their mass (1: all), by inverse CDF at `uniforms[row]` times the kept mass — in token-id
/// order without a cut, most likely first (then the lower id) with one: the host sampler's
/// rule, in f32 where the host sums in f64 — so only the `T` ids come back to the host. `None`
/// off a GPU.
///
/// # Shapes
/// - `logits`: `[T, V]`, `uniforms`: `T` values in `[0, 1)` → `T` ids
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn sample_rows(
    logits: &Tensor<2>,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    uniforms: &[f32],
) -> Option<Vec<u32>> {
    assert_eq!(logits.dims()[0], uniforms.len(), "one uniform per row");
    if !applies(logits) {
        return None;
    }
    let u = Tensor::<1>::from_data(
        burn::tensor::TensorData::new(uniforms.to_vec(), [uniforms.len()]),
        &logits.device(),
    );
    let ids = sample_on_device(logits, temperature, top_k, top_p, u)?;
    Some(
        ids.into_data()
            .try_into_vec::<f32>()
            .expect("sampled ids are written as f32")
            .into_iter()
            .map(|i| i as u32)
            .collect(),
    )
}

/// [`sample_rows`] with the uniforms on the device and the ids left there, as f32 (exact
/// below 2²⁴).
///
/// # Shapes
/// - `logits`: `[T, V]`, `uniforms`: `[T]` → `[T]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn sample_on_device(
    logits: &Tensor<2>,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    uniforms: Tensor<1>,
) -> Option<Tensor<1>> {
    assert!(temperature > 0.0, "sampling needs a temperature above 0");
    on_gpu!(applies(logits), {
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::sample_rows(
            logits.clone().into_dispatch(),
            uniforms.into_dispatch(),
            temperature,
            top_k,
            top_p.min(1.0),
        ))
    })
}

/// Whether [`span_attention`] runs for tensors like `x`: the kernels apply and Burn's fusion
/// is off.
pub fn writes_in_place<const D: usize>(x: &Tensor<D>) -> bool {
    !cfg!(feature = "fusion") && applies(x)
}

/// `x` itself where nothing else holds its buffer and it is dense, else a dense copy (on a
/// GPU; elsewhere `x`): a cache buffer [`span_attention`] may write in place.
///
/// # Shapes
/// - `x`: `[...]` → `[...]`
pub fn unique_dense<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !writes_in_place(&x) {
        return x;
    }
    // `x` moves in: a clone would hold the buffer too and always be copied.
    #[cfg(feature = "cube")]
    let x = Tensor::from_dispatch(<Dispatch as DecodeKernels>::unique_dense(x.into_dispatch()));
    x
}

/// `x` where its rows are dense, else a dense copy (on a GPU; elsewhere `x`): an input read
/// by several launches, made dense once.
///
/// # Shapes
/// - `x`: `[...]` → `[...]`
pub fn dense<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    if !applies(&x) {
        return x;
    }
    #[cfg(feature = "cube")]
    let x = Tensor::from_dispatch(<Dispatch as DecodeKernels>::dense(x.into_dispatch()));
    x
}
