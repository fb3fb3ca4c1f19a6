//! A sequence's greedy forwards recorded once and replayed on a GPU ([`DecodeReplay`]): decode
//! steps and speculative verify blocks. A decode step of the 270M model issues ~185 kernel
//! launches, and on an H100 it was bound by issuing them (6.5–7.6 ms a step, far more than its
//! kernels: `docs/gpu.md`). Recorded, a forward is one replay (a CUDA graph) plus one small
//! upload and one copy.
//!
//! What a replay must find where the recording left it: the token ids and positions in one
//! device buffer ([`StepInputs`], rewritten before each replay), which the recorded kernels
//! read (the embedding and RoPE rows gathered there, the attention's first position); the
//! caches' buffers, written in place by the recorded attention while the host only advances
//! their lengths ([`Gemma3Model::advance_in_place`]); the device RoPE tables; and the greedy
//! ids and requested hidden states, left on the device until the replay ran. A forward whose
//! caches or tables were reallocated (a full cache doubling, a ring filling, a fork's copy on
//! write, a table growing) is recorded anew; one the caches cannot take in place (the bounded
//! modes' tiers) is issued launch by launch. A shape is recorded the second time it is seen
//! (recording costs four runs of the forward: a one-off prompt chunk is not worth it).

use burn::tensor::Tensor;
use kakeya_models::cache::KvLayers;
use kakeya_models::gemma3::CacheBuffers;
use kakeya_models::gpu::{self, DeviceGraph, GPU_ROWS_MAX, StepInputs};
use kakeya_models::{ForwardOutput, ForwardRequest, Gemma3Model, Logits};

use crate::error::{Result, RuntimeError};
use crate::kv::SequenceKv;

/// Most recordings kept (one per block length and requested output, typically a few).
const RECORDINGS_MAX: usize = 24;

/// What a forward must match to replay a recording: its rows, what it returns, each cache's
/// slots and the allocations of its K and V, and each device RoPE table's positions.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Key {
    rows: usize,
    last_only: bool,
    hidden_after: Vec<usize>,
    caches: Vec<CacheBuffers>,
    rope: [usize; 2],
}

/// One recorded forward, the buffer it reads its ids and positions from, and its outputs.
struct Recorded {
    key: Key,
    graph: DeviceGraph,
    inputs: StepInputs,
    ids: Tensor<1>,
    hidden: Vec<Tensor<2>>,
}

/// How a [`DecodeReplay`]'s forwards ran.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReplayStats {
    /// Forwards recorded (each also ran).
    pub recorded: usize,
    /// Forwards replayed from a recording.
    pub replayed: usize,
    /// Forwards left to be issued launch by launch (first sightings, unrecordable caches).
    pub declined: usize,
}

/// One sequence's greedy forwards, recorded and replayed where the device records
/// ([`Gemma3Model::replays_decode`]); every result equals the forward issued launch by
/// launch, bit for bit (the same kernels on the same inputs).
#[derive(Default)]
pub struct DecodeReplay {
    recorded: Vec<Recorded>,
    /// The shapes `(rows, last_only, hidden_after)` seen once: recorded when seen again.
    seen: Vec<(usize, bool, Vec<usize>)>,
    /// The device recorded nothing, or the caches are not plain buffers: decline.
    off: bool,
    /// How the forwards ran.
    pub stats: ReplayStats,
}

impl std::fmt::Debug for DecodeReplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeReplay")
            .field("recordings", &self.recorded.len())
            .field("off", &self.off)
            .field("stats", &self.stats)
            .finish()
    }
}

impl DecodeReplay {
    /// The forward of `tokens` at `pos` (the caches `kv` hold `0..pos`; then `0..pos + T`)
    /// asking for `logits` and `hidden_after`, replayed or recorded; `Ok(None)` where it is
    /// not (the caller issues it): off a recording device, a kind of logits other than the
    /// greedy choices, more than [`GPU_ROWS_MAX`] rows, a shape's first sighting, caches that
    /// are not plain buffers. The output is [`Gemma3Model::forward`]'s for the same request.
    pub(crate) fn forward(
        &mut self,
        model: &Gemma3Model,
        kv: &mut SequenceKv<'_>,
        req: &ForwardRequest<'_>,
    ) -> Result<Option<ForwardOutput>> {
        let last_only = match req.logits {
            Logits::GreedyLast => true,
            Logits::GreedyAll => false,
            _ => return Ok(None),
        };
        let (t, pos) = (req.tokens.len(), req.start);
        let c = &model.config;
        let valid = req.tokens.iter().all(|&id| (id as usize) < c.vocab_size)
            && pos + t <= c.max_position_embeddings;
        if self.off || t == 0 || t > GPU_ROWS_MAX || !valid {
            return Ok(None);
        }
        let shape = (t, last_only, req.hidden_after.to_vec());
        if !self.seen.contains(&shape) {
            self.seen.push(shape);
            self.stats.declined += 1;
            return Ok(None);
        }
        let rope = model.ensure_device_rope(pos + t);
        let Some(caches) = model.advance_in_place(kv, pos, t) else {
            // Not plain buffers (a bounded mode's tiers): these caches never will be.
            kv.truncate(pos)?;
            self.off = true;
            self.recorded.clear();
            self.stats.declined += 1;
            return Ok(None);
        };
        let key = Key {
            rows: t,
            last_only,
            hidden_after: req.hidden_after.to_vec(),
            caches,
            rope,
        };
        let positions: Vec<usize> = (pos..pos + t).collect();
        let fresh = StepInputs::upload(req.tokens, &positions, model.device());
        if let Some(r) = self.recorded.iter().find(|r| r.key == key) {
            gpu::copy_into(&r.inputs.buf, &fresh.buf).expect("replays run on a GPU");
            replay(&r.graph)?;
            self.stats.replayed += 1;
            return output(r).map(Some);
        }
        // Recorded anew (a recording of this shape over other buffers is dropped): the caches
        // back at `pos` before each run of the forward.
        self.recorded.retain(|r| {
            (r.key.rows, r.key.last_only, &r.key.hidden_after)
                != (key.rows, key.last_only, &key.hidden_after)
        });
        if self.recorded.len() >= RECORDINGS_MAX {
            self.recorded.remove(0);
        }
        kv.truncate(pos)?;
        let inputs = fresh;
        let (graph, (ids, hidden)) = DeviceGraph::record(model.device(), || {
            kv.truncate(pos)?;
            model.greedy_on_device(req, &mut *kv as &mut dyn KvLayers, &inputs)
        })?;
        let Some(graph) = graph else {
            // The device ran the last run instead of recording it: its outputs are real.
            self.off = true;
            self.stats.declined += 1;
            return Ok(Some(ForwardOutput {
                logits: None,
                greedy: Some(read_ids(&ids)?),
                hidden,
                attention: Vec::new(),
            }));
        };
        // The recorded run's launches were only recorded: run them.
        replay(&graph)?;
        self.stats.recorded += 1;
        let r = Recorded {
            key,
            graph,
            inputs,
            ids,
            hidden,
        };
        let out = output(&r);
        self.recorded.push(r);
        out.map(Some)
    }
}

/// A replayed forward's output: the ids read back, each hidden state copied out of the
/// recording's buffer (the next replay overwrites it; the session keeps them).
fn output(r: &Recorded) -> Result<ForwardOutput> {
    Ok(ForwardOutput {
        logits: None,
        greedy: Some(read_ids(&r.ids)?),
        // The recording holds its buffer, so this is always a copy.
        hidden: r
            .hidden
            .iter()
            .map(|h| gpu::unique_dense(h.clone()))
            .collect(),
        attention: Vec::new(),
    })
}

/// Replays `graph`. Its buffers are alive: the weights and RoPE tables the model holds, the
/// inputs and outputs the recording holds, the caches' buffers the sequence holds (a
/// reallocated one changes the key, which records anew); nothing else runs on the device's
/// stream meanwhile (the caller's thread issues every call).
fn replay(graph: &DeviceGraph) -> Result<()> {
    #[allow(unsafe_code)] // see the function's doc
    // SAFETY: as documented above.
    unsafe { graph.replay() }.map_err(|e| RuntimeError::Input(format!("forward replay: {e}")))
}

/// The greedy ids of a forward, read back (its only copy to the host besides the hidden
/// states the caller asked for).
fn read_ids(ids: &Tensor<1>) -> Result<Vec<u32>> {
    let v = ids
        .clone()
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| RuntimeError::Input(format!("greedy ids: {e:?}")))?;
    Ok(v.into_iter().map(|i| i as u32).collect())
}

/// A session's [`DecodeReplay`], made at its first greedy forward on a recording device. A
/// clone (a prefix-cache fork) starts with none: its recordings would name the caches' old
/// buffers, which the fork copies on its first write.
#[derive(Debug, Default)]
pub(crate) struct ReplaySlot(Option<DecodeReplay>);

impl Clone for ReplaySlot {
    fn clone(&self) -> Self {
        Self(None)
    }
}

impl ReplaySlot {
    /// [`DecodeReplay::forward`], where `model` records ([`Gemma3Model::replays_decode`]).
    pub(crate) fn forward(
        &mut self,
        model: &Gemma3Model,
        kv: &mut SequenceKv<'_>,
        req: &ForwardRequest<'_>,
    ) -> Result<Option<ForwardOutput>> {
        if !model.replays_decode() {
            return Ok(None);
        }
        self.0
            .get_or_insert_with(DecodeReplay::default)
            .forward(model, kv, req)
    }

    /// How the forwards ran (all zero before the first).
    pub(crate) fn stats(&self) -> ReplayStats {
        self.0
            .as_ref()
            .map_or_else(ReplayStats::default, |r| r.stats)
    }
}
