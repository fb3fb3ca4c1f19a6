//! The DFlash drafter: context projection (`fc` + `hidden_norm`), Qwen3 decoder layers that
//! attend over [context ; block] without a mask, final norm, and the verifier's LM head.
//!
//! Per layer the context K/V (k_proj/v_proj of the projected context, k_norm; RoPE is applied
//! at the context's absolute positions when they are read) live in a caller-owned
//! [`DraftContext`] store, one row per position: the form f_θ reads, so that one store serves
//! the drafter and restoration. Each forward appends only the new context rows. The block's
//! own K/V are never stored: a block is drafted once and thrown away.

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_weights::{DFlashConfig, DraftCheckpoint, HostTensor};

use super::DraftHead;
use super::core::{BlockGroup, DraftWeights};
use super::replay::{AppendReplayer, Replayer};
use crate::cache::DraftContext;
use crate::error::{ModelError, Result};
use crate::gemma::{DeviceRopes, GemmaModel};

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

/// The DFlash drafter bound to its verifier's embedding and head.
#[derive(Debug, Clone)]
pub struct DFlashDrafter {
    /// Hyper-parameters.
    pub config: DFlashConfig,
    pub(super) weights: DraftWeights,
    /// The verifier's embedding, `[vocab, hidden]`.
    embed: Tensor<2>,
    /// The same as the device holds it (the verifier's head's row blocks where the table is
    /// larger than one buffer there), for drafts that gather their rows on the device.
    pub(super) embed_blocks: Vec<Tensor<2>>,
    pub(super) embed_scale: f32,
    head: DraftHead,
    pub(super) device: Device,
    /// On a GPU, drafts are recorded once and replayed ([`Self::replays_drafts`]); false:
    /// issued launch by launch (the CLI's `--no-graph`).
    pub record_drafts: bool,
    /// What the drafter keeps on a GPU, chosen at load from its device (`None` on the CPU).
    pub(super) gpu: Option<DraftGpuSide>,
}

/// What a drafter keeps on a GPU beside its weights.
#[derive(Debug, Clone, Default)]
pub(super) struct DraftGpuSide {
    /// The RoPE table on the device that recorded drafts gather from.
    pub(super) rope: DeviceRopes,
    /// The recorded drafts.
    pub(super) replayer: Replayer,
    /// The recorded appends of store rows.
    pub(super) append_replayer: AppendReplayer,
}

/// Moves checkpoint tensors to the device, in 2-D storage form.
struct Take<'a> {
    ck: &'a mut DraftCheckpoint,
    device: &'a Device,
}

impl Take<'_> {
    fn take(&mut self, name: &str) -> Result<Tensor<2>> {
        let t: HostTensor = self.ck.tensors.remove(name).ok_or_else(|| {
            ModelError::Weights(kakeya_weights::WeightsError::MissingTensor {
                path: self.ck.source.clone(),
                tensor: name.into(),
            })
        })?;
        let dims = match t.shape[..] {
            [r, c] => [r, c],
            _ => [1, t.data.len()],
        };
        Ok(Tensor::from_data(
            TensorData::new(t.data, dims),
            self.device,
        ))
    }
}

impl DFlashDrafter {
    /// Builds the drafter for `verifier`, refusing a checkpoint made for another model
    /// (hidden size, vocabulary, target layers, mask token).
    pub fn from_checkpoint(mut ck: DraftCheckpoint, verifier: &GemmaModel) -> Result<Self> {
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
        };
        let weights = DraftWeights::from_named(&c, |name| l.take(name))?.with_host_rows();
        Ok(Self {
            head: DraftHead::new(verifier.head.clone(), &verifier.embed, d2t),
            embed: verifier.embed.clone(),
            embed_blocks: verifier.embed_blocks().to_vec(),
            embed_scale: (v.hidden_size as f32).sqrt(),
            config: c,
            weights,
            gpu: crate::gpu::is_gpu(&device).then(DraftGpuSide::default),
            device,
            record_drafts: verifier.record_decode,
        })
    }

    /// Bytes of the drafter's own weights (the verifier's embedding and full head, which it
    /// shares, are not counted; a reduced head is).
    pub fn nbytes(&self) -> usize {
        self.weights.nbytes() + self.head.nbytes()
    }

    /// Drafter layers.
    pub fn num_layers(&self) -> usize {
        self.weights.num_layers()
    }

    /// Width of one context row of the store: `layers · kv_heads · head_dim`.
    pub fn context_width(&self) -> usize {
        self.weights.num_layers() * self.config.num_key_value_heads * self.config.head_dim
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
        Ok(self.weights.context_rows(c, context))
    }

    /// Tokens per block, anchor included.
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// Size of the vocabulary the drafter scores (reduced or the verifier's).
    pub fn draft_vocab(&self) -> usize {
        self.head.vocab()
    }

    /// Verifier token id of a draft-vocabulary id.
    pub fn to_target(&self, draft_id: usize) -> u32 {
        self.head.to_target(draft_id)
    }

    /// Draft-vocabulary logits of block rows.
    ///
    /// # Shapes
    /// - `hidden`: `[n, hidden]` (final-normed) → `[n, draft_vocab]`
    pub fn logits(&self, hidden: Tensor<2>) -> Tensor<2> {
        self.head.logits(hidden)
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
        self.head.draft_ids(hidden.slice([1..b, 0..h]))
    }

    fn embed_tokens(&self, tokens: &[u32]) -> Tensor<2> {
        crate::gemma::model::embedding_rows(&self.embed, tokens, self.embed_scale, &self.device)
    }

    /// Drafts one block: appends the new context rows (if any) to `store` and returns the
    /// block's hidden states, attending over the positions the store gives drafts
    /// ([`DraftContext::read_reach`]: every one, or a sink and a recent window).
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
        let (ctx_pos, ck, cv) = store.read_reach()?;
        let blk_pos: Vec<usize> = (len..len + b).collect();
        let group = BlockGroup {
            context: 0..ctx_pos.len(),
            rows: 0..b,
            mask: None,
        };
        let x = self.embed_tokens(req.block);
        let hidden = self
            .weights
            .blocks(c, x, (ck, cv), (&ctx_pos, &blk_pos), &[group]);
        Ok(DraftOutput { hidden, context_kv })
    }
}
