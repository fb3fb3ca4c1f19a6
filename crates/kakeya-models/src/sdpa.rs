//! Scaled dot-product attention with grouped key/value heads (GQA), shared by the verifier
//! and the drafter. Scores and softmax in f32. [GQA: Ainslie et al., arXiv:2305.13245]

use burn::tensor::Tensor;
use burn::tensor::activation::softmax;

/// `softmax(q·kᵀ·scale + mask)·v`, query head `h` reading key/value head `h / (heads/kv_heads)`.
///
/// # Shapes
/// - `q`: `[heads, T, head_dim]`; `k`, `v`: `[kv_heads, S, head_dim]`
/// - `mask`: additive, `[1, G·T, S]` with `G = heads / kv_heads`, rows group-major; `None` when
///   every key is visible to every query
/// - returns `[T, heads · head_dim]` (heads concatenated per position)
pub fn grouped_attention(
    q: Tensor<3>,
    k: Tensor<3>,
    v: Tensor<3>,
    scale: f64,
    mask: Option<Tensor<3>>,
) -> Tensor<2> {
    let heads = q.dims()[0];
    let kv_heads = k.dims()[0];
    // Heads sharing a KV head are stacked along the query axis: one batched matmul per KV head.
    let mut s = scores(group_queries(q, kv_heads), k, scale);
    if let Some(mask) = mask {
        s = s + mask;
    }
    merge_heads(crate::gpu::matmul(softmax(s, 2), v), heads)
}

/// Queries of heads sharing a KV head stacked along the query axis.
///
/// # Shapes
/// - `q`: `[heads, T, head_dim]` → `[kv_heads, G·T, head_dim]`
pub fn group_queries(q: Tensor<3>, kv_heads: usize) -> Tensor<3> {
    let [heads, t, head_dim] = q.dims();
    q.reshape([kv_heads, heads / kv_heads * t, head_dim])
}

/// Scaled scores of grouped queries against keys.
///
/// # Shapes
/// - `qg`: `[kv_heads, G·T, head_dim]`; `k`: `[kv_heads, S, head_dim]` → `[kv_heads, G·T, S]`
pub fn scores(qg: Tensor<3>, k: Tensor<3>, scale: f64) -> Tensor<3> {
    let s = crate::gpu::matmul(qg, k.swap_dims(1, 2));
    // A scale of 1 (Gemma 4, or queries scaled ahead) launches nothing.
    if scale == 1.0 { s } else { s.mul_scalar(scale) }
}

/// Back from grouped rows to one row per position.
///
/// # Shapes
/// - `o`: `[kv_heads, G·T, head_dim]` → `[T, heads · head_dim]`
pub fn merge_heads(o: Tensor<3>, heads: usize) -> Tensor<2> {
    let [_, gt, head_dim] = o.dims();
    let t = gt * o.dims()[0] / heads;
    o.reshape([heads, t, head_dim])
        .swap_dims(0, 1)
        .reshape([t, heads * head_dim])
}
