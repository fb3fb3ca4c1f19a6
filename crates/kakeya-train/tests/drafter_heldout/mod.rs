//! The trainer's held-out acceptance recomputed with the runtime: the exported drafter, loaded
//! as `kakeya infer` loads it, drafts greedily at the evaluation's anchors over the captured
//! sequences (used by `train_drafter.rs`).

use std::path::Path;

use burn::tensor::{Tensor, TensorData};
use kakeya_capture::schema::aux_column;
use kakeya_capture::{Dataset, Query};
use kakeya_models::{DFlashDrafter, DraftRequest, GemmaModel};
use kakeya_runtime::CompactStore;
use kakeya_train::DrafterTrainConfig;
use kakeya_weights::DraftCheckpoint;

fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_into_vec::<f32>().unwrap()
}

/// One captured sequence as the dataset stores it: raw aux states (not the trainer's scaled
/// copy), target layers side by side per row.
pub struct Captured {
    pub seq: usize,
    pub tokens: Vec<u32>,
    pub in_prompt: Vec<bool>,
    pub aux: Vec<f32>,
    pub width: usize,
}

impl Captured {
    fn first_gen(&self) -> usize {
        self.in_prompt
            .iter()
            .position(|&p| !p)
            .unwrap_or(self.tokens.len())
    }

    /// Anchors with a generated first target and some context (`max(first_gen, 1) ≤ a ≤
    /// len − 2`, as `Sequence::anchor_range` documents).
    fn anchors(&self) -> std::ops::Range<usize> {
        self.first_gen().max(1)..self.tokens.len().saturating_sub(1)
    }
}

/// Every finished sequence of the dataset at `ds` with the aux columns of `targets`, read
/// directly with the capture reader.
pub fn read_captured(ds: &Path, targets: &[usize]) -> Vec<Captured> {
    let ds = Dataset::open(ds).unwrap();
    let q = Query {
        sequences: None,
        positions: None,
        columns: targets.iter().map(|&l| aux_column(l)).collect(),
    };
    ds.read(&q)
        .unwrap()
        .map(|b| {
            let b = b.unwrap();
            let width: usize = b.columns.iter().map(|c| c.1).sum();
            let mut aux = Vec::with_capacity(b.token.len() * width);
            for p in 0..b.token.len() {
                for (_, dim, data) in &b.columns {
                    aux.extend_from_slice(&data[p * dim..(p + 1) * dim]);
                }
            }
            Captured {
                seq: b.seq,
                tokens: b.token,
                in_prompt: b.in_prompt,
                aux,
                width,
            }
        })
        .collect()
}

/// The documented split: every `every`-th sequence (by dataset id) is held out; sequences
/// without an anchor are dropped. Returns `(train, heldout)`.
pub fn split(all: &[Captured], every: usize) -> (Vec<&Captured>, Vec<&Captured>) {
    let usable = || all.iter().filter(|c| !c.anchors().is_empty());
    (
        usable().filter(|c| c.seq % every != every - 1).collect(),
        usable().filter(|c| c.seq % every == every - 1).collect(),
    )
}

/// What the runtime drafter achieves on the held-out anchors.
pub struct RuntimeEval {
    pub acceptance_length: f64,
    pub per_slot_acceptance: Vec<f64>,
    pub anchors: usize,
    /// Blocks where a slot that decided the acceptance had its top two logits within
    /// [`NEAR_TIE`].
    pub ambiguous: usize,
}

/// Logit gap below which float rounding (training forward vs runtime, < 1e-4) could flip a
/// greedy draft.
const NEAR_TIE: f32 = 1e-3;

/// Greedy drafts of the exported drafter through the runtime (`DFlashDrafter` bound to `v`)
/// at the held-out evaluation's anchors — per held-out sequence the anchors with a full block
/// (`a + B − 1 < len`), all sequences' lists joined and thinned to every
/// `⌈total / eval_anchors⌉`-th — scored as greedy verification against the captured
/// continuation: 1 + the leading drafts equal to the verifier's tokens.
pub fn runtime_heldout_acceptance(
    v: &GemmaModel,
    cfg: &DrafterTrainConfig,
    ds: &Path,
) -> RuntimeEval {
    let drafter =
        DFlashDrafter::from_checkpoint(DraftCheckpoint::load(&cfg.output.export).unwrap(), v)
            .unwrap();
    let all = read_captured(ds, &drafter.config.target_layer_ids);
    let (_, heldout) = split(&all, cfg.data.heldout_every);
    let b = drafter.block_size();
    let hidden = drafter.config.hidden_size;
    let mut anchors: Vec<(&Captured, usize)> = Vec::new();
    for c in &heldout {
        let r = c.anchors();
        anchors.extend(
            r.clone()
                .filter(|&a| a + b - 1 < c.tokens.len())
                .map(|a| (*c, a)),
        );
    }
    let stride = anchors.len().div_ceil(cfg.output.eval_anchors).max(1);
    let chosen: Vec<(&Captured, usize)> = anchors.into_iter().step_by(stride).collect();
    let mut acc_sum = 0usize;
    let mut per_slot = vec![0usize; b - 1];
    let mut ambiguous = 0;
    for &(c, a) in &chosen {
        let w = c.width;
        let context =
            Tensor::<2>::from_data(TensorData::new(c.aux[..a * w].to_vec(), [a, w]), v.device());
        let mut block = vec![drafter.config.mask_token_id; b];
        block[0] = c.tokens[a];
        let mut caches = CompactStore::new(drafter.context_width(), None, v.device());
        let out = drafter
            .forward(
                &DraftRequest {
                    context: Some(context),
                    block: &block,
                    capture_context: false,
                },
                &mut caches,
            )
            .unwrap();
        let drafts = drafter.draft_tokens(out.hidden.clone());
        let matched = drafts
            .iter()
            .zip(&c.tokens[a + 1..a + b])
            .take_while(|(d, t)| d == t)
            .count();
        acc_sum += 1 + matched;
        for n in per_slot.iter_mut().take(matched) {
            *n += 1;
        }
        // Slots 1..=matched+1 decided this block's acceptance.
        let logits = host(drafter.logits(out.hidden.slice([1..b, 0..hidden])));
        let vd = drafter.draft_vocab();
        let close = logits.chunks(vd).take((matched + 1).min(b - 1)).any(|row| {
            let mut top = [f32::NEG_INFINITY; 2];
            for &x in row {
                if x > top[0] {
                    top = [x, top[0]];
                } else if x > top[1] {
                    top[1] = x;
                }
            }
            top[0] - top[1] < NEAR_TIE
        });
        ambiguous += usize::from(close);
    }
    let n = chosen.len().max(1) as f64;
    RuntimeEval {
        acceptance_length: acc_sum as f64 / n,
        per_slot_acceptance: per_slot.iter().map(|&k| k as f64 / n).collect(),
        anchors: chosen.len(),
        ambiguous,
    }
}
