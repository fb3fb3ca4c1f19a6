//! The DFlash drafter: context projection (`fc` + `hidden_norm`), Qwen3 decoder layers that
//! attend over [context ; block] without a mask, final norm, and the verifier's LM head.
//!
//! Per layer the context K/V (k_proj/v_proj of the projected context, k_norm; RoPE is applied
//! at the context's absolute positions when they are read) live in a caller-owned
//! [`DraftContext`] store, one row per position: the form f_θ reads, so that one store serves
//! the drafter and restoration. Each forward appends only the new context rows. The block's
//! own K/V are never stored: a block is drafted once and thrown away.

use burn::tensor::activation::silu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use kakeya_weights::{DFlashConfig, DraftCheckpoint, HostTensor};

use crate::cache::DraftContext;
use crate::error::{ModelError, Result};
use crate::gemma3::Gemma3Model;
use crate::linear::Linear;
use crate::norm::RmsNorm;
use crate::rope::Rope;
use crate::sdpa::grouped_attention;

/// One drafter forward: new context rows and the block to draft.
#[derive(Debug, Clone)]
pub struct DraftRequest<'a> {
    /// Verifier hidden states after the drafter's target layers, concatenated in
    /// `target_layer_ids` order, for context positions the store does not hold yet:
    /// `[n, targets · hidden]` at positions `store.len()..store.len() + n`; `None` when the
    /// store is already up to date.
    pub context: Option<Tensor<2>>,
    /// Block tokens: the last committed token, then `mask_token_id` for each slot to draft.
    pub block: &'a [u32],
    /// Also return the new context rows as appended to the store (for capture).
    pub capture_context: bool,
}

/// What a drafter forward returns.
#[derive(Debug, Clone)]
pub struct DraftOutput {
    /// Final-normed hidden states of the block, `[B, hidden]`.
    pub hidden: Tensor<2>,
    /// The new context rows as appended to the store, when asked for: keys after k_norm
    /// (before RoPE) and values, each `[n, layers · kv_heads · head_dim]` (layer-major).
    pub context_kv: Option<(Tensor<2>, Tensor<2>)>,
}

/// The LM head the drafter scores with.
#[derive(Debug, Clone)]
enum DraftHead {
    /// The verifier's whole tied head.
    Verifier(Linear),
    /// Rows of the verifier's head for a reduced draft vocabulary.
    Reduced {
        /// `[draft_vocab, hidden]`.
        head: Linear,
        /// Verifier token id of each draft id.
        d2t: Vec<u32>,
    },
}

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

/// RoPE cos/sin tables, `[n, head_dim/2]` each.
type Tables = (Tensor<2>, Tensor<2>);

/// The DFlash drafter bound to its verifier's embedding and head.
#[derive(Debug, Clone)]
pub struct DFlashDrafter {
    /// Hyper-parameters.
    pub config: DFlashConfig,
    fc: Linear,
    hidden_norm: RmsNorm,
    layers: Vec<DraftLayer>,
    norm: RmsNorm,
    rope: Rope,
    /// The verifier's embedding, `[vocab, hidden]`.
    embed: Tensor<2>,
    embed_scale: f32,
    head: DraftHead,
    device: Device,
}

/// Moves checkpoint tensors to the device.
struct Take<'a> {
    ck: &'a mut DraftCheckpoint,
    device: &'a Device,
    eps: f64,
}

impl Take<'_> {
    fn take(&mut self, name: &str) -> Result<HostTensor> {
        self.ck.tensors.remove(name).ok_or_else(|| {
            ModelError::Weights(kakeya_weights::WeightsError::MissingTensor {
                path: self.ck.source.clone(),
                tensor: name.into(),
            })
        })
    }

    fn lin(&mut self, name: &str) -> Result<Linear> {
        let t = self.take(name)?;
        Ok(Linear::dense(Tensor::from_data(
            TensorData::new(t.data, [t.shape[0], t.shape[1]]),
            self.device,
        )))
    }

    fn norm(&mut self, name: &str) -> Result<RmsNorm> {
        let t = self.take(name)?;
        let n = t.data.len();
        Ok(RmsNorm {
            scale: Tensor::from_data(TensorData::new(t.data, [n]), self.device),
            eps: self.eps,
        })
    }
}

impl DFlashDrafter {
    /// Builds the drafter for `verifier`, refusing a checkpoint made for another model
    /// (hidden size, vocabulary, target layers, mask token).
    pub fn from_checkpoint(mut ck: DraftCheckpoint, verifier: &Gemma3Model) -> Result<Self> {
        ck.check()?;
        let c = ck.config.clone();
        let v = &verifier.config;
        let mismatch = |msg: String| ModelError::Mismatch {
            path: ck.source.clone(),
            msg,
        };
        if c.hidden_size != v.hidden_size {
            return Err(mismatch(format!(
                "drafter hidden_size {} but the verifier's is {}",
                c.hidden_size, v.hidden_size
            )));
        }
        if c.vocab_size != v.vocab_size {
            return Err(mismatch(format!(
                "drafter vocab_size {} but the verifier's is {}",
                c.vocab_size, v.vocab_size
            )));
        }
        if c.num_target_layers != v.num_hidden_layers {
            return Err(mismatch(format!(
                "drafter built for a {}-layer verifier, this one has {} layers",
                c.num_target_layers, v.num_hidden_layers
            )));
        }
        if let Some(&bad) = c
            .target_layer_ids
            .iter()
            .find(|&&l| l >= v.num_hidden_layers)
        {
            return Err(mismatch(format!(
                "target layer {bad} does not exist (the verifier has {} layers)",
                v.num_hidden_layers
            )));
        }
        let device = verifier.device().clone();
        let d2t = ck.d2t.take();
        let mut l = Take {
            ck: &mut ck,
            device: &device,
            eps: c.rms_norm_eps,
        };
        let fc = l.lin("fc.weight")?;
        let hidden_norm = l.norm("hidden_norm.weight")?;
        let final_norm = l.norm("norm.weight")?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = |s: &str| format!("layers.{i}.{s}");
            layers.push(DraftLayer {
                q_proj: l.lin(&p("self_attn.q_proj.weight"))?,
                k_proj: l.lin(&p("self_attn.k_proj.weight"))?,
                v_proj: l.lin(&p("self_attn.v_proj.weight"))?,
                o_proj: l.lin(&p("self_attn.o_proj.weight"))?,
                q_norm: l.norm(&p("self_attn.q_norm.weight"))?,
                k_norm: l.norm(&p("self_attn.k_norm.weight"))?,
                input_norm: l.norm(&p("input_layernorm.weight"))?,
                post_attn_norm: l.norm(&p("post_attention_layernorm.weight"))?,
                gate_proj: l.lin(&p("mlp.gate_proj.weight"))?,
                up_proj: l.lin(&p("mlp.up_proj.weight"))?,
                down_proj: l.lin(&p("mlp.down_proj.weight"))?,
            });
        }
        let head = match d2t {
            None => DraftHead::Verifier(verifier.head.clone()),
            Some(d2t) => {
                let ids: Vec<i64> = d2t.iter().map(|&t| i64::from(t)).collect();
                let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [d2t.len()]), &device);
                DraftHead::Reduced {
                    head: Linear::dense(verifier.embed.clone().select(0, ids)),
                    d2t,
                }
            }
        };
        Ok(Self {
            rope: Rope::new(c.head_dim, c.rope_theta, 1.0),
            embed: verifier.embed.clone(),
            embed_scale: (v.hidden_size as f32).sqrt(),
            config: c,
            fc,
            hidden_norm,
            layers,
            norm: final_norm,
            head,
            device,
        })
    }

    /// Bytes of the drafter's own weights (the verifier's embedding and full head, which it
    /// shares, are not counted; a reduced head is).
    pub fn nbytes(&self) -> usize {
        let t = |x: &Tensor<2>| x.shape().num_elements() * 4;
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
                .map(|p| t(&p.weight))
                .sum::<usize>()
                    + [&l.q_norm, &l.k_norm, &l.input_norm, &l.post_attn_norm]
                        .iter()
                        .map(|x| n(x))
                        .sum::<usize>()
            })
            .sum();
        let head = match &self.head {
            DraftHead::Verifier(_) => 0,
            DraftHead::Reduced { head, d2t } => t(&head.weight) + d2t.len() * 4,
        };
        t(&self.fc.weight) + n(&self.hidden_norm) + n(&self.norm) + layers + head
    }

    /// Drafter layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Width of one context row of the store: `layers · kv_heads · head_dim`.
    pub fn context_width(&self) -> usize {
        self.layers.len() * self.config.num_key_value_heads * self.config.head_dim
    }

    /// Projects context rows to what the store holds: per drafter layer, the keys after
    /// k_norm (before RoPE) and the values, concatenated over layers.
    ///
    /// # Shapes
    /// - `context`: `[n, targets · hidden]` (verifier hidden states after the target layers)
    /// - returns `k`, `v`: `[n, layers · kv_heads · head_dim]`
    pub fn context_rows(&self, context: Tensor<2>) -> Result<(Tensor<2>, Tensor<2>)> {
        let c = &self.config;
        let [n, width] = context.dims();
        if width != c.target_layer_ids.len() * c.hidden_size {
            return Err(ModelError::Input(format!(
                "context rows are {width} wide, the drafter expects {} target layers × {}",
                c.target_layer_ids.len(),
                c.hidden_size
            )));
        }
        if n == 0 {
            return Err(ModelError::Input("no context rows to project".into()));
        }
        let kv = c.num_key_value_heads * c.head_dim;
        let ctx = self.hidden_norm.forward(self.fc.forward(context));
        let (ks, vs): (Vec<_>, Vec<_>) = self
            .layers
            .iter()
            .map(|l| {
                let k = l
                    .k_norm
                    .forward(self.heads_first(l.k_proj.forward(ctx.clone()), c.num_key_value_heads))
                    .swap_dims(0, 1)
                    .reshape([n, kv]);
                (k, l.v_proj.forward(ctx.clone()))
            })
            .unzip();
        Ok((Tensor::cat(ks, 1), Tensor::cat(vs, 1)))
    }

    /// Tokens per block, anchor included.
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// Size of the vocabulary the drafter scores (reduced or the verifier's).
    pub fn draft_vocab(&self) -> usize {
        match &self.head {
            DraftHead::Verifier(_) => self.config.vocab_size,
            DraftHead::Reduced { d2t, .. } => d2t.len(),
        }
    }

    /// Verifier token id of a draft-vocabulary id.
    pub fn to_target(&self, draft_id: usize) -> u32 {
        match &self.head {
            DraftHead::Verifier(_) => draft_id as u32,
            DraftHead::Reduced { d2t, .. } => d2t[draft_id],
        }
    }

    /// Draft-vocabulary logits of block rows.
    ///
    /// # Shapes
    /// - `hidden`: `[n, hidden]` (final-normed) → `[n, draft_vocab]`
    pub fn logits(&self, hidden: Tensor<2>) -> Tensor<2> {
        match &self.head {
            DraftHead::Verifier(h) => h.forward(hidden),
            DraftHead::Reduced { head, .. } => head.forward(hidden),
        }
    }

    /// Greedy drafts for block slots `1..B` (slot `k` predicts position `start + k`), as
    /// verifier token ids.
    ///
    /// # Shapes
    /// - `hidden`: `[B, hidden]` → `B - 1` ids
    pub fn draft_tokens(&self, hidden: Tensor<2>) -> Vec<u32> {
        let [b, h] = hidden.dims();
        if b < 2 {
            return Vec::new();
        }
        let ids = self
            .logits(hidden.slice([1..b, 0..h]))
            .argmax(1)
            .into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .expect("argmax ids");
        ids.into_iter()
            .map(|i| self.to_target(i as usize))
            .collect()
    }

    fn embed_tokens(&self, tokens: &[u32]) -> Tensor<2> {
        let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
        let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [tokens.len()]), &self.device);
        self.embed
            .clone()
            .select(0, ids)
            .mul_scalar(self.embed_scale)
    }

    /// Drafts one block: appends the new context rows (if any) to `store` and returns the
    /// block's hidden states, attending over every position the store holds.
    ///
    /// # Shapes
    /// - `req.context`: `[n, targets · hidden]`, positions `L..L+n` where `L = store.len()`
    /// - `req.block`: `B` ids at positions `L+n..L+n+B`
    /// - returns `hidden` `[B, hidden]`; `context_kv` `[n, layers · kv_heads · head_dim]` each
    pub fn forward(
        &self,
        req: &DraftRequest<'_>,
        store: &mut dyn DraftContext,
    ) -> Result<DraftOutput> {
        let c = &self.config;
        let b = req.block.len();
        if b == 0 {
            return Err(ModelError::Input("a draft needs a block".into()));
        }
        if let Some(&bad) = req.block.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(ModelError::Input(format!(
                "block token {bad} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let mut context_kv = None;
        if let Some(ctx) = &req.context {
            let (k, v) = self.context_rows(ctx.clone())?;
            if req.capture_context {
                context_kv = Some((k.clone(), v.clone()));
            }
            store.append(k, v)?;
        }
        let len = store.len();
        if len == 0 {
            return Err(ModelError::Input(
                "a draft needs context: the store is empty and no rows were given".into(),
            ));
        }
        let (ck, cv) = store.read(0..len)?;
        let ctx_pos: Vec<usize> = (0..len).collect();
        let blk_pos: Vec<usize> = (len..len + b).collect();
        let ctx_rope = self.rope.tables(&ctx_pos, &self.device);
        let blk_rope = self.rope.tables(&blk_pos, &self.device);
        let kv = c.num_key_value_heads * c.head_dim;
        let mut x = self.embed_tokens(req.block);
        for (i, layer) in self.layers.iter().enumerate() {
            let k = ck.clone().slice([0..len, i * kv..(i + 1) * kv]);
            let v = cv.clone().slice([0..len, i * kv..(i + 1) * kv]);
            let k = Rope::apply(
                self.heads_first(k, c.num_key_value_heads),
                &ctx_rope.0,
                &ctx_rope.1,
            );
            let v = self.heads_first(v, c.num_key_value_heads);
            x = self.layer_forward(layer, x, (k, v), &blk_rope);
        }
        Ok(DraftOutput {
            hidden: self.norm.forward(x),
            context_kv,
        })
    }

    fn heads_first(&self, x: Tensor<2>, heads: usize) -> Tensor<3> {
        let t = x.dims()[0];
        x.reshape([t, heads, self.config.head_dim]).swap_dims(0, 1)
    }

    /// # Shapes
    /// - `x`: `[B, hidden]`; `ctx`: context keys (after RoPE) and values,
    ///   `[kv_heads, L, head_dim]` each → `[B, hidden]`
    fn layer_forward(
        &self,
        l: &DraftLayer,
        x: Tensor<2>,
        ctx: (Tensor<3>, Tensor<3>),
        blk_rope: &Tables,
    ) -> Tensor<2> {
        let c = &self.config;
        let (hq, hkv) = (c.num_attention_heads, c.num_key_value_heads);
        let h = l.input_norm.forward(x.clone());
        let q = l
            .q_norm
            .forward(self.heads_first(l.q_proj.forward(h.clone()), hq));
        let q = Rope::apply(q, &blk_rope.0, &blk_rope.1);
        let k_blk = l
            .k_norm
            .forward(self.heads_first(l.k_proj.forward(h.clone()), hkv));
        let k_blk = Rope::apply(k_blk, &blk_rope.0, &blk_rope.1);
        let v_blk = self.heads_first(l.v_proj.forward(h), hkv);
        let k = Tensor::cat(vec![ctx.0, k_blk], 1);
        let v = Tensor::cat(vec![ctx.1, v_blk], 1);
        let scale = (c.head_dim as f64).powf(-0.5);
        let attn = l.o_proj.forward(grouped_attention(q, k, v, scale, None));
        let x = x + attn;
        let m = l.post_attn_norm.forward(x.clone());
        let m = silu(l.gate_proj.forward(m.clone())) * l.up_proj.forward(m);
        x + l.down_proj.forward(m)
    }
}
