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
    let [heads, t, head_dim] = q.dims();
    let kv_heads = k.dims()[0];
    let groups = heads / kv_heads;
    // Heads sharing a KV head are stacked along the query axis: one batched matmul per KV head.
    let q = q.reshape([kv_heads, groups * t, head_dim]);
    let mut scores = q.matmul(k.swap_dims(1, 2)).mul_scalar(scale);
    if let Some(mask) = mask {
        scores = scores + mask;
    }
    softmax(scores, 2)
        .matmul(v)
        .reshape([heads, t, head_dim])
        .swap_dims(0, 1)
        .reshape([t, heads * head_dim])
}
