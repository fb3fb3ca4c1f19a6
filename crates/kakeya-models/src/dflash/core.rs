//! The drafter's math, one implementation for the runtime and the trainer: the context
//! projection, the Qwen3 layers over `[context ; blocks]` and greedy acceptance
//! (the LM head, possibly reduced, is [`super::DraftHead`]).
//!
//! The runtime drafts one block over the context its store holds (no mask); the trainer runs
//! many blocks per sequence, each seeing only the context before its anchor (an additive
//! mask), with weights that track gradients. Both call [`DraftWeights::blocks`]; the weights
//! are plain tensors either way (a [`Linear`] without GGUF blocks is an ordinary matmul, so
//! autodiff flows through it).

use std::ops::Range;

use burn::tensor::activation::silu;
use burn::tensor::{Tensor, TensorData};
use kakeya_weights::DFlashConfig;

use crate::error::Result;
use crate::linear::Linear;
use crate::norm::RmsNorm;
use crate::rope::Rope;
use crate::sdpa::grouped_attention;

/// One Qwen3-style drafter layer.
#[derive(Debug, Clone)]
struct DraftLayer {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

/// The drafter's own weights (not the verifier's embedding or head).
#[derive(Debug, Clone)]
pub struct DraftWeights {
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<DraftLayer>,
    norm: RmsNorm,
}

/// Blocks that share one sequence's context in a [`DraftWeights::blocks`] call.
#[derive(Debug, Clone)]
pub struct BlockGroup {
    /// The sequence's rows in the context keys/values.
    pub context: Range<usize>,
    /// The group's rows in the block input.
    pub rows: Range<usize>,
    /// Additive mask `[1, G · rows, context + rows]` (`G` query heads per KV head, rows
    /// group-major); `None`: every row sees the whole context and every row of the group.
    pub mask: Option<Tensor<3>>,
}

impl DraftWeights {
    /// Builds from named tensors in 2-D storage form (`[1, n]` for norm multipliers), as
    /// [`DFlashConfig::expected_tensors`] names them; `get` says what is missing.
    pub fn from_named(
        config: &DFlashConfig,
        mut get: impl FnMut(&str) -> Result<Tensor<2>>,
    ) -> Result<Self> {
        let eps = config.rms_norm_eps;
        let mut lin = |name: &str| get(name);
        let norm = |t: Tensor<2>| {
            let n = t.shape().num_elements();
            RmsNorm {
                scale: t.reshape([n]),
                eps,
            }
        };
        let fc = Linear::Dense(lin("fc.weight")?);
        let hidden_norm = norm(lin("hidden_norm.weight")?);
        let final_norm = norm(lin("norm.weight")?);
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = |s: &str| format!("layers.{i}.{s}");
            let mut dense = |s: &str| lin(&p(s)).map(Linear::Dense);
            layers.push(DraftLayer {
                q_proj: dense("self_attn.q_proj.weight")?,
                k_proj: dense("self_attn.k_proj.weight")?,
                v_proj: dense("self_attn.v_proj.weight")?,
                o_proj: dense("self_attn.o_proj.weight")?,
                gate_proj: dense("mlp.gate_proj.weight")?,
                up_proj: dense("mlp.up_proj.weight")?,
                down_proj: dense("mlp.down_proj.weight")?,
                q_norm: norm(lin(&p("self_attn.q_norm.weight"))?),
                k_norm: norm(lin(&p("self_attn.k_norm.weight"))?),
                input_norm: norm(lin(&p("input_layernorm.weight"))?),
                post_attn_norm: norm(lin(&p("post_attention_layernorm.weight"))?),
            });
        }
        Ok(Self {
            fc,
            hidden_norm,
            layers,
            norm: final_norm,
        })
    }

    /// These weights with the CPU's row-order kernel copies ([`Linear::with_host_rows`]): a
    /// draft's few rows then skip the dense matmul's per-call packing of every weight. For
    /// inference only — a trainer's weights change every step.
    pub fn with_host_rows(self) -> Self {
        let layers = self
            .layers
            .into_iter()
            .map(|l| DraftLayer {
                q_proj: l.q_proj.with_host_rows(),
                k_proj: l.k_proj.with_host_rows(),
                v_proj: l.v_proj.with_host_rows(),
                o_proj: l.o_proj.with_host_rows(),
                gate_proj: l.gate_proj.with_host_rows(),
                up_proj: l.up_proj.with_host_rows(),
                down_proj: l.down_proj.with_host_rows(),
                ..l
            })
            .collect();
        Self {
            fc: self.fc.with_host_rows(),
            layers,
            ..self
        }
    }

    /// Drafter layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of these weights.
    pub fn nbytes(&self) -> usize {
        let t = Linear::nbytes;
        let n = |x: &RmsNorm| x.scale.shape().num_elements() * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [
                    &l.q_proj,
                    &l.k_proj,
                    &l.v_proj,
                    &l.o_proj,
                    &l.gate_proj,
                    &l.up_proj,
                    &l.down_proj,
                ]
                .iter()
                .map(|p| t(p))
                .sum::<usize>()
                    + [&l.q_norm, &l.k_norm, &l.input_norm, &l.post_attn_norm]
                        .iter()
                        .map(|x| n(x))
                        .sum::<usize>()
            })
            .sum();
        t(&self.fc) + n(&self.hidden_norm) + n(&self.norm) + layers
    }

    /// Projects context rows to what a drafter store holds: per layer, the keys after k_norm
    /// (before RoPE) and the values, concatenated over layers.
    ///
    /// # Shapes
    /// - `context`: `[n, targets · hidden]` (verifier hidden states after the target layers)
    /// - returns `k`, `v`: `[n, layers · kv_heads · head_dim]`
    pub fn context_rows(&self, c: &DFlashConfig, context: Tensor<2>) -> (Tensor<2>, Tensor<2>) {
        let n = context.dims()[0];
        let kv = c.num_key_value_heads * c.head_dim;
        let ctx = self.hidden_norm.forward(self.fc.forward(context));
        let (ks, vs): (Vec<_>, Vec<_>) = self
            .layers
            .iter()
            .map(|l| {
                let k = l
                    .k_norm
                    .forward(heads_first(
                        l.k_proj.forward(ctx.clone()),
                        c.num_key_value_heads,
                        c.head_dim,
                    ))
                    .swap_dims(0, 1)
                    .reshape([n, kv]);
                (k, l.v_proj.forward(ctx.clone()))
            })
            .unzip();
        (Tensor::cat(ks, 1), Tensor::cat(vs, 1))
    }

    /// Runs block rows through the layers and the final norm; each group's rows attend over
    /// their sequence's context rows and the group's own rows (under the group's mask).
    ///
    /// # Shapes
    /// - `x`: `[R, hidden]`, the scaled embeddings of the block tokens
    /// - `ck`, `cv`: `[N, layers · kv_heads · head_dim]`, as [`Self::context_rows`] returns
    /// - `ctx_pos`: `N` positions (RoPE of the context keys); `blk_pos`: `R` positions
    /// - returns `[R, hidden]` (final-normed)
    pub fn blocks(
        &self,
        c: &DFlashConfig,
        x: Tensor<2>,
        (ck, cv): (Tensor<2>, Tensor<2>),
        (ctx_pos, blk_pos): (&[usize], &[usize]),
        groups: &[BlockGroup],
    ) -> Tensor<2> {
        let device = x.device();
        let rope = Rope::new(c.head_dim, c.rope_theta, 1.0);
        let ropes = BlockRopes {
            context: rope.tables(ctx_pos, &device),
            block: rope.tables(blk_pos, &device),
        };
        let groups_per_kv = c.num_attention_heads / c.num_key_value_heads;
        // Sliding layers: each group's mask with the window's (one per distinct window).
        let mut windowed: Vec<(usize, Vec<Option<Tensor<3>>>)> = Vec::new();
        for w in c.layer_windows.iter().flatten() {
            if windowed.iter().any(|(x, _)| x == w) {
                continue;
            }
            let masks = groups
                .iter()
                .map(|g| {
                    let win = window_mask(
                        &ctx_pos[g.context.clone()],
                        &blk_pos[g.rows.clone()],
                        *w,
                        groups_per_kv,
                        &device,
                    );
                    match (g.mask.clone(), win) {
                        (Some(a), Some(b)) => Some(a + b),
                        (a, b) => a.or(b),
                    }
                })
                .collect();
            windowed.push((*w, masks));
        }
        let own: Vec<Option<Tensor<3>>> = groups.iter().map(|g| g.mask.clone()).collect();
        let masks: Vec<Vec<Option<Tensor<3>>>> = c
            .layer_windows
            .iter()
            .take(self.layers.len())
            .map(|w| {
                w.and_then(|w| windowed.iter().find(|(x, _)| *x == w))
                    .map_or_else(|| own.clone(), |(_, m)| m.clone())
            })
            .collect();
        debug_assert_eq!(ctx_pos.len(), ck.dims()[0], "a position per context row");
        debug_assert_eq!(blk_pos.len(), x.dims()[0], "a position per block row");
        self.layers_over(c, x, (ck, cv), &ropes, groups, &masks)
    }

    /// [`Self::blocks`] with the RoPE tables and each layer's masks given: the layers and the
    /// final norm. `masks[i][g]` is layer `i`'s additive mask of group `g` (`None`: no mask).
    ///
    /// # Shapes
    /// - `x`: `[R, hidden]`; `ck`, `cv`: `[N, layers · kv_heads · head_dim]`
    /// - `ropes`: context `[N, head_dim/2]`, block `[R, head_dim/2]` (cos, sin)
    /// - `masks[i][g]`: `[1 | kv_heads, 1 | G · rows_g, context_g + rows_g]` (broadcast)
    /// - returns `[R, hidden]` (final-normed)
    pub(super) fn layers_over(
        &self,
        c: &DFlashConfig,
        mut x: Tensor<2>,
        (ck, cv): (Tensor<2>, Tensor<2>),
        ropes: &BlockRopes,
        groups: &[BlockGroup],
        masks: &[Vec<Option<Tensor<3>>>],
    ) -> Tensor<2> {
        let (ctx_cos, ctx_sin) = &ropes.context;
        let (blk_cos, blk_sin) = &ropes.block;
        let (hq, hkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (n, rows) = (ck.dims()[0], x.dims()[0]);
        let kv = hkv * hd;
        let scale = (hd as f64).powf(-0.5);
        for (i, l) in self.layers.iter().enumerate() {
            let kc = ck.clone().slice([0..n, i * kv..(i + 1) * kv]);
            let kc = Rope::apply(heads_first(kc, hkv, hd), ctx_cos, ctx_sin);
            let vc = heads_first(cv.clone().slice([0..n, i * kv..(i + 1) * kv]), hkv, hd);
            let h = l.input_norm.forward(x.clone());
            let q = l
                .q_norm
                .forward(heads_first(l.q_proj.forward(h.clone()), hq, hd));
            let q = Rope::apply(q, blk_cos, blk_sin);
            let kb = l
                .k_norm
                .forward(heads_first(l.k_proj.forward(h.clone()), hkv, hd));
            let kb = Rope::apply(kb, blk_cos, blk_sin);
            let vb = heads_first(l.v_proj.forward(h), hkv, hd);
            let outs: Vec<Tensor<2>> = groups
                .iter()
                .enumerate()
                .map(|(gi, g)| {
                    let (c, r) = (g.context.clone(), g.rows.clone());
                    let q_g = q.clone().slice([0..hq, r.clone(), 0..hd]);
                    let k = Tensor::cat(
                        vec![
                            kc.clone().slice([0..hkv, c.clone(), 0..hd]),
                            kb.clone().slice([0..hkv, r.clone(), 0..hd]),
                        ],
                        1,
                    );
                    let v = Tensor::cat(
                        vec![
                            vc.clone().slice([0..hkv, c, 0..hd]),
                            vb.clone().slice([0..hkv, r, 0..hd]),
                        ],
                        1,
                    );
                    grouped_attention(q_g, k, v, scale, masks[i][gi].clone())
                })
                .collect();
            let attn = if outs.len() == 1 {
                outs.into_iter().next().expect("one group")
            } else {
                Tensor::cat(outs, 0)
            };
            debug_assert_eq!(attn.dims()[0], rows, "groups cover every block row");
            x = x + l.o_proj.forward(attn);
            let m = l.post_attn_norm.forward(x.clone());
            let m = silu(l.gate_proj.forward(m.clone())) * l.up_proj.forward(m);
            x = x + l.down_proj.forward(m);
        }
        self.norm.forward(x)
    }

    /// The final norm's multipliers (a tensor on the weights' device).
    pub(super) fn norm_scale(&self) -> &Tensor<1> {
        &self.norm.scale
    }
}

/// The RoPE `(cos, sin)` of the context keys and of the block rows.
pub(super) struct BlockRopes {
    /// `[N, head_dim/2]` each.
    pub context: (Tensor<2>, Tensor<2>),
    /// `[R, head_dim/2]` each.
    pub block: (Tensor<2>, Tensor<2>),
}

/// Drafts accepted under greedy verification: the longest prefix with
/// `drafts[i] == truth[i]`, where `truth[i]` is the verifier's choice for the position draft
/// `i` fills (a shorter `truth` ends the count).
pub fn accepted_drafts(drafts: &[u32], truth: &[u32]) -> usize {
    drafts.iter().zip(truth).take_while(|(d, t)| d == t).count()
}

/// The additive mask of a sliding drafter layer over `[context ; block]` keys: a query at
/// position `q` sees a context key at `k` when `q - k < window` — flash-attention's window
/// `(w - 1, w - 1)`, which z-lab's drafters run with (their eager path ignores the window) —
/// and every key of its own block; `None` when every key is in reach.
///
/// # Shapes
/// - returns `[1, G · rows, context + rows]`, rows group-major
fn window_mask(
    ctx_pos: &[usize],
    blk_pos: &[usize],
    window: usize,
    groups: usize,
    device: &burn::tensor::Device,
) -> Option<Tensor<3>> {
    let out_of_reach = |q: usize, k: usize| k + window <= q;
    if !blk_pos
        .iter()
        .any(|&q| ctx_pos.iter().any(|&k| out_of_reach(q, k)))
    {
        return None;
    }
    let keys = ctx_pos.len() + blk_pos.len();
    let row = |q: usize| {
        ctx_pos
            .iter()
            .map(move |&k| {
                if out_of_reach(q, k) {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .chain(std::iter::repeat_n(0.0, blk_pos.len()))
    };
    let data: Vec<f32> = (0..groups)
        .flat_map(|_| blk_pos.iter().flat_map(move |&q| row(q)))
        .collect();
    Some(Tensor::from_data(
        TensorData::new(data, [1, groups * blk_pos.len(), keys]),
        device,
    ))
}

/// `[n, heads · head_dim]` → `[heads, n, head_dim]`.
fn heads_first(x: Tensor<2>, heads: usize, head_dim: usize) -> Tensor<3> {
    let n = x.dims()[0];
    x.reshape([n, heads, head_dim]).swap_dims(0, 1)
}

#[cfg(test)]
mod tests {
    use super::{accepted_drafts, window_mask};

    #[test]
    fn a_sliding_layer_sees_context_fewer_than_window_positions_back_and_its_whole_block() {
        let dev = burn::tensor::Device::flex();
        // Context 0..5, block 5..7, window 3: query 5 sees context 3, 4; query 6 sees 4.
        let m = window_mask(&[0, 1, 2, 3, 4], &[5, 6], 3, 2, &dev).unwrap();
        assert_eq!(m.dims(), [1, 4, 7]);
        let v = m.into_data().try_into_vec::<f32>().unwrap();
        let seen: Vec<bool> = v.iter().map(|x| x.is_finite()).collect();
        let (t, f) = (true, false);
        let q5 = [f, f, f, t, t, t, t];
        let q6 = [f, f, f, f, t, t, t];
        assert_eq!(seen, [q5, q6, q5, q6].concat(), "rows group-major");
        // Everything in reach: no mask at all.
        assert!(window_mask(&[4], &[5, 6], 3, 2, &dev).is_none());
    }

    #[test]
    fn accepted_drafts_stop_at_the_first_mismatch_or_the_end_of_the_truth() {
        assert_eq!(accepted_drafts(&[5, 6, 7], &[5, 6, 7, 8]), 3);
        assert_eq!(accepted_drafts(&[5, 9, 7], &[5, 6, 7]), 1);
        assert_eq!(accepted_drafts(&[9, 6, 7], &[5, 6, 7]), 0);
        assert_eq!(accepted_drafts(&[5, 6, 7], &[5, 6]), 2);
        assert_eq!(accepted_drafts(&[], &[1]), 0);
    }
}
