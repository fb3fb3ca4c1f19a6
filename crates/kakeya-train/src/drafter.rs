//! The DFlash drafter as a trainable function: parameters, the multi-anchor training forward
//! with DESIGN §4's block mask, the weighted cross-entropy, and export to z-lab's format.
//!
//! One step packs several sequences. Each sequence contributes its whole context (the
//! projected aux states of every position) once and `A` blocks; block `j` with anchor `a_j`
//! sees the context positions `< a_j` and its own `B` slots (bidirectionally), nothing else.
//! Slot 0 holds the anchor token (known), slots `1..B` the mask token; slot `k` is trained to
//! predict the verifier's token at `a_j + k` with weight `exp(-(k-1)/γ)`. This is exactly what
//! the runtime's drafter computes for one block whose context is positions `0..a_j` (the same
//! code as [`kakeya_models::DFlashDrafter::forward`]: both run
//! [`kakeya_models::dflash::DraftWeights::blocks`]).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use kakeya_models::dflash::{BlockGroup, DraftHead, DraftWeights, accepted_drafts};
use kakeya_models::gemma::model::embedding_rows;
use kakeya_models::gpu;
use kakeya_models::linear::Linear;
use kakeya_weights::{DFlashConfig, DraftCheckpoint, HostTensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::data::Sequence;
use crate::error::{Result, TrainError};
use crate::run::{self, Named, Params, storage_dims};

/// Masked-out score (large and finite: every row keeps its own block visible).
const MASKED: f32 = -1e9;

/// Trainable drafter weights, in [`DFlashConfig::expected_tensors`] order, each stored 2-D
/// (`[1, n]` for vectors) without autodiff.
#[derive(Debug, Clone)]
pub struct DrafterParams {
    /// Shape and ids.
    pub config: DFlashConfig,
    /// `(name, PyTorch shape, value)`.
    pub tensors: Named,
    index: HashMap<String, usize>,
}

impl Params for DrafterParams {
    fn tensors(&self) -> &Named {
        &self.tensors
    }

    fn tensors_mut(&mut self) -> &mut Named {
        &mut self.tensors
    }
}

/// The verifier's frozen tensors the drafter borrows: scaled embedding rows are selected from
/// `embed`, logits use `head` (the verifier's tied head, reduced to the draft vocabulary).
#[derive(Debug, Clone)]
pub struct Frozen {
    /// `[vocab, hidden]`, unscaled.
    pub embed: Tensor<2>,
    /// `√hidden`, Gemma's embedding multiplier.
    pub embed_scale: f32,
    /// The runtime's head: the tied embedding, or its rows of the draft vocabulary.
    pub head: DraftHead,
    /// Draft id of each verifier token (`None`: not in the draft vocabulary).
    pub t2d: Vec<Option<u32>>,
}

impl Frozen {
    /// Takes the verifier's embedding and gathers the head rows of `d2t` (`None`: the whole
    /// vocabulary), the head on the training `device` (in row blocks where the whole
    /// vocabulary is larger than one buffer there). The table moves to `device` where it fits
    /// one buffer there, else stays on the host: only a step's block inputs are read from it.
    pub fn new(embed: Tensor<2>, hidden: usize, d2t: Option<&[u32]>, device: &Device) -> Self {
        let [vocab, width] = embed.dims();
        let embed = if gpu::fits_one_buffer(device, (vocab * width * 4) as u64) {
            embed.to_device(device)
        } else {
            embed.to_device(&Device::flex())
        };
        let head = DraftHead::new(
            Linear::Dense(embed.clone()),
            &embed,
            d2t.map(<[u32]>::to_vec),
        )
        .to_device(device);
        Self {
            t2d: head.to_draft(vocab),
            embed,
            embed_scale: (hidden as f32).sqrt(),
            head,
        }
    }

    /// Greedy draft ids per block (`[blocks][B−1]`, verifier ids) from slot logits.
    pub fn greedy(&self, logits: &SlotLogits, slots: usize) -> Vec<Vec<u32>> {
        self.head
            .greedy(logits.0.clone())
            .chunks(slots)
            .map(<[u32]>::to_vec)
            .collect()
    }
}

/// One packed step: the sequences' contexts and their blocks.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Context rows of all sequences, `[Σ len, width]`.
    pub ctx: Vec<f32>,
    /// Per sequence: context rows `(start, len)` and blocks `(start, count)` (block indices).
    pub spans: Vec<((usize, usize), (usize, usize))>,
    /// Anchor position of each block (within its sequence).
    pub anchors: Vec<usize>,
    /// Anchor token of each block.
    pub anchor_tokens: Vec<u32>,
    /// Per block, per slot `1..B`: verifier target id (`None` past the sequence end).
    pub targets: Vec<Vec<Option<u32>>>,
}

impl Batch {
    /// Packs `picks` = `(sequence, anchors)`.
    pub fn build(width: usize, block: usize, picks: &[(&Sequence, Vec<usize>)]) -> Self {
        let mut b = Self {
            ctx: Vec::new(),
            spans: Vec::new(),
            anchors: Vec::new(),
            anchor_tokens: Vec::new(),
            targets: Vec::new(),
        };
        let mut row = 0;
        for (s, anchors) in picks {
            let len = s.len();
            b.ctx.extend_from_slice(&s.aux[..len * width]);
            b.spans.push(((row, len), (b.anchors.len(), anchors.len())));
            row += len;
            for &a in anchors {
                b.anchors.push(a);
                b.anchor_tokens.push(s.tokens[a]);
                b.targets
                    .push((1..block).map(|k| s.tokens.get(a + k).copied()).collect());
            }
        }
        b
    }

    /// Blocks in the batch.
    pub fn blocks(&self) -> usize {
        self.anchors.len()
    }
}

/// What a forward returns: draft logits of slots `1..B` of every block, block-major,
/// `[blocks · (B−1), draft_vocab]`.
pub struct SlotLogits(pub Tensor<2>);

impl DrafterParams {
    /// Fresh weights: linear maps `N(0, 0.02²)`, norm multipliers 1 (seeded).
    pub fn init(config: DFlashConfig, seed: u64, device: &Device) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut tensors = Vec::new();
        for (name, shape) in config.expected_tensors() {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = if shape.len() == 1 {
                vec![1.0; n]
            } else {
                (0..n).map(|_| normal(&mut rng) * 0.02).collect()
            };
            tensors.push((name, shape, data));
        }
        Self::from_host(config, tensors, device)
    }

    /// Builds from tensors in [`DFlashConfig::expected_tensors`] order.
    pub fn from_named(config: DFlashConfig, tensors: Named) -> Self {
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, (n, _, _))| (n.clone(), i))
            .collect();
        Self {
            config,
            tensors,
            index,
        }
    }

    /// Builds from host data in [`DFlashConfig::expected_tensors`] order.
    pub fn from_host(
        config: DFlashConfig,
        tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
        device: &Device,
    ) -> Self {
        let tensors = tensors
            .into_iter()
            .map(|(name, shape, data)| {
                let t = Tensor::from_data(TensorData::new(data, storage_dims(&shape)), device);
                (name, shape, t)
            })
            .collect();
        Self::from_named(config, tensors)
    }

    /// Weights of an exported drafter (the inverse of [`Self::to_checkpoint`]): `fc`'s
    /// columns are multiplied by this data's `input_scales`, because the trainer feeds aux
    /// states divided by them. The checkpoint's shape must be `config`'s; its draft vocabulary
    /// may differ (no trainable tensor depends on it).
    pub fn from_checkpoint(
        config: &DFlashConfig,
        dir: &Path,
        input_scales: &[f32],
        device: &Device,
    ) -> Result<Self> {
        let ck = DraftCheckpoint::load(dir)?;
        let mut theirs = ck.config.clone();
        theirs.draft_vocab_size = config.draft_vocab_size;
        if &theirs != config {
            return Err(TrainError::invalid(
                dir,
                format!(
                    "the drafter to start from has another shape than [model] gives \
                     (layers {}, heads {}/{}, head_dim {}, MLP {}, block {}, target layers {:?}; \
                     [model]: layers {}, heads {}/{}, head_dim {}, MLP {}, block {}, target layers {:?})",
                    theirs.num_hidden_layers,
                    theirs.num_attention_heads,
                    theirs.num_key_value_heads,
                    theirs.head_dim,
                    theirs.intermediate_size,
                    theirs.block_size,
                    theirs.target_layer_ids,
                    config.num_hidden_layers,
                    config.num_attention_heads,
                    config.num_key_value_heads,
                    config.head_dim,
                    config.intermediate_size,
                    config.block_size,
                    config.target_layer_ids,
                ),
            ));
        }
        let mut tensors = Vec::new();
        for (name, shape) in config.expected_tensors() {
            let t = ck.tensors.get(&name).filter(|t| t.shape == shape);
            let Some(t) = t else {
                return Err(TrainError::invalid(
                    dir,
                    format!("tensor {name} {shape:?} is missing or has another shape"),
                ));
            };
            let mut data = t.data.clone();
            if name == "fc.weight" {
                let cols = shape[1];
                if input_scales.len() != cols {
                    return Err(TrainError::invalid(
                        dir,
                        format!("fc has {cols} inputs, the data {}", input_scales.len()),
                    ));
                }
                for row in data.chunks_mut(cols) {
                    for (w, s) in row.iter_mut().zip(input_scales) {
                        *w *= s;
                    }
                }
            }
            tensors.push((name, shape, data));
        }
        Ok(Self::from_host(config.clone(), tensors, device))
    }

    /// Total trainable scalars.
    pub fn count(&self) -> usize {
        run::count(&self.tensors)
    }

    /// Host copies `(name, shape, data)`.
    pub fn to_host(&self) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        self.tensors
            .iter()
            .map(|(n, s, t)| (n.clone(), s.clone(), host(t.clone())))
            .collect()
    }

    /// The drafter in z-lab's checkpoint form (norm weights plain, as Qwen3 stores them), for
    /// raw aux states: `input_scales` (the per-channel divisors the training inputs had, see
    /// [`crate::data::load`]) are folded into `fc`'s columns.
    pub fn to_checkpoint(&self, d2t: Option<Vec<u32>>, input_scales: &[f32]) -> DraftCheckpoint {
        let tensors: BTreeMap<String, HostTensor> = self
            .to_host()
            .into_iter()
            .map(|(n, shape, mut data)| {
                if n == "fc.weight" {
                    let cols = shape[1];
                    assert_eq!(input_scales.len(), cols, "one input scale per fc column");
                    for row in data.chunks_mut(cols) {
                        for (w, s) in row.iter_mut().zip(input_scales) {
                            *w /= s;
                        }
                    }
                }
                (n, HostTensor { shape, data })
            })
            .collect();
        DraftCheckpoint {
            source: "(trained)".into(),
            config: self.config.clone(),
            tensors,
            d2t,
        }
    }

    /// The forward over a packed batch with `weights` (this struct's tensors, or leaves that
    /// track gradients, in the same order).
    ///
    /// # Shapes
    /// - `batch.ctx`: `[Σ len, targets · hidden]`; blocks of `B` slots
    /// - returns `[blocks · (B−1), draft_vocab]`
    pub fn forward(&self, weights: &[Tensor<2>], frozen: &Frozen, batch: &Batch) -> SlotLogits {
        let c = &self.config;
        let device = weights[0].device();
        let constant = |t: Tensor<2>| {
            if device.is_autodiff() {
                t.autodiff()
            } else {
                t
            }
        };
        let drafter = DraftWeights::from_named(c, |name| Ok(weights[self.index[name]].clone()))
            .expect("the parameters hold every drafter tensor");
        let (bsz, hq, hkv) = (c.block_size, c.num_attention_heads, c.num_key_value_heads);
        let nb = batch.blocks();
        let rows = nb * bsz;
        let n_ctx: usize = batch.spans.iter().map(|s| s.0.1).sum();
        let width = c.target_layer_ids.len() * c.hidden_size;

        // Context keys/values of every sequence, as a runtime store holds them.
        let ctx = constant(Tensor::from_data(
            TensorData::new(batch.ctx.clone(), [n_ctx, width]),
            &device,
        ));
        let ctx_kv = drafter.context_rows(c, ctx);

        // Block input: the scaled embedding of [anchor, mask, ..., mask] per block.
        let mut ids = Vec::with_capacity(rows);
        for &t in &batch.anchor_tokens {
            ids.push(t);
            ids.extend(std::iter::repeat_n(c.mask_token_id, bsz - 1));
        }
        let x = constant(embedding_rows(
            &frozen.embed,
            &ids,
            frozen.embed_scale,
            &device.clone().without_autodiff(),
        ));

        // Context rows at their positions, block slots at anchor + k; one group per sequence.
        let mut ctx_pos = Vec::with_capacity(n_ctx);
        for &((_, len), _) in &batch.spans {
            ctx_pos.extend(0..len);
        }
        let blk_pos: Vec<usize> = batch.anchors.iter().flat_map(|&a| a..a + bsz).collect();
        let groups: Vec<BlockGroup> = batch
            .spans
            .iter()
            .map(|&((c0, len), (b0, nblk))| BlockGroup {
                context: c0..c0 + len,
                rows: b0 * bsz..(b0 + nblk) * bsz,
                mask: Some(constant3(
                    block_mask(&batch.anchors[b0..b0 + nblk], len, bsz, hq / hkv),
                    &device,
                )),
            })
            .collect();
        let x = drafter.blocks(c, x, ctx_kv, (&ctx_pos, &blk_pos), &groups);
        // Slots 1..B of every block.
        let keep: Vec<i64> = (0..nb)
            .flat_map(|b| (1..bsz).map(move |k| (b * bsz + k) as i64))
            .collect();
        let keep = Tensor::<1, Int>::from_data(TensorData::new(keep, [nb * (bsz - 1)]), &device);
        SlotLogits(frozen.head.map_weight(constant).logits(x.select(0, keep)))
    }
}

/// Additive mask of one sequence's blocks: row (block `j`, slot) sees context positions
/// `< anchors[j]` and block `j`'s slots, repeated for the `groups` query heads per KV head.
///
/// # Shapes
/// - returns `[1, groups · blocks · B, len + blocks · B]` (host data)
fn block_mask(anchors: &[usize], len: usize, bsz: usize, groups: usize) -> TensorData {
    let t = anchors.len() * bsz;
    let cols = len + t;
    let mut one = vec![MASKED; t * cols];
    for (j, &a) in anchors.iter().enumerate() {
        for s in 0..bsz {
            let row = &mut one[(j * bsz + s) * cols..(j * bsz + s + 1) * cols];
            row[..a.min(len)].fill(0.0);
            row[len + j * bsz..len + (j + 1) * bsz].fill(0.0);
        }
    }
    let mut all = Vec::with_capacity(groups * one.len());
    for _ in 0..groups {
        all.extend_from_slice(&one);
    }
    TensorData::new(all, [1, groups * t, cols])
}

fn constant3(data: TensorData, device: &Device) -> Tensor<3> {
    let t = Tensor::from_data(data, device);
    if device.is_autodiff() {
        t.autodiff()
    } else {
        t
    }
}

/// Weighted cross-entropy of slot logits against the batch's targets and the weights used:
/// slot `k` weighs `exp(-(k-1)/γ)`, targets outside the draft vocabulary or past the sequence
/// weigh 0. Returns `(loss [1], total weight)`.
pub fn weighted_ce(
    logits: &SlotLogits,
    batch: &Batch,
    frozen: &Frozen,
    gamma: f64,
) -> (Tensor<1>, f64) {
    let logits = logits.0.clone();
    let device = logits.device();
    let n = logits.dims()[0];
    let mut idx = Vec::with_capacity(n);
    let mut wts = Vec::with_capacity(n);
    for t in &batch.targets {
        for (k, target) in t.iter().enumerate() {
            let d = target.and_then(|t| frozen.t2d.get(t as usize).copied().flatten());
            idx.push(i64::from(d.unwrap_or(0)));
            wts.push(if d.is_some() {
                (-(k as f64) / gamma).exp() as f32
            } else {
                0.0
            });
        }
    }
    let total: f64 = wts.iter().map(|&w| f64::from(w)).sum();
    let idx = Tensor::<2, Int>::from_data(TensorData::new(idx, [n, 1]), &device);
    let w = Tensor::<2>::from_data(TensorData::new(wts, [n, 1]), &device);
    let w = if device.is_autodiff() {
        w.autodiff()
    } else {
        w
    };
    let nll = log_softmax(logits, 1).gather(1, idx).neg();
    let loss = crate::optim::sum_all(nll * w).mul_scalar(1.0 / total.max(1e-12));
    (loss, total)
}

/// Acceptance of one block under greedy verification: 1 (the verifier's own token) plus the
/// drafts accepted against the targets (the runtime's rule, [`accepted_drafts`]).
pub fn acceptance(drafts: &[u32], targets: &[Option<u32>]) -> usize {
    let truth: Vec<u32> = targets.iter().map_while(|t| *t).collect();
    1 + accepted_drafts(drafts, &truth)
}

/// A host copy of a tensor's values.
pub fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 data")
}

/// A standard normal sample (Box–Muller).
fn normal(rng: &mut StdRng) -> f32 {
    let u1: f64 = rng.random::<f64>().max(1e-300);
    let u2: f64 = rng.random();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_shows_context_before_the_anchor_and_the_own_block_only() {
        let m = block_mask(&[2, 4], 5, 2, 1);
        let v = m.try_to_vec::<f32>().unwrap();
        let cols = 5 + 4;
        let row = |r: usize| -> Vec<bool> { (0..cols).map(|c| v[r * cols + c] == 0.0).collect() };
        // Block 0 (anchor 2): context 0..2, slots 5..7.
        let b0 = vec![true, true, false, false, false, true, true, false, false];
        assert_eq!(row(0), b0);
        assert_eq!(row(1), b0);
        // Block 1 (anchor 4): context 0..4, slots 7..9.
        let b1 = vec![true, true, true, true, false, false, false, true, true];
        assert_eq!(row(2), b1);
        assert_eq!(row(3), b1);
    }

    #[test]
    fn acceptance_counts_the_leading_matches_plus_one() {
        assert_eq!(acceptance(&[5, 6, 7], &[Some(5), Some(6), Some(7)]), 4);
        assert_eq!(acceptance(&[5, 9, 7], &[Some(5), Some(6), Some(7)]), 2);
        assert_eq!(acceptance(&[9, 6, 7], &[Some(5), Some(6), Some(7)]), 1);
        assert_eq!(acceptance(&[5, 6], &[Some(5), None]), 2);
    }
}
