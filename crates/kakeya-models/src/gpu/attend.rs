//! Attention of a few rows on the GPU: over the keys each row sees ([`attention_rows`]), and one
//! sequence's chunk of a stacked forward with its cache written in place ([`span_attention`]).

#[cfg(feature = "cube")]
use super::{DecodeKernels, applies, writes_in_place};
#[cfg(feature = "cube")]
use burn::backend::Dispatch;
use burn::tensor::Tensor;

/// Which keys each row of [`attention_rows`] sees: row `i` the keys `lo + i·dlo .. hi + i·dhi`
/// of the concatenated K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRuns {
    /// Row 0's first key.
    pub lo: usize,
    /// How far each further row's first key moves (0 or 1).
    pub dlo: usize,
    /// Row 0's end (exclusive).
    pub hi: usize,
    /// How far each further row's end moves (0 or 1).
    pub dhi: usize,
}

impl KeyRuns {
    /// The runs in this form when every row's keys are `ranges[i]` and they move by the same
    /// step from row to row; `None` otherwise (or with no rows, or an empty range).
    pub fn from_ranges(ranges: &[std::ops::Range<usize>]) -> Option<Self> {
        let first = ranges.first()?;
        let step = |a: usize, b: usize| b.checked_sub(a).filter(|d| *d <= 1);
        let (dlo, dhi) = match ranges.get(1) {
            Some(r) => (step(first.start, r.start)?, step(first.end, r.end)?),
            None => (0, 0),
        };
        let runs = Self {
            lo: first.start,
            dlo,
            hi: first.end,
            dhi,
        };
        ranges
            .iter()
            .enumerate()
            .all(|(i, r)| {
                r.start == runs.lo + i * dlo && r.end == runs.hi + i * dhi && r.start < r.end
            })
            .then_some(runs)
    }
}

/// The keys each row of [`attention_rows`] sees, as indices into the concatenated K/V in
/// position order.
#[derive(Debug, Clone, Copy)]
pub enum RowKeys<'a> {
    /// Runs moving in step ([`KeyRuns`]): nothing to upload.
    Runs(KeyRuns),
    /// Any keys, listed per row (uploaded with the call).
    Lists(&'a [Vec<usize>]),
}

/// Grouped-query attention of a few rows over the keys each row sees.
///
/// # Shapes
/// - `q`: `[heads, T, d]`; `k`, `v`: `[kv_heads, S, d]` → `[T, heads · d]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn attention_rows(
    q: &Tensor<3>,
    k: &Tensor<3>,
    v: &Tensor<3>,
    scale: f64,
    keys: RowKeys<'_>,
) -> Option<Tensor<2>> {
    on_gpu!(applies(q), {
        let (runs, ids) = match keys {
            RowKeys::Runs(r) => ([r.lo, r.dlo, r.hi, r.dhi], None),
            RowKeys::Lists(lists) => ([0; 4], Some(key_lists(lists, &q.device()))),
        };
        let indexed = ids.is_some();
        // Without lists the kernel reads none: `q` stands in for the unused binding.
        let ids = ids.map_or_else(|| q.clone().into_dispatch(), |t| t.into_dispatch());
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::attention_rows(
            q.clone().into_dispatch(),
            k.clone().into_dispatch(),
            v.clone().into_dispatch(),
            ids,
            scale as f32,
            runs[0],
            runs[1],
            runs[2],
            runs[3],
            indexed,
        ))
    })
}

/// Where one sequence's chunk sits in a stacked forward and how its cache maps positions to
/// slots ([`span_attention`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkSlots {
    /// The chunk's first row of the stacked input.
    pub row0: usize,
    /// Its rows.
    pub t: usize,
    /// Position of its first row.
    pub start: usize,
    /// Position `p` lives in slot `(p − origin) % modulus` of the cache.
    pub origin: usize,
    /// See `origin`.
    pub modulus: usize,
    /// The layer's sliding window; 0 for full attention.
    pub window: usize,
}

/// One sequence's chunk of a stacked forward in one launch: its rows of `k_new`/`v_new`
/// written into the cache buffers `cache` in place, and its rows' attention (each over the
/// positions it sees, up to its own) written into rows `row0..row0 + t` of `out` (`None`: a
/// new output; later chunks of the forward pass it back). The cache buffers must come from
/// [`unique_dense`](super::unique_dense). The kernel reads the chunk's first position from `positions` (the
/// stacked rows' positions from index `first`, as the forward uploaded them: see
/// [`StepInputs`](super::StepInputs)); `at.start` checks the launch. A row's bits equal [`attention_rows`]' over
/// the same keys. `None` off a GPU and with Burn's fusion (whose lazy graph does not see the
/// in-place writes).
///
/// # Shapes
/// - `q`: `[heads, R, d]`; `k_new`, `v_new`: `[kv_heads, R, d]`; `cache`: two
///   `[kv_heads, slots, d]`; `positions.0`: `[n ≥ first + R]` → `[R, heads · d]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
#[allow(clippy::too_many_arguments)]
pub fn span_attention(
    q: &Tensor<3>,
    k_new: &Tensor<3>,
    v_new: &Tensor<3>,
    cache: (&Tensor<3>, &Tensor<3>),
    positions: (&Tensor<1>, usize),
    out: Option<Tensor<2>>,
    scale: f64,
    at: ChunkSlots,
) -> Option<Tensor<2>> {
    on_gpu!(writes_in_place(q), {
        let fresh = out.is_none();
        // A fresh output reads nothing: `q` stands in for the unused binding.
        let out = out.map_or_else(|| q.clone().into_dispatch(), |o| o.into_dispatch());
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::span_attention(
            q.clone().into_dispatch(),
            k_new.clone().into_dispatch(),
            v_new.clone().into_dispatch(),
            cache.0.clone().into_dispatch(),
            cache.1.clone().into_dispatch(),
            positions.0.clone().into_dispatch(),
            positions.1,
            out,
            fresh,
            scale as f32,
            at.row0,
            at.t,
            at.start,
            at.origin,
            at.modulus,
            at.window,
        ))
    })
}

/// Per row its key count, then its key indices, padded to the longest row, as f32 (exact:
/// indices stay far below 2²⁴).
///
/// # Shapes
/// - → `[T, 1 + max count]`
#[cfg(feature = "cube")]
fn key_lists(lists: &[Vec<usize>], device: &burn::tensor::Device) -> Tensor<2> {
    let width = lists.iter().map(Vec::len).max().unwrap_or(0);
    let mut data = vec![0.0f32; lists.len() * (width + 1)];
    for (row, keys) in data.chunks_exact_mut(width + 1).zip(lists) {
        assert!(keys.iter().all(|&k| k < 1 << 24), "key index past 2^24");
        row[0] = keys.len() as f32;
        row[1..=keys.len()]
            .iter_mut()
            .zip(keys)
            .for_each(|(r, &k)| *r = k as f32);
    }
    Tensor::from_data(
        burn::tensor::TensorData::new(data, [lists.len(), width + 1]),
        device,
    )
}
