//! Drafts recorded once and replayed on a GPU ([`DFlashDrafter::draft`]). A drafter forward
//! issues ~90 launches (two layers of Burn's ops, the head, the argmax), and a GPU is bound
//! by issuing them, as the verifier's decode steps were (`docs/gpu.md`). Recorded, a draft is
//! one small upload, one replay and one copy of the draft ids.
//!
//! The context grows by the committed rows at every block, so a draft does not attend over
//! `store.len()` keys but over the store's whole buffers ([`DraftContext::device_rows`],
//! grown by doubling), masked past the length the draft reads from its input buffer: the
//! block's ids, its positions and the context's length are the only values that change
//! between replays ([`StepInputs`]). The context keys' RoPE rows are the device table's
//! first rows, the block's are gathered from it there. A recording is keyed by the block's
//! rows, the store's buffers (CubeCL never reuses an allocation's id, so a store that grew or
//! was copied on a fork's write records anew) and the RoPE table's size.
//!
//! Masked keys add nothing (`exp` of −10³⁰ below the row's largest score is 0), but the
//! softmax sums more terms, so a replayed draft's logits may differ from the issued draft's in
//! the last bits: drafts only propose, and verification decides what is committed either way.
//!
//! The store's new rows (the committed positions' context projection,
//! [`DFlashDrafter::append_context`]) are recorded too, per row count: projected by the same
//! launches as [`DFlashDrafter::context_rows`] and written into the store's buffers from the
//! row its length gives, read on the device ([`gpu::put_rows`]): the same bits as an append.

use burn::tensor::{Tensor, TensorData};

use super::core::{BlockGroup, BlockRopes};
use super::model::DFlashDrafter;
use crate::cache::DraftContext;
use crate::error::{ModelError, Result};
use crate::gpu::{self, DeviceGraph, GPU_ROWS_MAX, ReplayStats, StepInputs};
use crate::rope::Rope;

/// Added to the scores of keys past the context's length.
const MASKED: f32 = -1e30;

/// Most rows an append records (a speculative block commits at most [`GPU_ROWS_MAX`]; a
/// prompt's or a backlog's rows are one-off counts, issued).
const APPEND_ROWS_MAX: usize = GPU_ROWS_MAX;

/// What a draft must match to replay a recording.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Key {
    /// Block rows, anchor included.
    rows: usize,
    /// The store's K and V allocations ([`gpu::buffer_of`]) and their rows.
    k: (usize, u64),
    v: (usize, u64),
    capacity: usize,
    /// The device RoPE table's positions.
    rope: usize,
}

/// One recorded draft: the buffers it reads (its inputs, the key indices) and writes (ids).
pub(crate) struct Recorded {
    graph: DeviceGraph,
    inputs: StepInputs,
    /// Held so that its buffer outlives the recording: `[capacity + rows]`.
    _key_index: Tensor<1>,
    /// Draft-vocabulary ids of block rows `1..`, as f32: `[rows − 1]`.
    ids: Tensor<1>,
}

/// A drafter's recorded drafts.
pub(crate) type Replayer = gpu::Recorder<Key, Recorded>;

/// What an append of store rows must match to replay a recording.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AppendKey {
    /// Rows appended, and the width of the hidden states they come from.
    rows: usize,
    width: usize,
    /// The store's K and V allocations and their rows.
    k: (usize, u64),
    v: (usize, u64),
    capacity: usize,
}

/// One recorded append: the buffers it reads (the hidden states, the first row's index).
pub(crate) struct AppendRecorded {
    graph: DeviceGraph,
    context: Tensor<2>,
    at: Tensor<1>,
}

/// A drafter's recorded appends.
pub(crate) type AppendReplayer = gpu::Recorder<AppendKey, AppendRecorded>;

impl DFlashDrafter {
    /// Greedy drafts for block slots `1..B` (as [`Self::draft_tokens`] of [`Self::forward`]'s
    /// hidden states, with no new context rows), as verifier token ids: on a GPU replayed from
    /// a recording where one fits ([`Self::record_drafts`]; see the module's doc), else issued.
    ///
    /// # Shapes
    /// - `block`: `B` ids at positions `L..L+B`, `L = store.len()` → `B − 1` ids
    pub fn draft(&self, block: &[u32], store: &mut dyn DraftContext) -> Result<Vec<u32>> {
        if let Some(ids) = self.replayed(block, &*store)? {
            return Ok(ids);
        }
        let out = self.forward(
            &super::DraftRequest {
                context: None,
                block,
                capture_context: false,
            },
            store,
        )?;
        Ok(self.draft_tokens(out.hidden))
    }

    /// Appends the store rows of the positions `store.len()..` whose verifier hidden states
    /// are `context` (as [`Self::context_rows`] then [`DraftContext::append`]): on a GPU
    /// replayed from a recording where one fits (see the module's doc), else issued.
    ///
    /// # Shapes
    /// - `context`: `[n, targets · hidden]`
    pub fn append_context(&self, context: Tensor<2>, store: &mut dyn DraftContext) -> Result<()> {
        if self.appended_in_place(&context, store)? {
            return Ok(());
        }
        let (k, v) = self.context_rows(context)?;
        store.append(k, v)
    }

    /// How this drafter's appends of store rows ran on a GPU so far.
    pub fn append_replay_stats(&self) -> ReplayStats {
        self.gpu
            .as_ref()
            .map_or_else(ReplayStats::default, |g| g.append_replayer.lock().stats)
    }

    /// An append replayed, or recorded now; `Ok(false)` where it is not (the caller issues
    /// it): see [`Self::replays_drafts`], more than [`APPEND_ROWS_MAX`] rows, a store not
    /// held in device buffers, a key's first sighting.
    fn appended_in_place(&self, context: &Tensor<2>, store: &mut dyn DraftContext) -> Result<bool> {
        let [n, width] = context.dims();
        let c = &self.config;
        if n == 0
            || n > APPEND_ROWS_MAX
            || width != c.target_layer_ids.len() * c.hidden_size
            || !self.replays_drafts()
        {
            return Ok(false);
        }
        let len = store.len();
        let Some((kb, vb)) = store.reserve_on_device(n) else {
            return Ok(false);
        };
        let Some((k, v)) = allocations(&kb, &vb) else {
            return Ok(false);
        };
        let Some(gpu) = &self.gpu else {
            return Ok(false);
        };
        let mut state = gpu.append_replayer.lock();
        if !state.begin() {
            return Ok(false);
        }
        let key = AppendKey {
            rows: n,
            width,
            k,
            v,
            capacity: kb.dims()[0],
        };
        let at = || Tensor::<1>::from_data(TensorData::new(vec![len as f32], [1]), &self.device);
        if let Some(r) = state.find(&key) {
            gpu::copy_into(&r.context, context).expect("replays run on a GPU");
            gpu::copy_into(&r.at, &at()).expect("replays run on a GPU");
            replay(&r.graph)?;
            state.stats.replayed += 1;
            drop((kb, vb));
            store.written_in_place(n)?;
            return Ok(true);
        }
        if !state.second_sighting(key.clone()) {
            return Ok(false);
        }
        // The recording reads the hidden states and the first row's index from buffers of its
        // own, rewritten before each replay (a clone is never its buffer's only holder: this
        // copies).
        let inputs = (gpu::unique_dense(context.clone()), at());
        let (graph, ()) = DeviceGraph::record(&self.device, || {
            let (k, v) = self.weights.context_rows(c, inputs.0.clone());
            let no_gpu = || ModelError::Input("a recorded append needs a GPU".into());
            gpu::put_rows(&kb, &k, &inputs.1, 0).ok_or_else(no_gpu)?;
            gpu::put_rows(&vb, &v, &inputs.1, 0).ok_or_else(no_gpu)
        })?;
        match graph {
            Some(graph) => {
                // The recorded run's launches were only recorded: run them.
                replay(&graph)?;
                state.insert(
                    key,
                    AppendRecorded {
                        graph,
                        context: inputs.0,
                        at: inputs.1,
                    },
                );
            }
            None => {
                // The device ran the last run instead of recording it: the rows are written,
                // and this device records nothing.
                state.records_nothing();
            }
        }
        drop((kb, vb));
        store.written_in_place(n)?;
        Ok(true)
    }

    /// How this drafter's drafts ran on a GPU so far.
    pub fn replay_stats(&self) -> ReplayStats {
        self.gpu
            .as_ref()
            .map_or_else(ReplayStats::default, |g| g.replayer.lock().stats)
    }

    /// Whether drafts can be recorded: on a GPU whose kernels write in place (not under Burn's
    /// fusion), with no sliding layers (their masks are built on the host), unless
    /// [`Self::record_drafts`] is off.
    pub fn replays_drafts(&self) -> bool {
        self.record_drafts
            && gpu::writes_in_place(self.weights.norm_scale())
            && self.config.layer_windows.iter().all(Option::is_none)
    }

    /// A draft replayed, or recorded now; `Ok(None)` where it is not (the caller issues it):
    /// see [`Self::replays_drafts`], a block of one row or more than [`GPU_ROWS_MAX`], a store
    /// not held in device buffers, a key's first sighting.
    fn replayed(&self, block: &[u32], store: &dyn DraftContext) -> Result<Option<Vec<u32>>> {
        let b = block.len();
        let len = store.len();
        if !(2..=GPU_ROWS_MAX).contains(&b) || len == 0 || !self.replays_drafts() {
            return Ok(None);
        }
        if let Some(&bad) = block
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(ModelError::Input(format!(
                "block token {bad} is outside the vocabulary of {}",
                self.config.vocab_size
            )));
        }
        let Some((ck, cv)) = store.device_rows() else {
            return Ok(None);
        };
        let capacity = ck.dims()[0];
        let Some((k, v)) = allocations(&ck, &cv) else {
            return Ok(None);
        };
        let Some(gpu) = &self.gpu else {
            return Ok(None);
        };
        let mut state = gpu.replayer.lock();
        if !state.begin() {
            return Ok(None);
        }
        let rope = Rope::new(self.config.head_dim, self.config.rope_theta, 1.0);
        let table = gpu
            .rope
            .table(0, &rope, capacity.max(len + b), &self.device);
        let key = Key {
            rows: b,
            k,
            v,
            capacity,
            rope: table.dims()[1],
        };
        let positions: Vec<usize> = (len..len + b).collect();
        let upload = || StepInputs::upload_with(block, &positions, &[len as f32], &self.device);
        if let Some(r) = state.find(&key) {
            let fresh = upload();
            gpu::copy_into(&r.inputs.buf, &fresh.buf).expect("replays run on a GPU");
            replay(&r.graph)?;
            let ids = self.draft_ids_of(&r.ids);
            state.stats.replayed += 1;
            return ids.map(Some);
        }
        if !state.second_sighting(key.clone()) {
            return Ok(None);
        }
        let inputs = upload();
        // Key `j`'s index: `j` for the context's rows, −1 (never masked) for the block's.
        let index: Vec<f32> = (0..capacity)
            .map(|j| j as f32)
            .chain(std::iter::repeat_n(-1.0, b))
            .collect();
        let key_index = Tensor::from_data(TensorData::new(index, [capacity + b]), &self.device);
        let (graph, ids) = DeviceGraph::record(&self.device, || {
            self.drafted_on_device(&inputs, &key_index, (ck.clone(), cv.clone()), &table)
        })?;
        let Some(graph) = graph else {
            // The device ran the last run instead of recording it: its ids are real, and
            // this device records nothing.
            state.records_nothing();
            return self.draft_ids_of(&ids).map(Some);
        };
        let r = Recorded {
            graph,
            inputs,
            _key_index: key_index,
            ids,
        };
        // The recorded run's launches were only recorded: run them.
        replay(&r.graph)?;
        let ids = self.draft_ids_of(&r.ids);
        state.insert(key, r);
        ids.map(Some)
    }

    /// The draft as a recording holds it: block rows from `inputs` (ids, positions, then the
    /// context's length), attending over the whole store buffers with keys at or past the
    /// length masked; the draft-vocabulary argmax of rows `1..` left on the device.
    ///
    /// # Shapes
    /// - `inputs`: `B` rows and one extra value; `key_index`: `[capacity + B]`
    /// - `ck`, `cv`: `[capacity, layers · kv_heads · head_dim]`; `table`: `[2, ≥ capacity, d/2]`
    /// - → `[B − 1]` ids as f32
    fn drafted_on_device(
        &self,
        inputs: &StepInputs,
        key_index: &Tensor<1>,
        (ck, cv): (Tensor<2>, Tensor<2>),
        table: &Tensor<3>,
    ) -> Result<Tensor<1>> {
        let no_gpu = || ModelError::Input("a recorded draft needs a GPU".into());
        let c = &self.config;
        let (b, capacity) = (inputs.rows, ck.dims()[0]);
        let x = inputs
            .embed(&self.embed_blocks, self.embed_scale)
            .ok_or_else(no_gpu)?;
        let half = table.dims()[2];
        let plane = |p: usize| {
            table
                .clone()
                .slice([p..p + 1, 0..capacity, 0..half])
                .reshape([capacity, half])
        };
        let ropes = BlockRopes {
            context: (plane(0), plane(1)),
            block: inputs.rope(table).ok_or_else(no_gpu)?,
        };
        // (index − length + 1) clamped to [0, 1]: 1 exactly at the context's rows past its
        // length, 0 at the rest and at the block's rows.
        let past = (key_index.clone() - inputs.extra(0, 1))
            .add_scalar(1.0)
            .clamp(0.0, 1.0);
        let mask = past.mul_scalar(MASKED).reshape([1, 1, capacity + b]);
        let group = BlockGroup {
            context: 0..capacity,
            rows: 0..b,
            mask: None,
        };
        let masks = vec![vec![Some(mask)]; self.weights.num_layers()];
        let hidden = self
            .weights
            .layers_over(c, x, (ck, cv), &ropes, &[group], &masks);
        let w = hidden.dims()[1];
        let logits = self.logits(hidden.slice([1..b, 0..w]));
        gpu::argmax_on_device(&logits).ok_or_else(no_gpu)
    }

    /// Verifier ids of the draft-vocabulary ids a recording left on the device.
    fn draft_ids_of(&self, ids: &Tensor<1>) -> Result<Vec<u32>> {
        let ids = ids
            .clone()
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| ModelError::Input(format!("draft ids: {e:?}")))?;
        Ok(ids
            .into_iter()
            .map(|i| self.to_target(i as usize))
            .collect())
    }
}

/// The allocations of a store's K and V buffers ([`gpu::buffer_of`]): part of a recording's
/// key.
fn allocations(k: &Tensor<2>, v: &Tensor<2>) -> Option<((usize, u64), (usize, u64))> {
    Some((gpu::buffer_of(k)?, gpu::buffer_of(v)?))
}

/// Replays `graph`. Its buffers are alive: the weights and RoPE table the drafter holds, the
/// inputs, key indices and ids the recording holds, and the store's buffers (a store that
/// reallocated changes the key and records anew; a recording whose store was freed is never
/// matched again: CubeCL never reuses an allocation's id); nothing else runs on the device's
/// stream meanwhile (the caller's thread issues every call, under the recordings' lock).
fn replay(graph: &DeviceGraph) -> Result<()> {
    #[allow(unsafe_code)] // see the function's doc
    // SAFETY: as documented above.
    unsafe { graph.replay() }.map_err(|e| ModelError::Input(format!("draft replay: {e}")))
}
