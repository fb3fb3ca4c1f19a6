//! The LM head the drafter scores with: the verifier's tied head, or its rows for a reduced
//! draft vocabulary; the drafts' ids and greedy choices through it.

use burn::tensor::{Int, Tensor, TensorData};

use crate::linear::Linear;

/// The LM head the drafter scores with.
#[derive(Debug, Clone)]
pub enum DraftHead {
    /// The verifier's whole tied head.
    Verifier(Linear),
    /// Rows of the verifier's embedding for a reduced draft vocabulary.
    Reduced {
        /// `[draft_vocab, hidden]`.
        head: Linear,
        /// Verifier token id of each draft id.
        d2t: Vec<u32>,
    },
}

impl DraftHead {
    /// The verifier's `head` for the whole vocabulary, or the rows `d2t` of its (tied)
    /// embedding `[vocab, hidden]`. A reduced head keeps the CPU kernels' copy of its rows:
    /// the head's GGUF blocks (the same values, ready for the certified argmax) or, for a
    /// dense head, the row-order kernel's.
    pub fn new(head: Linear, embed: &Tensor<2>, d2t: Option<Vec<u32>>) -> Self {
        match d2t {
            None => Self::Verifier(head),
            Some(d2t) => {
                let ids: Vec<i64> = d2t.iter().map(|&t| i64::from(t)).collect();
                let ids =
                    Tensor::<1, Int>::from_data(TensorData::new(ids, [d2t.len()]), &embed.device());
                let quant = head.quant_matrix().and_then(|q| q.select_rows(&d2t));
                // On the head's device (the table may be on the host: `Linear::within`).
                let reduced = Linear::Dense(embed.clone().select(0, ids).to_device(&head.device()));
                let head = match quant {
                    Some(quant) => {
                        quant.prepare(true, false);
                        Linear::quant(quant)
                    }
                    None if matches!(head, Linear::HostRows { .. }) => reduced.with_host_rows(),
                    None => reduced,
                };
                Self::Reduced { head, d2t }
            }
        }
    }

    /// The same head with its weight passed through `f` (e.g. lifted into autodiff): each
    /// row block's where it is held in blocks ([`Linear::within`]).
    pub fn map_weight(&self, mut f: impl FnMut(Tensor<2>) -> Tensor<2>) -> Self {
        let mut map = |h: &Linear| match h {
            Linear::RowBlocks { blocks, host } => Linear::RowBlocks {
                blocks: blocks.iter().cloned().map(&mut f).collect(),
                host: host.clone(),
            },
            whole => Linear::Dense(f(whole.dense_weight())),
        };
        match self {
            Self::Verifier(h) => Self::Verifier(map(h)),
            Self::Reduced { head, d2t } => Self::Reduced {
                head: map(head),
                d2t: d2t.clone(),
            },
        }
    }

    /// The same head on `device` ([`Linear::to_device`]: in row blocks where it is larger
    /// than one buffer there).
    pub fn to_device(self, device: &burn::tensor::Device) -> Self {
        match self {
            Self::Verifier(h) => Self::Verifier(h.to_device(device)),
            Self::Reduced { head, d2t } => Self::Reduced {
                head: head.to_device(device),
                d2t,
            },
        }
    }

    /// Size of the vocabulary scored.
    pub fn vocab(&self) -> usize {
        match self {
            Self::Verifier(h) => h.dims()[0],
            Self::Reduced { d2t, .. } => d2t.len(),
        }
    }

    /// The draft-vocabulary map, when reduced.
    pub fn d2t(&self) -> Option<&[u32]> {
        match self {
            Self::Verifier(_) => None,
            Self::Reduced { d2t, .. } => Some(d2t),
        }
    }

    /// Verifier token id of a draft-vocabulary id.
    pub fn to_target(&self, draft_id: usize) -> u32 {
        self.d2t().map_or(draft_id as u32, |m| m[draft_id])
    }

    /// Draft id of each verifier token (`None`: outside the draft vocabulary).
    pub fn to_draft(&self, vocab: usize) -> Vec<Option<u32>> {
        match self.d2t() {
            None => (0..vocab as u32).map(Some).collect(),
            Some(map) => {
                let mut t2d = vec![None; vocab];
                for (d, &t) in map.iter().enumerate() {
                    t2d[t as usize] = Some(d as u32);
                }
                t2d
            }
        }
    }

    /// Bytes this head holds of its own (a reduced head's rows and map; the verifier's head
    /// is shared, 0).
    pub fn nbytes(&self) -> usize {
        match self {
            Self::Verifier(_) => 0,
            Self::Reduced { head, d2t } => head.nbytes() + d2t.len() * 4,
        }
    }

    /// Draft-vocabulary logits.
    ///
    /// # Shapes
    /// - `hidden`: `[n, hidden]` (final-normed) → `[n, vocab]`
    pub fn logits(&self, hidden: Tensor<2>) -> Tensor<2> {
        match self {
            Self::Verifier(h) | Self::Reduced { head: h, .. } => h.forward(hidden),
        }
    }

    /// The greedy choice of each row of final-normed hidden states, as verifier token ids:
    /// the head's certified argmax where it applies (no logits made), else [`Self::greedy`]
    /// of [`Self::logits`] — the same ids either way.
    ///
    /// # Shapes
    /// - `hidden`: `[n, hidden]` → `n` ids
    pub fn draft_ids(&self, hidden: Tensor<2>) -> Vec<u32> {
        let (Self::Verifier(h) | Self::Reduced { head: h, .. }) = self;
        match h.argmax(&hidden) {
            Some(ids) => ids
                .into_iter()
                .map(|i| self.to_target(i as usize))
                .collect(),
            None => self.greedy(self.logits(hidden)),
        }
    }

    /// The greedy choice of each row, as verifier token ids.
    ///
    /// # Shapes
    /// - `logits`: `[n, vocab]` → `n` ids
    pub fn greedy(&self, logits: Tensor<2>) -> Vec<u32> {
        if let Some(ids) = crate::gpu::argmax_rows(&logits) {
            return ids
                .into_iter()
                .map(|i| self.to_target(i as usize))
                .collect();
        }
        logits
            .argmax(1)
            .into_data()
            .convert::<i64>()
            .try_into_vec::<i64>()
            .expect("argmax ids")
            .into_iter()
            .map(|i| self.to_target(i as usize))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::DraftHead;

    /// A reduced head cut from a GGUF head keeps its blocks, and its drafts (the certified
    /// argmax, no logits) are exactly the greedy choices of its logits.
    #[test]
    fn a_reduced_quantised_head_drafts_the_argmax_of_its_logits() {
        use burn::tensor::{Tensor, TensorData};

        let dev = burn::tensor::Device::flex();
        let (vocab, hidden) = (96, 64);
        let head = crate::testing::random_q8_0_linear(vocab, hidden, 0.5, 7);
        let embed = head.dense_weight();
        let d2t: Vec<u32> = (0..vocab as u32).rev().step_by(3).collect();
        let reduced = DraftHead::new(head, &embed, Some(d2t));
        let DraftHead::Reduced { head: h, .. } = &reduced else {
            panic!("a reduced head")
        };
        assert!(
            h.quant_matrix().is_some(),
            "the reduced head keeps GGUF blocks"
        );
        let x: Vec<f32> = (0..5 * hidden)
            .map(|i| ((i * 37 + 11) % 41) as f32 * 0.05 - 1.0)
            .collect();
        let x = Tensor::<2>::from_data(TensorData::new(x, [5, hidden]), &dev);
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            assert!(h.argmax(&x).is_some(), "the certified argmax applies");
        }
        let ids = reduced.draft_ids(x.clone());
        assert_eq!(ids, reduced.greedy(reduced.logits(x)));
        assert_eq!(ids.len(), 5);
    }
}
