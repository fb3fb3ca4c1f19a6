//! [`Attention::attend`]'s route for short chunks off the host path (a GPU, autodiff): each
//! query row alone over exactly the keys it sees, in Burn tensor operations.

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::{Attention, as_f32, segment_keys};
use rayon::prelude::*;

use crate::cache::KvSegment;
use crate::sdpa::grouped_attention;

impl Attention {
    /// Each query row alone, over exactly the keys it sees in position order: a row's result
    /// is then the same bits whether it is a decode step or a row of a verify block (one
    /// [`grouped_attention`] over all rows lets the matmuls' sums depend on the row count,
    /// and a causal mask makes the softmax and the value sums run over other lengths). Keys
    /// that form one run of the concatenated segments are a view; others are gathered.
    ///
    /// # Shapes
    /// - `q`: `[heads, T, head_dim]`; `k`, `v`: `[kv_heads, S, head_dim]` (the segments' keys
    ///   in order) → `[T, heads · head_dim]`
    pub(super) fn attend_rows(
        &self,
        q: Tensor<3>,
        start: usize,
        segments: &[KvSegment],
        k: Tensor<3>,
        v: Tensor<3>,
        device: &Device,
    ) -> Tensor<2> {
        let [heads, t, d] = q.dims();
        let [kvh, s, _] = k.dims();
        let keys = segment_keys(segments);
        // Per row, the keys it sees: (position, index in `k`), in position order.
        let seen: Vec<Vec<(usize, usize)>> = (0..t)
            .map(|i| {
                let mut seen: Vec<(usize, usize)> = keys
                    .iter()
                    .enumerate()
                    .filter(|&(_, &key)| self.sees(start + i, key))
                    .map(|(j, &(p, _))| (p, j))
                    .collect();
                seen.sort_unstable();
                seen
            })
            .collect();
        // On a GPU every row takes the attention kernel, so a row's bits never depend on the
        // path: runs moving in step need no upload, other rows' keys are listed.
        if self.on_gpu {
            let runs: Option<Vec<std::ops::Range<usize>>> = seen
                .iter()
                .map(|seen| {
                    let (first, last) = (seen[0].1, seen[seen.len() - 1].1);
                    let run = seen.windows(2).all(|w| w[1].1 == w[0].1 + 1);
                    run.then_some(first..last + 1)
                })
                .collect();
            let lists: Vec<Vec<usize>>;
            let keys = match runs.as_deref().and_then(crate::gpu::KeyRuns::from_ranges) {
                Some(runs) => crate::gpu::RowKeys::Runs(runs),
                None => {
                    lists = seen
                        .iter()
                        .map(|s| s.iter().map(|&(_, j)| j).collect())
                        .collect();
                    crate::gpu::RowKeys::Lists(&lists)
                }
            };
            if let Some(out) = crate::gpu::attention_rows(&q, &k, &v, self.scale, keys) {
                return out;
            }
        }
        // The rows in parallel (each row's bits do not depend on the thread).
        let (k, v) = (as_f32(k), as_f32(v));
        let rows = seen.into_par_iter().enumerate().map(|(i, seen)| {
            let (first, last) = (seen[0].1, seen[seen.len() - 1].1);
            let run = seen.windows(2).all(|w| w[1].1 == w[0].1 + 1);
            let (ki, vi) = if run && first == 0 && last + 1 == s {
                (k.clone(), v.clone())
            } else if run {
                let r = first..last + 1;
                (
                    k.clone().slice([0..kvh, r.clone(), 0..d]),
                    v.clone().slice([0..kvh, r, 0..d]),
                )
            } else {
                let ids: Vec<i64> = seen.iter().map(|&(_, j)| j as i64).collect();
                let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [seen.len()]), device);
                (k.clone().select(1, ids.clone()), v.clone().select(1, ids))
            };
            let qi = if t == 1 {
                q.clone()
            } else {
                q.clone().slice([0..heads, i..i + 1, 0..d])
            };
            grouped_attention(qi, ki, vi, self.scale, None)
        });
        let mut rows: Vec<Tensor<2>> = rows.collect();
        if rows.len() == 1 {
            return rows.pop().expect("one row");
        }
        Tensor::cat(rows, 0)
    }
}
