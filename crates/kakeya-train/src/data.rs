//! Drafter training data: a capture dataset's token ids and aux hidden states, held in memory
//! (f32), split into training and held-out sequences, and the reduced draft vocabulary.

use std::collections::HashMap;
use std::path::Path;

use kakeya_capture::schema::aux_column;
use kakeya_capture::{Dataset, Query};

use crate::error::{Result, TrainError};

/// One captured sequence.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// Index in the dataset.
    pub index: usize,
    /// Token ids (prompt, then the verifier's greedy continuation).
    pub tokens: Vec<u32>,
    /// Position of the first generated token (= prompt length).
    pub first_gen: usize,
    /// Aux hidden states, `[len, targets · hidden]` row-major, target layers in config order.
    pub aux: Vec<f32>,
}

impl Sequence {
    /// Positions.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the sequence has no positions.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Anchors whose first drafted slot has a generated target: `first_gen ≤ a ≤ len − 2`
    /// (and `a ≥ 1`, so there is context).
    pub fn anchor_range(&self) -> std::ops::Range<usize> {
        self.first_gen.max(1)..self.len().saturating_sub(1)
    }
}

/// The split dataset.
#[derive(Debug, Clone)]
pub struct TrainData {
    /// Training sequences.
    pub train: Vec<Sequence>,
    /// Held-out sequences.
    pub heldout: Vec<Sequence>,
    /// Width of one aux row (`targets · hidden`).
    pub width: usize,
    /// Infinite aux values (f16 overflow) saturated to ±65504 (see [`load`]).
    pub saturated: usize,
    /// Per aux channel, the RMS over the training positions that every aux value was divided
    /// by (see [`load`]); the exported `fc` is multiplied back by `1 / scale` per column.
    pub scales: Vec<f32>,
}

/// Largest finite f16.
const F16_MAX: f32 = 65504.0;

/// Checks that the dataset has the aux columns of `targets` and was captured with the verifier
/// whose SHA-256 is `verifier_sha` (and hidden size `hidden`), before anything is trained.
pub fn check_dataset(
    ds: &Dataset,
    dir: &Path,
    targets: &[usize],
    verifier_sha: &str,
    hidden: usize,
) -> Result<()> {
    let m = ds.manifest();
    if m.verifier.sha256 != verifier_sha {
        return Err(TrainError::invalid(
            dir,
            format!(
                "captured with verifier {} (sha256 {}…), not the configured verifier (sha256 {}…); recapture with this verifier",
                m.verifier.path.display(),
                &m.verifier.sha256[..m.verifier.sha256.len().min(12)],
                &verifier_sha[..verifier_sha.len().min(12)]
            ),
        ));
    }
    let missing: Vec<usize> = targets
        .iter()
        .copied()
        .filter(|l| !m.aux_layers.contains(l))
        .collect();
    if !missing.is_empty() {
        return Err(TrainError::invalid(
            dir,
            format!(
                "the dataset has no aux columns for target layer(s) {missing:?} (it has {:?}); recapture with them in tensors.aux_layers",
                m.aux_layers
            ),
        ));
    }
    for c in &m.columns {
        if c.name.starts_with("aux_") && c.dim != hidden {
            return Err(TrainError::invalid(
                dir,
                format!(
                    "column {} is {} wide, the verifier's hidden size is {hidden}",
                    c.name, c.dim
                ),
            ));
        }
    }
    if m.shards.is_empty() {
        return Err(TrainError::invalid(
            dir,
            "the dataset has no finished shard",
        ));
    }
    Ok(())
}

/// Reads every finished sequence with the aux columns of `targets` (in that order) and splits
/// off every `heldout_every`-th one.
///
/// Training reads every aux channel divided by its RMS over the training positions: Gemma's
/// channels differ by four orders of magnitude (a few reach ~3·10⁴ at every position), which
/// would make `fc`'s first steps see one direction only and give Adam steps of wildly
/// different size in output space. The division is folded into the exported `fc`
/// (`fc[:, j] / scale_j`), so the drafter the runtime loads takes the raw states.
///
/// Gemma's residual stream has "massive activations" (e.g. one channel at the `<bos>` position
/// beyond 65504 from the middle layers on), which an f16 capture stores as ±inf. Those values
/// are saturated to ±65504 and counted ([`TrainData::saturated`]): the context row goes
/// through `fc` and an RMSNorm, where such a channel dominates either way. NaN is refused.
pub fn load(ds: &Dataset, targets: &[usize], heldout_every: usize) -> Result<TrainData> {
    let columns: Vec<String> = targets.iter().map(|&l| aux_column(l)).collect();
    let q = Query {
        sequences: None,
        positions: None,
        columns,
    };
    let mut train = Vec::new();
    let mut heldout = Vec::new();
    let mut width = 0;
    let mut saturated = 0;
    for batch in ds.read(&q)? {
        let b = batch?;
        let len = b.token.len();
        let hidden = b.columns.first().map_or(0, |c| c.1);
        width = hidden * targets.len();
        let mut aux = vec![0f32; len * width];
        for (j, (_, dim, data)) in b.columns.iter().enumerate() {
            for p in 0..len {
                aux[p * width + j * dim..p * width + (j + 1) * dim]
                    .copy_from_slice(&data[p * dim..(p + 1) * dim]);
            }
        }
        for v in &mut aux {
            if v.is_nan() {
                return Err(TrainError::invalid(
                    &ds_dir(ds),
                    format!("sequence {} has NaN aux values", b.seq),
                ));
            }
            if v.is_infinite() {
                *v = v.signum() * F16_MAX;
                saturated += 1;
            }
        }
        let first_gen = b.in_prompt.iter().take_while(|&&x| x).count();
        let s = Sequence {
            index: b.seq,
            tokens: b.token,
            first_gen,
            aux,
        };
        if s.anchor_range().is_empty() {
            continue;
        }
        if kakeya_capture::held_out(b.seq, heldout_every) {
            heldout.push(s);
        } else {
            train.push(s);
        }
    }
    let scales = channel_scales(&train, width);
    for seq in train.iter_mut().chain(heldout.iter_mut()) {
        for row in seq.aux.chunks_mut(width.max(1)) {
            for (v, s) in row.iter_mut().zip(&scales) {
                *v /= s;
            }
        }
    }
    if saturated > 0 {
        tracing::warn!(
            "{}: {saturated} infinite aux values (f16 overflow) saturated to ±{F16_MAX}",
            ds_dir(ds).display()
        );
    }
    Ok(TrainData {
        train,
        heldout,
        width,
        saturated,
        scales,
    })
}

/// RMS of every aux channel over the training positions (at least 1e-6).
fn channel_scales(train: &[Sequence], width: usize) -> Vec<f32> {
    let mut sum = vec![0f64; width];
    let mut n = 0usize;
    for s in train {
        for row in s.aux.chunks_exact(width.max(1)) {
            for (a, &v) in sum.iter_mut().zip(row) {
                *a += f64::from(v) * f64::from(v);
            }
            n += 1;
        }
    }
    sum.iter()
        .map(|&a| ((a / n.max(1) as f64).sqrt() as f32).max(1e-6))
        .collect()
}

fn ds_dir(ds: &Dataset) -> std::path::PathBuf {
    ds.dir().to_path_buf()
}

/// The `n` most frequent generated tokens of `seqs` (ties: lower id first), topped up with the
/// lowest unused ids when fewer distinct tokens occur; returned in ascending id order.
pub fn draft_vocab(seqs: &[Sequence], n: usize, vocab: usize) -> Vec<u32> {
    let mut counts: HashMap<u32, u64> = HashMap::new();
    for s in seqs {
        for &t in &s.tokens[s.first_gen..] {
            *counts.entry(t).or_default() += 1;
        }
    }
    let mut by_freq: Vec<(u32, u64)> = counts.into_iter().collect();
    by_freq.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut chosen: Vec<u32> = by_freq.iter().take(n).map(|&(t, _)| t).collect();
    let mut taken: std::collections::HashSet<u32> = chosen.iter().copied().collect();
    let mut next = 0u32;
    while chosen.len() < n.min(vocab) {
        if taken.insert(next) {
            chosen.push(next);
        }
        next += 1;
    }
    chosen.sort_unstable();
    chosen
}

/// Share of generated tokens of `seqs` that `d2t` covers.
pub fn coverage(seqs: &[Sequence], d2t: &[u32]) -> f64 {
    let set: std::collections::HashSet<u32> = d2t.iter().copied().collect();
    let (mut hit, mut all) = (0usize, 0usize);
    for s in seqs {
        for t in &s.tokens[s.first_gen..] {
            all += 1;
            hit += usize::from(set.contains(t));
        }
    }
    if all == 0 {
        1.0
    } else {
        hit as f64 / all as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(tokens: Vec<u32>, first_gen: usize) -> Sequence {
        Sequence {
            index: 0,
            tokens,
            first_gen,
            aux: Vec::new(),
        }
    }

    #[test]
    fn draft_vocab_takes_generated_tokens_by_frequency_then_fills_by_id() {
        // Prompt tokens (9, 9, 9) are not counted.
        let s = [seq(vec![9, 9, 9, 7, 7, 7, 5, 5, 3], 3)];
        assert_eq!(draft_vocab(&s, 2, 100), vec![5, 7]);
        assert_eq!(draft_vocab(&s, 3, 100), vec![3, 5, 7]);
        assert_eq!(draft_vocab(&s, 5, 100), vec![0, 1, 3, 5, 7]);
        assert!((coverage(&s, &[5, 7]) - 5.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn anchors_start_at_the_first_generated_token_and_leave_one_target() {
        assert_eq!(seq(vec![1; 10], 4).anchor_range(), 4..9);
        assert_eq!(seq(vec![1; 10], 0).anchor_range(), 1..9);
        assert!(seq(vec![1; 5], 5).anchor_range().is_empty());
    }
}
