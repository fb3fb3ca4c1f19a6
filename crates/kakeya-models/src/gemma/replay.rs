//! Greedy and sampled forwards (their choices drawn on the device) recorded once and replayed
//! on a GPU: decode steps, speculative verify blocks, and the server's batched steps of several
//! sequences ([`GemmaModel::forward_batch`]
//! takes this path by itself). A decode step of the 270M model issues about two hundred
//! kernel launches, and issuing them costs more than the kernels themselves (`docs/gpu.md`).
//! Recorded, a forward is one replay (a CUDA graph) plus one small upload and
//! one copy.
//!
//! What a replay must find where the recording left it: the token ids and positions (and a
//! sampled forward's uniforms) in one device buffer ([`StepInputs`], rewritten before each
//! replay), which the recorded kernels
//! read (the embedding and RoPE rows gathered there, the attention's first positions); the
//! caches' buffers, written in place by the recorded attention while the host only advances
//! their lengths ([`GemmaModel::advance_in_place`]); the device RoPE tables; and the greedy
//! ids and requested hidden states, left on the device until the replay ran. A recording is
//! keyed by each request's rows and wanted rows, the caches' allocations (CubeCL never reuses
//! an id), and the tables' sizes: a full cache doubling, a ring filling, a fork's copy on
//! write, another set of sequences, or a table growing records anew. A forward the caches
//! cannot take in place (the bounded modes' tiers) is issued launch by launch. A key is
//! recorded the second time it is seen (recording costs four runs of the forward: a one-off
//! prompt chunk or a set of sequences that lasts one step is not worth it).

use burn::tensor::Tensor;

use super::device::CacheBuffers;
use super::model::{ForwardOutput, ForwardRequest, GemmaModel, Logits};
use crate::cache::KvLayers;
use crate::choice::Choice;
use crate::error::{ModelError, Result};
pub use crate::gpu::ReplayStats;
use crate::gpu::{self, DeviceGraph, GPU_ROWS_MAX, StepInputs};

/// What a request's head launches: its rows and its [`Choice`] without a draw's seed (the
/// draws' uniforms are inputs, copied in before each replay; the rest is baked into the
/// launches).
fn launched(req: &ForwardRequest<'_>) -> (Logits, Option<Choice>) {
    let choice = req.choice.map(|c| match c {
        Choice::Draw(d) => Choice::Draw(crate::Draw { seed: 0, ..d }),
        greedy => greedy,
    });
    (req.logits, choice)
}

/// What a forward must match to replay a recording.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Key {
    /// Per request: its rows and what its head launches ([`launched`]).
    rows: Vec<(usize, (Logits, Option<Choice>))>,
    hidden_after: Vec<usize>,
    /// Per request, each layer cache's slots and buffers.
    caches: Vec<Vec<CacheBuffers>>,
    /// The device RoPE tables' positions.
    rope: [usize; 2],
}

/// One recorded forward, the buffer it reads its ids and positions from, and its outputs.
pub(crate) struct Recorded {
    graph: DeviceGraph,
    inputs: StepInputs,
    ids: Tensor<1>,
    hidden: Vec<Tensor<2>>,
}

/// A model's recorded forwards.
pub(crate) type Replayer = gpu::Recorder<Key, Recorded>;

impl GemmaModel {
    /// How this model's greedy forwards ran on a GPU so far.
    pub fn replay_stats(&self) -> ReplayStats {
        self.backend
            .gpu()
            .map_or_else(ReplayStats::default, |g| g.replayer.lock().stats)
    }

    /// [`Self::forward_batch`] replayed from a recording, or recorded now; `Ok(None)` where it
    /// is not (the caller issues it): off a recording device ([`Self::replays_decode`]),
    /// logits other than the greedy choices or draws, attention captures, more than [`GPU_ROWS_MAX`]
    /// rows, a key's first sighting, caches that are not plain buffers. The outputs are the
    /// issued forward's, bit for bit (the same kernels on the same inputs).
    pub(super) fn replayed(
        &self,
        reqs: &[ForwardRequest<'_>],
        kvs: &mut [&mut dyn KvLayers],
    ) -> Result<Option<Vec<ForwardOutput>>> {
        let chosen = reqs.iter().all(ForwardRequest::chosen_on_device);
        let total: usize = reqs.iter().map(|r| r.tokens.len()).sum();
        if !chosen
            || reqs.iter().any(|r| r.capture_attention)
            || total > GPU_ROWS_MAX
            || !self.replays_decode()
        {
            return Ok(None);
        }
        let Some(gpu) = self.backend.gpu() else {
            return Ok(None);
        };
        let mut state = gpu.replayer.lock();
        if !state.begin() {
            return Ok(None);
        }
        self.check_batch(reqs, kvs)?;
        let reach = reqs.iter().map(|r| r.start + r.tokens.len()).max();
        let rope = self.ensure_device_rope(reach.unwrap_or(0));
        // Each sequence's caches back at its start (a no-op for those not advanced yet).
        let truncate_all = |kvs: &mut [&mut dyn KvLayers]| -> Result<()> {
            for (r, kv) in reqs.iter().zip(kvs.iter_mut()) {
                kv.truncate(r.start)?;
            }
            Ok(())
        };
        let mut caches = Vec::with_capacity(reqs.len());
        for (req, kv) in reqs.iter().zip(kvs.iter_mut()) {
            match self.advance_in_place(&mut **kv, req.start, req.tokens.len()) {
                Some(c) => caches.push(c),
                None => {
                    // Not plain buffers (a bounded mode's tiers): put back what advanced.
                    truncate_all(kvs)?;
                    state.stats.declined += 1;
                    return Ok(None);
                }
            }
        }
        let key = Key {
            rows: reqs.iter().map(|r| (r.tokens.len(), launched(r))).collect(),
            hidden_after: reqs[0].hidden_after.to_vec(),
            caches,
            rope,
        };
        let (tokens, positions): (Vec<u32>, Vec<usize>) = reqs
            .iter()
            .flat_map(|r| r.tokens.iter().copied().zip(r.start..))
            .unzip();
        let uniforms = Self::uniforms_of(reqs);
        let upload = || StepInputs::upload_with(&tokens, &positions, &uniforms, &self.device);
        if let Some(r) = state.find(&key) {
            let fresh = upload();
            gpu::copy_into(&r.inputs.buf, &fresh.buf).expect("replays run on a GPU");
            replay(&r.graph)?;
            let out = outputs(reqs, &r.ids, &r.hidden);
            state.stats.replayed += 1;
            return out.map(Some);
        }
        truncate_all(kvs)?;
        if !state.second_sighting(key.clone()) {
            return Ok(None);
        }
        // Recorded: the caches back at their starts before each run of the forward.
        let inputs = upload();
        let (graph, (ids, hidden)) = DeviceGraph::record(&self.device, || {
            truncate_all(kvs)?;
            self.chosen_on_device(reqs, kvs, &inputs)
        })?;
        let r = Recorded {
            graph: match graph {
                Some(g) => g,
                None => {
                    // The device ran the last run instead of recording it: its outputs are
                    // real, and this device records nothing.
                    state.records_nothing();
                    return outputs(reqs, &ids, &hidden).map(Some);
                }
            },
            inputs,
            ids,
            hidden,
        };
        // The recorded run's launches were only recorded: run them.
        replay(&r.graph)?;
        let out = outputs(reqs, &r.ids, &r.hidden);
        state.insert(key, r);
        out.map(Some)
    }
}

/// Each request's output from the forward's `ids` (every wanted row, in request order, read
/// back) and stacked `hidden` states, each request's rows copied out (a recording holds these
/// buffers, and its next replay overwrites them).
fn outputs(
    reqs: &[ForwardRequest<'_>],
    ids: &Tensor<1>,
    hidden: &[Tensor<2>],
) -> Result<Vec<ForwardOutput>> {
    let all = ids
        .clone()
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| ModelError::Input(format!("chosen ids: {e:?}")))?;
    let mut outs = Vec::with_capacity(reqs.len());
    let (mut id_at, mut row_at) = (0, 0);
    for req in reqs {
        let t = req.tokens.len();
        let n = req.logits.rows(&(0..t)).len();
        let chosen = all[id_at..id_at + n].iter().map(|&i| i as u32).collect();
        let rows = |h: &Tensor<2>| {
            let w = h.dims()[1];
            // A slice of the recording's buffer is never its only holder: always a copy.
            gpu::unique_dense(h.clone().slice([row_at..row_at + t, 0..w]))
        };
        outs.push(ForwardOutput {
            logits: None,
            chosen: Some(chosen),
            hidden: hidden.iter().map(rows).collect(),
            attention: Vec::new(),
        });
        id_at += n;
        row_at += t;
    }
    Ok(outs)
}

/// Replays `graph`. Its buffers are alive: the weights and RoPE tables the model holds, the
/// inputs and outputs the recording holds, the caches' buffers their sequences hold (a
/// reallocated one changes the key, which records anew; a recording whose caches were freed
/// is never matched again); nothing else runs on the device's stream meanwhile (the caller's
/// thread issues every call, under the replayer's lock).
fn replay(graph: &DeviceGraph) -> Result<()> {
    #[allow(unsafe_code)] // see the function's doc
    // SAFETY: as documented above.
    unsafe { graph.replay() }.map_err(|e| ModelError::Input(format!("forward replay: {e}")))
}
