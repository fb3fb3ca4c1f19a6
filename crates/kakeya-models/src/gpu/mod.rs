//! Decode kernels for the GPU devices (CUDA, wgpu/Vulkan/Metal): one kernel where Burn's
//! composition of tensor ops launches several, few-row products and attention in full f32, and
//! the greedy argmax on the device.
//!
//! A decode step of the 270M model launched ≈ 1 685 kernels on an H200 (`docs/gpu.md`): each
//! RMSNorm was seven element-wise kernels, RoPE eight, the tanh GELU eight, softmax five, and
//! every one-row projection went through a tensor-core matmul built for many rows (TF32
//! operands); the argmax over the 262k-entry vocabulary took Burn's reduction ≈ 9.6 ms on an
//! H100. Here each of these is one kernel: RMSNorm (with the residual add after it, or RoPE),
//! `gelu(gate)·up`, the argmax, a few rows' attention, and products of up to [`GPU_ROWS_MAX`]
//! input rows — q/k/v (and gate/up) in one launch. Each output of a product or of attention is
//! a fixed-order f32 sum, the same bits whatever the row count, so a verify block's rows equal
//! the decode steps they stand for there, as on the CPU.
//!
//! The kernels are a Burn backend extension ([`DecodeKernels`]) on Burn's CubeCL backend; on
//! the CPU and under autodiff the callers keep Burn's composed ops ([`applies`] says which).
//! Every wrapper here returns `None` where the kernels do not apply.

#[cfg(feature = "cube")]
use burn::backend::Dispatch;
use burn::tensor::{Device, Tensor};

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

mod buffers;
mod graph;
mod inputs;
mod recordings;
mod update;
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
    /// The runs in this form when every row's keys are `ranges[i]` and they move by the same
    /// step from row to row; `None` otherwise (or with no rows, or an empty range).
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

/// The keys each row of [`attention_rows`] sees, as indices into the concatenated K/V in
/// position order.
#[derive(Debug, Clone, Copy)]
pub enum RowKeys<'a> {
    /// Runs moving in step ([`KeyRuns`]): nothing to upload.
    Runs(KeyRuns),
    /// Any keys, listed per row (uploaded with the call).
    Lists(&'a [Vec<usize>]),
}

/// Grouped-query attention of a few rows over the keys each row sees.
///
/// # Shapes
/// - `q`: `[heads, T, d]`; `k`, `v`: `[kv_heads, S, d]` → `[T, heads · d]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn attention_rows(
    q: &Tensor<3>,
    k: &Tensor<3>,
    v: &Tensor<3>,
    scale: f64,
    keys: RowKeys<'_>,
) -> Option<Tensor<2>> {
    on_gpu!(applies(q), {
        let (runs, ids) = match keys {
            RowKeys::Runs(r) => ([r.lo, r.dlo, r.hi, r.dhi], None),
            RowKeys::Lists(lists) => ([0; 4], Some(key_lists(lists, &q.device()))),
        };
        let indexed = ids.is_some();
        // Without lists the kernel reads none: `q` stands in for the unused binding.
        let ids = ids.map_or_else(|| q.clone().into_dispatch(), |t| t.into_dispatch());
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::attention_rows(
            q.clone().into_dispatch(),
            k.clone().into_dispatch(),
            v.clone().into_dispatch(),
            ids,
            scale as f32,
            runs[0],
            runs[1],
            runs[2],
            runs[3],
            indexed,
        ))
    })
}

/// Where one sequence's chunk sits in a stacked forward and how its cache maps positions to
/// slots ([`span_attention`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSlots {
    /// The chunk's first row of the stacked input.
    pub row0: usize,
    /// Its rows.
    pub t: usize,
    /// Position of its first row.
    pub start: usize,
    /// Position `p` lives in slot `(p − origin) % modulus` of the cache.
    pub origin: usize,
    /// See `origin`.
    pub modulus: usize,
    /// The layer's sliding window; 0 for full attention.
    pub window: usize,
}

/// One sequence's chunk of a stacked forward in one launch: its rows of `k_new`/`v_new`
/// written into the cache buffers `cache` in place, and its rows' attention (each over the
/// positions it sees, up to its own) written into rows `row0..row0 + t` of `out` (`None`: a
/// new output; later chunks of the forward pass it back). The cache buffers must come from
/// [`unique_dense`]. The kernel reads the chunk's first position from `positions` (the
/// stacked rows' positions from index `first`, as the forward uploaded them: see
/// [`StepInputs`]); `at.start` checks the launch. A row's bits equal [`attention_rows`]' over
/// the same keys. `None` off a GPU and with Burn's fusion (whose lazy graph does not see the
/// in-place writes).
///
/// # Shapes
/// - `q`: `[heads, R, d]`; `k_new`, `v_new`: `[kv_heads, R, d]`; `cache`: two
///   `[kv_heads, slots, d]`; `positions.0`: `[n ≥ first + R]` → `[R, heads · d]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
#[allow(clippy::too_many_arguments)]
pub fn span_attention(
    q: &Tensor<3>,
    k_new: &Tensor<3>,
    v_new: &Tensor<3>,
    cache: (&Tensor<3>, &Tensor<3>),
    positions: (&Tensor<1>, usize),
    out: Option<Tensor<2>>,
    scale: f64,
    at: ChunkSlots,
) -> Option<Tensor<2>> {
    on_gpu!(writes_in_place(q), {
        let fresh = out.is_none();
        // A fresh output reads nothing: `q` stands in for the unused binding.
        let out = out.map_or_else(|| q.clone().into_dispatch(), |o| o.into_dispatch());
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::span_attention(
            q.clone().into_dispatch(),
            k_new.clone().into_dispatch(),
            v_new.clone().into_dispatch(),
            cache.0.clone().into_dispatch(),
            cache.1.clone().into_dispatch(),
            positions.0.clone().into_dispatch(),
            positions.1,
            out,
            fresh,
            scale as f32,
            at.row0,
            at.t,
            at.start,
            at.origin,
            at.modulus,
            at.window,
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

/// Per row its key count, then its key indices, padded to the longest row, as f32 (exact:
/// indices stay far below 2²⁴).
///
/// # Shapes
/// - → `[T, 1 + max count]`
#[cfg(feature = "cube")]
fn key_lists(lists: &[Vec<usize>], device: &burn::tensor::Device) -> Tensor<2> {
    let width = lists.iter().map(Vec::len).max().unwrap_or(0);
    let mut data = vec![0.0f32; lists.len() * (width + 1)];
    for (row, keys) in data.chunks_exact_mut(width + 1).zip(lists) {
        assert!(keys.iter().all(|&k| k < 1 << 24), "key index past 2^24");
        row[0] = keys.len() as f32;
        row[1..=keys.len()]
            .iter_mut()
            .zip(keys)
            .for_each(|(r, &k)| *r = k as f32);
    }
    Tensor::from_data(
        burn::tensor::TensorData::new(data, [lists.len(), width + 1]),
        device,
    )
}
