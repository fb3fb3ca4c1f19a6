//! [`Attention::attend`] on the CPU: every query row over exactly the keys it sees, read from
//! the caches' buffers and quantised tiers in place ([`crate::host_attention`]).

use burn::tensor::{Device, Tensor, TensorData};
use rayon::prelude::*;

use super::{Attention, SHARED_ROWS};
use crate::cache::{KvLayers, KvSegment, SegmentKv};
use crate::error::{ModelError, Result};
use crate::host_attention::{self, HostView, KEY_SPAN, RowSource, SourcedKey};
use crate::tree_rows::TreeRows;

/// A key a row reads: its position, its segment, and where its rows are read.
type Keyed = (usize, usize, SourcedKey);

/// One sequence's chunk of query rows on the CPU: the segments' sources and which keys each
/// row reads.
struct HostChunk<'s, 'a> {
    attention: &'s Attention,
    start: usize,
    tree: Option<&'s TreeRows>,
    segments: &'s [KvSegment],
    sources: Vec<RowSource<'a>>,
    q: HostView,
    layer: usize,
}

impl HostChunk<'_, '_> {
    /// May row `i` read key position `p` of segment `src`? In a tree, row `i` sits at its
    /// depth past `start`, and of the chunk's own rows (held at `start + j`) it reads only its
    /// ancestors, each at its depth.
    fn sees(&self, i: usize, src: usize, p: usize) -> bool {
        let reach = self.segments[src].reach;
        match self.tree {
            None => self.attention.sees(self.start + i, (p, reach)),
            Some(tree) => {
                let q = self.start + tree.depth(i);
                if p < self.start {
                    return self.attention.sees(q, (p, reach));
                }
                let j = p - self.start;
                j < tree.len()
                    && tree.sees(i, j)
                    && self.attention.sees(q, (self.start + tree.depth(j), reach))
            }
        }
    }

    /// The keys row `i` reads, in position order: tier rows by position, view rows by index.
    fn seen(&self, i: usize) -> Vec<Keyed> {
        let mut keys: Vec<Keyed> = self
            .segments
            .iter()
            .enumerate()
            .flat_map(|(source, s)| {
                let tier = matches!(s.kv, SegmentKv::Deferred);
                s.positions
                    .iter()
                    .enumerate()
                    .filter(move |&(_, &p)| self.sees(i, source, p))
                    .map(move |(j, &p)| {
                        let row = if tier { p } else { j };
                        (p, source, SourcedKey { source, row })
                    })
            })
            .collect();
        keys.sort_unstable_by_key(|&(p, _, _)| p);
        keys
    }

    /// Row `i` alone into `out` (`heads · head_dim`), over `keyed` (what [`Self::seen`]
    /// gives for it).
    fn row(&self, i: usize, keyed: Vec<Keyed>, out: &mut [f32]) -> Result<()> {
        let keys: Vec<SourcedKey> = keyed.into_iter().map(|k| k.2).collect();
        if keys.is_empty() {
            return Err(ModelError::Cache(format!(
                "layer {}: no key for the query at {}",
                self.layer,
                self.start + i
            )));
        }
        let kv_heads = self.attention.kv_heads;
        let scale = self.attention.scale as f32;
        host_attention::attend_row(&self.q, (i, kv_heads), &self.sources, &keys, scale, out)
    }

    /// How many keys each of `rows` reads when every row reads a prefix of what the last
    /// one reads (a causal chunk over a global layer) and the last reads more than a span:
    /// `None` otherwise, or when sharing would save little.
    fn shared_prefixes(&self, rows: std::ops::Range<usize>, keyed: &[Keyed]) -> Option<Vec<usize>> {
        if rows.len() < 2 || keyed.len() <= KEY_SPAN {
            return None;
        }
        let mut lens = Vec::with_capacity(rows.len());
        for i in rows {
            let n = keyed.iter().take_while(|k| self.sees(i, k.1, k.0)).count();
            let all: usize = (0..self.segments.len())
                .map(|src| {
                    let ps = &self.segments[src].positions;
                    ps.iter().filter(|&&p| self.sees(i, src, p)).count()
                })
                .sum();
            if n == 0 || all != n {
                return None;
            }
            lens.push(n);
        }
        Some(lens)
    }

    /// Rows `rows` into `out` (`[rows.len(), heads · head_dim]`): together when they share
    /// their keys ([`host_attention::attend_rows`]: each tile read once for all of them, the
    /// same bits per row), else row by row in parallel.
    fn rows(&self, rows: std::ops::Range<usize>, out: &mut [f32]) -> Result<()> {
        // The last row's keys: every row's when the rows share them, else its own.
        let keyed = self.seen(rows.end - 1);
        if let Some(lens) = self.shared_prefixes(rows.clone(), &keyed) {
            let keys: Vec<SourcedKey> = keyed.into_iter().map(|k| k.2).collect();
            let first = (rows.start, self.attention.kv_heads);
            let scale = self.attention.scale as f32;
            return host_attention::attend_rows(
                &self.q,
                first,
                &self.sources,
                (&keys, &lens),
                scale,
                out,
            );
        }
        let width = out.len() / rows.len();
        let (before, o_last) = out.split_at_mut(out.len() - width);
        let rest = rows.start..rows.end - 1;
        // A row's bits do not depend on the thread or the other rows.
        let (a, b) = rayon::join(
            || {
                before
                    .par_chunks_mut(width)
                    .zip(rest)
                    .try_for_each(|(o, i)| self.row(i, self.seen(i), o))
            },
            || self.row(rows.end - 1, keyed, o_last),
        );
        a.and(b)
    }
}

impl Attention {
    /// [`Self::attend`] on the CPU: `None` when `q` or a segment does not live in CPU memory
    /// (a GPU, autodiff), or a deferred segment's cache has no [`crate::HostTier`]. Rows run in
    /// blocks of [`SHARED_ROWS`], in parallel.
    ///
    /// # Shapes
    /// - `q`: `[heads, T, head_dim]` → `[T, heads · head_dim]`
    pub(super) fn attend_on_host(
        &self,
        q: &Tensor<3>,
        (start, tree): (usize, Option<&TreeRows>),
        segments: &[KvSegment],
        (caches, layer): (&mut dyn KvLayers, usize),
        device: &Device,
    ) -> Result<Option<Tensor<2>>> {
        let Some(qh) = HostView::of(q) else {
            return Ok(None);
        };
        // A tier's rows are dequantised a tile at a time, once for each block of
        // `SHARED_ROWS` rows that share their keys (a prompt chunk at depth).
        let deferred = segments.iter().any(|s| matches!(s.kv, SegmentKv::Deferred));
        let tier = if deferred {
            match caches.host_tier(layer) {
                Some(t) => Some(t),
                None => return Ok(None),
            }
        } else {
            None
        };
        let mut sources = Vec::with_capacity(segments.len());
        for s in segments {
            sources.push(match (&s.kv, tier) {
                (SegmentKv::Deferred, Some(t)) => RowSource::Tier(t),
                (SegmentKv::Deferred, None) => return Ok(None),
                _ => {
                    let (k, v) = self.ready(s, device);
                    match (HostView::of(&k), HostView::of(&v)) {
                        (Some(k), Some(v)) => RowSource::View { k, v },
                        _ => return Ok(None),
                    }
                }
            });
        }
        let [heads, t, d] = q.dims();
        let chunk = HostChunk {
            attention: self,
            start,
            tree,
            segments,
            sources,
            q: qh,
            layer,
        };
        let width = heads * d;
        let mut out = vec![0.0f32; t * width];
        out.par_chunks_mut(width * SHARED_ROWS)
            .enumerate()
            .try_for_each(|(b, o)| {
                chunk.rows(b * SHARED_ROWS..(b * SHARED_ROWS + o.len() / width), o)
            })?;
        Ok(Some(Tensor::from_data(
            TensorData::new(out, [t, width]),
            device,
        )))
    }
}
