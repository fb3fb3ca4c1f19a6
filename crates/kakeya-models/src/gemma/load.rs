//! Building a [`GemmaModel`] from a checkpoint: Gemma 3, and Gemma 4 as configuration of
//! the same blocks (per-layer geometry, KV sharing, per-layer inputs, MoE).

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_weights::{AttentionKind, Checkpoint, HostTensor};

use super::attention::Attention;
use super::model::{DecoderLayer, GemmaModel};
use super::moe::{Expert, Moe};
use super::per_layer::{PerLayerEmbed, PerLayerGate};
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::norm::RmsNorm;
use crate::rope::Rope;

struct Loader<'a> {
    ck: &'a mut Checkpoint,
    device: &'a Device,
}

impl Loader<'_> {
    fn take(&mut self, name: &str) -> Result<HostTensor> {
        self.ck.tensors.remove(name).ok_or_else(|| {
            ModelError::Weights(kakeya_weights::WeightsError::MissingTensor {
                path: self.ck.source.clone(),
                tensor: name.into(),
            })
        })
    }

    /// A lookup table `[rows, width]` (Gemma 4's per-layer embedding) on the device where it
    /// fits one buffer there, else on the host, where its rows are looked up
    /// ([`super::model::embedding_rows`]).
    fn table(&mut self, name: &str) -> Result<Tensor<2>> {
        let t = self.take(name)?;
        let fits = crate::gpu::fits_one_buffer(self.device, (t.data.len() * 4) as u64);
        let device = if fits {
            self.device.clone()
        } else {
            Device::flex()
        };
        Ok(Tensor::from_data(
            TensorData::new(t.data, [t.shape[0], t.shape[1]]),
            &device,
        ))
    }

    /// The GGUF blocks of `name` for the block kernel, when it was quantised in the checkpoint
    /// and the model is on the CPU (the kernels run on host memory).
    fn quant_blocks(&mut self, name: &str) -> Option<kakeya_kernels::QuantMatrix> {
        self.ck
            .quantized
            .remove(name)
            .filter(|_| *self.device == Device::flex())
    }

    /// A weight as a linear map: its GGUF blocks where the block kernel takes them (the
    /// dense values then dropped), else dense in the form the device takes
    /// ([`Linear::host`]).
    fn lin(&mut self, name: &str) -> Result<Linear> {
        let quant = self.quant_blocks(name);
        let t = self.take(name)?;
        Ok(match quant {
            Some(q) => Linear::quant(q),
            None => self.host_lin(t.data, [t.shape[0], t.shape[1]]),
        })
    }

    /// The tied embedding `name` `[vocab, hidden]`: the lookup table (on the host where the
    /// device holds the head in row blocks) and the LM head (its blocks prepared for the
    /// certified argmax).
    fn tied_head(&mut self, name: &str) -> Result<(Tensor<2>, Linear)> {
        let quant = self.quant_blocks(name);
        let t = self.take(name)?;
        let shape = [t.shape[0], t.shape[1]];
        Ok(match quant {
            Some(q) => {
                q.prepare(true, false);
                let table = Tensor::from_data(TensorData::new(t.data, shape), self.device);
                (table, Linear::quant(q))
            }
            None => {
                let head = self.host_lin(t.data, shape);
                (head.dense_weight(), head)
            }
        })
    }

    /// A non-quantised weight `[out, in]` as a linear map (with the row-order kernel's copy
    /// on the CPU).
    fn host_lin(&self, data: Vec<f32>, shape: [usize; 2]) -> Linear {
        Linear::host(data, shape, self.device)
    }

    /// Layer `i`'s MoE branch.
    fn moe(&mut self, i: usize, mc: &kakeya_weights::MoeConfig, eps: f64) -> Result<Moe> {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let gate_up = self.take(&p("experts.gate_up_proj"))?;
        let down = self.take(&p("experts.down_proj"))?;
        let (gu_n, d_n) = (
            gate_up.data.len() / mc.experts,
            down.data.len() / mc.experts,
        );
        let experts = (0..mc.experts)
            .map(|e| Expert {
                gate_up: self.host_lin(
                    gate_up.data[e * gu_n..(e + 1) * gu_n].to_vec(),
                    [gate_up.shape[1], gate_up.shape[2]],
                ),
                down: self.host_lin(
                    down.data[e * d_n..(e + 1) * d_n].to_vec(),
                    [down.shape[1], down.shape[2]],
                ),
            })
            .collect();
        Ok(Moe {
            router: self.take(&p("router.proj.weight"))?.data,
            router_scale: self.take(&p("router.scale"))?.data,
            per_expert_scale: self.take(&p("router.per_expert_scale"))?.data,
            experts,
            top_k: mc.top_k,
            pre_norm: self.norm(&p("pre_feedforward_layernorm_2.weight"), eps)?,
            post_norm_dense: self.norm(&p("post_feedforward_layernorm_1.weight"), eps)?,
            post_norm_experts: self.norm(&p("post_feedforward_layernorm_2.weight"), eps)?,
        })
    }

    /// A weightless norm (Gemma 4's value norm): a multiplier of ones.
    fn ones(&self, dim: usize, eps: f64) -> RmsNorm {
        RmsNorm {
            scale: Tensor::ones([dim], self.device),
            eps,
        }
    }

    fn norm(&mut self, name: &str, eps: f64) -> Result<RmsNorm> {
        let t = self.take(name)?;
        let n = t.data.len();
        Ok(RmsNorm {
            scale: Tensor::from_data(TensorData::new(t.data, [n]), self.device),
            eps,
        })
    }
}

impl GemmaModel {
    /// Builds the model from a checkpoint (consumed: tensors move to the device).
    pub fn from_checkpoint(mut ck: Checkpoint, device: &Device) -> Result<Self> {
        ck.check_tensors()?;
        let c = ck.config.clone();
        let eps = c.rms_norm_eps;
        let mut l = Loader {
            ck: &mut ck,
            device,
        };
        let g4 = c.gemma4.clone();
        let global_rope = Rope::new(c.head_dim, c.rope_theta, c.rope_scaling_factor);
        let local_rope = Rope::new(c.head_dim, c.rope_local_base_freq, 1.0);
        let mut layers: Vec<DecoderLayer> = Vec::with_capacity(c.num_hidden_layers);
        for (i, &kind) in c.layer_types.iter().enumerate() {
            let p = |s: &str| format!("model.layers.{i}.{s}");
            let hd = c.head_dim_of(i);
            let source = c.kv_source(i);
            let k_eq_v =
                g4.as_ref().is_some_and(|g| g.attention_k_eq_v) && kind == AttentionKind::Full;
            let own = source.is_none();
            let attn = Attention {
                q_proj: l.lin(&p("self_attn.q_proj.weight"))?,
                k_proj: own
                    .then(|| l.lin(&p("self_attn.k_proj.weight")))
                    .transpose()?,
                v_proj: (own && !k_eq_v)
                    .then(|| l.lin(&p("self_attn.v_proj.weight")))
                    .transpose()?,
                o_proj: l.lin(&p("self_attn.o_proj.weight"))?,
                q_norm: l.norm(&p("self_attn.q_norm.weight"), eps)?,
                // A sharing layer turns its source's raw keys (evicted positions rebuilt by a
                // restorer) into keys with the source's k_norm, as the source computed them.
                k_norm: match source {
                    None => l.norm(&p("self_attn.k_norm.weight"), eps)?,
                    Some(src) => layers[src].attn.k_norm.clone(),
                },
                v_norm: g4.as_ref().map(|_| l.ones(hd, eps)),
                kv_source: source,
                shares_kv: (0..c.num_hidden_layers).any(|j| c.kv_source(j) == Some(i)),
                heads: c.num_attention_heads,
                kv_heads: c.kv_heads_of(i),
                head_dim: hd,
                scale: c.query_pre_attn_scalar.powf(-0.5),
                kind,
                window: c.sliding_window,
                rope: match (kind, &g4) {
                    (AttentionKind::Full, Some(g)) => {
                        Rope::proportional(hd, c.rope_theta, g.global_partial_rotary)
                    }
                    (AttentionKind::Full, None) => global_rope.clone(),
                    (AttentionKind::Sliding, _) => local_rope.clone(),
                },
                on_gpu: crate::gpu::kernels_on(device),
            };
            let per_layer = match &g4 {
                Some(g) if g.per_layer_input_size > 0 => Some(PerLayerGate {
                    gate: l.lin(&p("per_layer_input_gate.weight"))?,
                    proj: l.lin(&p("per_layer_projection.weight"))?,
                    norm: l.norm(&p("post_per_layer_input_norm.weight"), eps)?,
                }),
                _ => None,
            };
            let layer_scalar = match &g4 {
                Some(_) => Some(l.take(&p("layer_scalar"))?.data[0]),
                None => None,
            };
            let moe = match g4.as_ref().and_then(|g| g.moe.clone()) {
                Some(mc) => Some(l.moe(i, &mc, eps)?),
                None => None,
            };
            layers.push(DecoderLayer {
                attn,
                input_norm: l.norm(&p("input_layernorm.weight"), eps)?,
                post_attn_norm: l.norm(&p("post_attention_layernorm.weight"), eps)?,
                pre_ffn_norm: l.norm(&p("pre_feedforward_layernorm.weight"), eps)?,
                post_ffn_norm: l.norm(&p("post_feedforward_layernorm.weight"), eps)?,
                gate_proj: l.lin(&p("mlp.gate_proj.weight"))?,
                up_proj: l.lin(&p("mlp.up_proj.weight"))?,
                down_proj: l.lin(&p("mlp.down_proj.weight"))?,
                per_layer,
                layer_scalar,
                moe,
            });
        }
        let per_layer = match &g4 {
            Some(g) if g.per_layer_input_size > 0 => Some(PerLayerEmbed {
                embed: l.table("model.embed_tokens_per_layer.weight")?,
                proj: l.lin("model.per_layer_model_projection.weight")?,
                norm: l.norm("model.per_layer_projection_norm.weight", eps)?,
                layers: c.num_hidden_layers,
                size: g.per_layer_input_size,
            }),
            _ => None,
        };
        let (embed, head) = l.tied_head("model.embed_tokens.weight")?;
        let norm = l.norm("model.norm.weight", eps)?;
        Ok(Self {
            config: c,
            embed,
            head,
            layers,
            norm,
            per_layer,
            device: device.clone(),
            backend: super::device::Backend::of(device),
            record_decode: true,
        })
    }
}
