//! [`DecodeKernels`]: the GPU kernels as a Burn backend extension, implemented on Burn's CubeCL
//! backend (and through it on its fused form, each call one opaque operation).

use burn::backend::{backend_extension, tensor::FloatTensor};
#[cfg(feature = "fusion")]
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;

use super::{argmax, attention, gather, kernels, linear, matmul, optim, sample};

/// The GPU kernels, on Burn's CubeCL backend (and its fused form).
#[backend_extension(Cube: cfg(feature = "cube"), Fusion: cfg(feature = "fusion"))]
pub trait DecodeKernels: burn::backend::Backend {
    /// RMSNorm over the last dimension with a stored multiplier.
    ///
    /// # Shapes
    /// - `x`: `[..., dim]`, `scale`: `[dim]` → `[..., dim]`
    #[fusion(dtype = x, shape = x)]
    fn rms_norm_rows(x: FloatTensor<Self>, scale: FloatTensor<Self>, eps: f32)
    -> FloatTensor<Self>;

    /// `residual + rms_norm(x)` (a sublayer's output normed onto the residual stream).
    ///
    /// # Shapes
    /// - `x`, `residual`: `[..., dim]`, `scale`: `[dim]` → `[..., dim]`
    #[fusion(dtype = x, shape = x)]
    fn rms_norm_add(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        eps: f32,
        residual: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// `h = residual + rms_norm(x)` with `scale` (a sublayer's output onto the residual
    /// stream), then `rms_norm(h)` with `next` (the next sublayer's input), stacked.
    ///
    /// # Shapes
    /// - `x`, `residual`: `[R, dim]`, `scale`, `next`: `[dim]` → `[2, R, dim]` (`h`, its norm)
    #[fusion(dtype = x, shape = Shape::new([2, x[0], x[1]]))]
    fn rms_norm_add_norm(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        eps: f32,
        residual: FloatTensor<Self>,
        next: FloatTensor<Self>,
        next_eps: f32,
    ) -> FloatTensor<Self>;

    /// [`Self::rms_norm_rope`] of queries and keys in one launch, each with its own norm:
    /// the queries' rows, then the keys'.
    ///
    /// # Shapes
    /// - `q`: `[heads, T, d]`, `k`: `[kv_heads, T, d]`, `q_scale`, `k_scale`: `[d]`; `cos`,
    ///   `sin`: `[T, d/2]` → `[heads + kv_heads, T, d]`
    #[allow(clippy::too_many_arguments)]
    #[fusion(dtype = q, shape = Shape::new([q[0] + k[0], q[1], q[2]]))]
    fn qk_norm_rope(
        q: FloatTensor<Self>,
        q_scale: FloatTensor<Self>,
        q_eps: f32,
        k: FloatTensor<Self>,
        k_scale: FloatTensor<Self>,
        k_eps: f32,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// RMSNorm over each head vector, then half-split RoPE (a query or key norm and its
    /// rotation).
    ///
    /// # Shapes
    /// - `x`: `[heads, T, d]`, `scale`: `[d]`; `cos`, `sin`: `[T, d/2]` → `[heads, T, d]`
    #[fusion(dtype = x, shape = x)]
    fn rms_norm_rope(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        eps: f32,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

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

    /// `gelu_tanh(gate) · up` with `gate` and `up` side by side in one tensor.
    ///
    /// # Shapes
    /// - `gu`: `[T, 2·I]` (gate columns, then up) → `[T, I]`
    #[fusion(dtype = gu, shape = half_width(gu))]
    fn gelu_mul_halves(gu: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `x · [W0; W1; W2]ᵀ` for a few rows over the first `parts` weights (their outputs side by
    /// side), full f32, each row's result independent of the row count.
    ///
    /// # Shapes
    /// - `x`: `[T, in]`, `wi`: `[out_i, in]` → `[T, out_0 + …]`
    #[fusion(dtype = x, shape = linear_shape(x, w0, w1, w2, parts))]
    fn linear_rows(
        x: FloatTensor<Self>,
        w0: FloatTensor<Self>,
        w1: FloatTensor<Self>,
        w2: FloatTensor<Self>,
        parts: usize,
    ) -> FloatTensor<Self>;

    /// Per row, the index of its largest entry (the first on ties), as an f32 (exact for
    /// fewer than 2²⁴ columns).
    ///
    /// # Shapes
    /// - `x`: `[T, V]` → `[T]`
    #[fusion(dtype = x, shape = Shape::new([x[0]]))]
    fn argmax_rows(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// Per row, the token drawn from `softmax(x / temperature)` cut to the `top_k` most likely
    /// tokens (0: all) and then to the shortest most-likely-first prefix holding `top_p` of
    /// their mass, by inverse CDF at `u[row]` times the kept mass — in id order without a cut,
    /// most likely first with one (the host sampler's rule, in f32) — as an f32 (exact for
    /// fewer than 2²⁴ columns).
    ///
    /// # Shapes
    /// - `x`: `[T, V]`, `u`: `[T]` → `[T]`
    #[fusion(dtype = x, shape = Shape::new([x[0]]))]
    fn sample_rows(
        x: FloatTensor<Self>,
        u: FloatTensor<Self>,
        temperature: f32,
        top_k: usize,
        top_p: f32,
    ) -> FloatTensor<Self>;

    /// Grouped-query attention of a few rows, each over its own keys: row `i` sees keys
    /// `lo0 + i·dlo .. hi0 + i·dhi` (a decode step: one row; a verify block: a causal run that
    /// grows by one key a row), or, when `indexed`, the keys listed in `ids` (row `i`: its
    /// count, then its key indices, as f32). f32, the same bits for a row whatever `T` is and
    /// whichever form names its keys.
    ///
    /// # Shapes
    /// - `q`: `[heads, T, d]`; `k`, `v`: `[kv_heads, S, d]`; `ids`: `[T, 1 + width]` (read
    ///   only when `indexed`) → `[T, heads · d]`
    /// `lhs · rhs` with f32 operands and f32 sums throughout (no TF32 staging): Burn's
    /// batched matmul semantics, batch dims equal.
    ///
    /// # Shapes
    /// - `lhs`: `[..., m, k]`, `rhs`: `[..., k, n]` → `[..., m, n]`
    #[fusion(dtype = lhs, shape = matmul_shape(lhs, rhs))]
    fn matmul_f32(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self>;

    /// One AdamW update of a parameter `p` with gradient `g · scale[0]` and moments `m`, `v`
    /// (bias corrections `bias1`, `bias2` of the step; `lr_decay` = lr · weight decay, 0 for
    /// none), in the composed update's order: the new parameter, first and second moments
    /// stacked.
    ///
    /// # Shapes
    /// - `p`, `g`, `m`, `v`: `[...]` (one shape), `scale`: `[1]` → `[3, ...]`
    #[allow(clippy::too_many_arguments)]
    #[fusion(dtype = p, shape = three_planes(p))]
    fn adamw(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        beta1: f32,
        one_minus_beta1: f32,
        beta2: f32,
        one_minus_beta2: f32,
        eps: f32,
        lr: f32,
        bias1: f32,
        bias2: f32,
        lr_decay: f32,
    ) -> FloatTensor<Self>;

    /// [`Self::adamw`] written back into `p`, `m` and `v` (dense buffers the caller owns,
    /// written in place whoever else holds them), with the step's learning rate, bias
    /// corrections and `lr · weight decay` read from `hyper` (`[4]`); `decay` false: none for
    /// this tensor. Returns `p`.
    ///
    /// # Shapes
    /// - `p`, `g`, `m`, `v`: `[...]` (one shape), `scale`: `[1]`, `hyper`: `[4]` → `p`
    #[allow(clippy::too_many_arguments)]
    #[fusion(dtype = p, shape = p)]
    fn adamw_in_place(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        hyper: FloatTensor<Self>,
        beta1: f32,
        one_minus_beta1: f32,
        beta2: f32,
        one_minus_beta2: f32,
        eps: f32,
        decay: bool,
    ) -> FloatTensor<Self>;

    #[allow(clippy::too_many_arguments)]
    #[fusion(dtype = q, shape = Shape::new([q[1], q[0] * q[2]]))]
    fn attention_rows(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        ids: FloatTensor<Self>,
        scale: f32,
        lo0: usize,
        dlo: usize,
        hi0: usize,
        dhi: usize,
        indexed: bool,
    ) -> FloatTensor<Self>;

    /// One sequence's chunk of a stacked forward: its rows' K/V (`k_new`, `v_new` rows
    /// `row0..row0 + t`, positions `start..`) written into the cache buffers `cache_k`,
    /// `cache_v` in place (slot of position `p`: `(p − origin) % modulus`), and their attention
    /// over every position each row sees (`window` 0: all before it) into rows `row0..row0 + t`
    /// of `out`, in place (`fresh`: a new output, `out` unread). The kernel reads `start` from
    /// `positions[first + row0]` (the stacked rows' positions from `first`, as f32); the host's
    /// `start` only checks the launch. The caches must be dense and held by nobody else
    /// ([`Self::unique_dense`]). A row's bits equal [`Self::attention_rows`]' over the same
    /// keys.
    ///
    /// # Shapes
    /// - `q`: `[heads, R, d]`; `k_new`, `v_new`: `[kv_heads, R, d]`; `cache_k`, `cache_v`:
    ///   `[kv_heads, slots, d]`; `positions`: `[n ≥ first + R]` → `out`: `[R, heads · d]`
    #[allow(clippy::too_many_arguments)]
    #[fusion(dtype = q, shape = Shape::new([q[1], q[0] * q[2]]))]
    fn span_attention(
        q: FloatTensor<Self>,
        k_new: FloatTensor<Self>,
        v_new: FloatTensor<Self>,
        cache_k: FloatTensor<Self>,
        cache_v: FloatTensor<Self>,
        positions: FloatTensor<Self>,
        first: usize,
        out: FloatTensor<Self>,
        fresh: bool,
        scale: f32,
        row0: usize,
        t: usize,
        start: usize,
        origin: usize,
        modulus: usize,
        window: usize,
    ) -> FloatTensor<Self>;

    /// `x` when nothing else holds its buffer and it is dense, else a dense copy: a buffer a
    /// kernel may write in place.
    ///
    /// # Shapes
    /// - `x`: `[...]` → `[...]`
    #[fusion(dtype = x, shape = x)]
    fn unique_dense(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `x` where its rows are dense, else a dense copy.
    ///
    /// # Shapes
    /// - `x`: `[...]` → `[...]`
    #[fusion(dtype = x, shape = x)]
    fn dense(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `src` copied into `dst`'s dense buffer in place, whoever else holds it; returns `dst`.
    ///
    /// # Shapes
    /// - `dst`, `src`: `[...]` (one size) → `dst`
    #[fusion(dtype = dst, shape = dst)]
    fn copy_into(dst: FloatTensor<Self>, src: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `src`'s rows written into `dst`'s dense buffer in place (whoever else holds it) from
    /// row `idx[at]` on (f32, exact below 2²⁴, read on the device); rows past `dst`'s end are
    /// dropped. Returns `dst`.
    ///
    /// # Shapes
    /// - `dst`: `[rows, w]`, `src`: `[n, w]`, `idx`: `[> at]` → `dst`
    #[fusion(dtype = dst, shape = dst)]
    fn put_rows(
        dst: FloatTensor<Self>,
        src: FloatTensor<Self>,
        idx: FloatTensor<Self>,
        at: usize,
    ) -> FloatTensor<Self>;

    /// Rows of `table` (of each of its planes) picked by the `t` indices `idx[offset..]` (f32,
    /// exact below 2²⁴), each multiplied by `scale`. The table holds the rows `first..` of a
    /// larger one (a block of it); an index outside them gives a row of zeros.
    ///
    /// # Shapes
    /// - `table`: `[rows, w]` or `[planes, rows, w]`, `idx`: `[n]` → `[t, w]` or
    ///   `[planes, t, w]`
    #[fusion(dtype = table, shape = gathered(table, t))]
    fn gather_rows(
        table: FloatTensor<Self>,
        idx: FloatTensor<Self>,
        offset: usize,
        t: usize,
        scale: f32,
        first: usize,
    ) -> FloatTensor<Self>;
}

/// `[rows, w]` → `[t, w]`; `[planes, rows, w]` → `[planes, t, w]`.
#[cfg(feature = "fusion")]
fn gathered(table: &Shape, t: &usize) -> Shape {
    let mut dims = dims_of(table);
    let n = dims.len();
    dims[n - 2] = *t;
    Shape::from(dims)
}

/// `[T, 2·I]` → `[T, I]`.
#[cfg(feature = "fusion")]
fn half_width(gu: &Shape) -> Shape {
    Shape::new([gu[0], gu[1] / 2])
}

/// `[T, in]` and the first `parts` of `[out_i, in]` → `[T, Σ out_i]`.
#[cfg(feature = "fusion")]
fn linear_shape(x: &Shape, w0: &Shape, w1: &Shape, w2: &Shape, parts: &usize) -> Shape {
    let out: usize = [w0, w1, w2].iter().take(*parts).map(|w| w[0]).sum();
    Shape::new([x[0], out])
}

/// `[..., m, k]` and `[..., k, n]` → `[..., m, n]`.
#[cfg(feature = "fusion")]
fn matmul_shape(lhs: &Shape, rhs: &Shape) -> Shape {
    let mut dims = dims_of(lhs);
    let last = dims.len() - 1;
    dims[last] = rhs[rhs.num_dims() - 1];
    Shape::from(dims)
}

/// `[...]` → `[3, ...]`.
#[cfg(feature = "fusion")]
fn three_planes(p: &Shape) -> Shape {
    Shape::from([vec![3], dims_of(p)].concat())
}

/// A shape's dimensions.
#[cfg(feature = "fusion")]
fn dims_of(s: &Shape) -> Vec<usize> {
    (0..s.num_dims()).map(|i| s[i]).collect()
}

impl DecodeKernels for CubeBackend {
    fn rms_norm_rows(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        eps: f32,
    ) -> FloatTensor<Self> {
        kernels::rms_norm(x, scale, eps, None)
    }

    fn rms_norm_add(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        eps: f32,
        residual: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        kernels::rms_norm(x, scale, eps, Some(residual))
    }

    fn rms_norm_add_norm(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        eps: f32,
        residual: FloatTensor<Self>,
        next: FloatTensor<Self>,
        next_eps: f32,
    ) -> FloatTensor<Self> {
        kernels::rms_norm_add_norm(x, scale, (eps, next_eps), residual, next)
    }

    fn rms_norm_rope(
        x: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        eps: f32,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        kernels::rms_norm_rope((x, scale, eps), None, cos, sin)
    }

    fn qk_norm_rope(
        q: FloatTensor<Self>,
        q_scale: FloatTensor<Self>,
        q_eps: f32,
        k: FloatTensor<Self>,
        k_scale: FloatTensor<Self>,
        k_eps: f32,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        kernels::rms_norm_rope((q, q_scale, q_eps), Some((k, k_scale, k_eps)), cos, sin)
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        kernels::rope(x, cos, sin)
    }

    fn gelu_mul_halves(gu: FloatTensor<Self>) -> FloatTensor<Self> {
        kernels::gelu_mul_halves(gu)
    }

    fn linear_rows(
        x: FloatTensor<Self>,
        w0: FloatTensor<Self>,
        w1: FloatTensor<Self>,
        w2: FloatTensor<Self>,
        parts: usize,
    ) -> FloatTensor<Self> {
        linear::linear_rows(x, [w0, w1, w2], parts)
    }

    fn argmax_rows(x: FloatTensor<Self>) -> FloatTensor<Self> {
        argmax::argmax_rows(x)
    }

    fn sample_rows(
        x: FloatTensor<Self>,
        u: FloatTensor<Self>,
        temperature: f32,
        top_k: usize,
        top_p: f32,
    ) -> FloatTensor<Self> {
        sample::sample_rows(x, u, temperature, top_k, top_p)
    }

    fn adamw(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        beta1: f32,
        one_minus_beta1: f32,
        beta2: f32,
        one_minus_beta2: f32,
        eps: f32,
        lr: f32,
        bias1: f32,
        bias2: f32,
        lr_decay: f32,
    ) -> FloatTensor<Self> {
        let h = optim::Scalars {
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            eps,
            lr,
            bias1,
            bias2,
            lr_decay,
        };
        optim::adamw(p, g, scale, m, v, h)
    }

    fn matmul_f32(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        matmul::matmul_f32(lhs, rhs)
    }

    fn attention_rows(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        ids: FloatTensor<Self>,
        scale: f32,
        lo0: usize,
        dlo: usize,
        hi0: usize,
        dhi: usize,
        indexed: bool,
    ) -> FloatTensor<Self> {
        let ids = indexed.then_some(ids);
        attention::attention_rows(q, k, v, scale, [lo0, dlo, hi0, dhi], ids)
    }

    fn span_attention(
        q: FloatTensor<Self>,
        k_new: FloatTensor<Self>,
        v_new: FloatTensor<Self>,
        cache_k: FloatTensor<Self>,
        cache_v: FloatTensor<Self>,
        positions: FloatTensor<Self>,
        first: usize,
        out: FloatTensor<Self>,
        fresh: bool,
        scale: f32,
        row0: usize,
        t: usize,
        start: usize,
        origin: usize,
        modulus: usize,
        window: usize,
    ) -> FloatTensor<Self> {
        let at = super::ChunkSlots {
            row0,
            t,
            start,
            origin,
            modulus,
            window,
        };
        let out = (!fresh).then_some(out);
        attention::span_attention(
            q,
            k_new,
            v_new,
            cache_k,
            cache_v,
            (positions, first),
            out,
            scale,
            at,
        )
    }

    fn unique_dense(x: FloatTensor<Self>) -> FloatTensor<Self> {
        attention::unique_dense(x)
    }

    fn dense(x: FloatTensor<Self>) -> FloatTensor<Self> {
        burn_cubecl::kernel::into_contiguous(x)
    }

    fn copy_into(dst: FloatTensor<Self>, src: FloatTensor<Self>) -> FloatTensor<Self> {
        attention::copy_into(dst, src)
    }

    fn gather_rows(
        table: FloatTensor<Self>,
        idx: FloatTensor<Self>,
        offset: usize,
        t: usize,
        scale: f32,
        first: usize,
    ) -> FloatTensor<Self> {
        gather::gather_rows(table, idx, offset, t, scale, first)
    }

    fn put_rows(
        dst: FloatTensor<Self>,
        src: FloatTensor<Self>,
        idx: FloatTensor<Self>,
        at: usize,
    ) -> FloatTensor<Self> {
        gather::put_rows(dst, src, idx, at)
    }

    #[allow(clippy::too_many_arguments)]
    fn adamw_in_place(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        scale: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        hyper: FloatTensor<Self>,
        beta1: f32,
        one_minus_beta1: f32,
        beta2: f32,
        one_minus_beta2: f32,
        eps: f32,
        decay: bool,
    ) -> FloatTensor<Self> {
        let h = optim::Scalars {
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            eps,
            lr: 0.0,
            bias1: 0.0,
            bias2: 0.0,
            lr_decay: 0.0,
        };
        optim::adamw_in_place(p, g, scale, m, v, hyper, h, decay)
    }
}
