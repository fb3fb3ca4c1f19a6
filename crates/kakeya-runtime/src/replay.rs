//! Greedy decode steps recorded once and replayed on a GPU ([`DecodeReplay`]). A decode step
//! of the 270M model issues ~185 kernel launches, and on an H100 it was bound by issuing them
//! (6.5–7.6 ms a step, far more than its kernels: `docs/gpu.md`). Recorded, a step is one
//! replay (a CUDA graph) plus one small upload and one copy.
//!
//! What a replay must find where the recording left it: the token id and position in one
//! device buffer ([`StepInputs`], rewritten before each replay), which the recorded kernels
//! read (the embedding and RoPE rows gathered there, the attention's first position); the
//! caches' buffers, written in place by the recorded attention while the host only advances
//! their lengths ([`Gemma3Model::advance_in_place`]); the device RoPE tables; and the greedy
//! ids, left on the device until the replay ran. A step whose caches or tables were
//! reallocated (a full cache doubling, a ring filling, a table growing) is recorded anew; a
//! step the caches cannot take in place (the bounded modes' tiers) is issued launch by launch.

use burn::tensor::Tensor;
use kakeya_models::cache::KvLayers;
use kakeya_models::gemma3::CacheBuffers;
use kakeya_models::gpu::{self, DeviceGraph, StepInputs};
use kakeya_models::{ForwardRequest, Gemma3Model, Logits};

use crate::error::{Result, RuntimeError};
use crate::kv::SequenceKv;

/// What a recording holds fixed besides its own buffers: each cache's slots and the
/// allocations of its K and V (a fork of the sequence makes its next write copy them), and
/// each device RoPE table's positions.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Layout {
    caches: Vec<CacheBuffers>,
    rope: [usize; 2],
}

/// One recorded step and the buffer its greedy ids land in.
struct Recorded {
    layout: Layout,
    graph: DeviceGraph,
    ids: Tensor<1>,
}

/// How a [`DecodeReplay`]'s steps ran.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReplayStats {
    /// Steps recorded (each also ran).
    pub recorded: usize,
    /// Steps replayed from a recording.
    pub replayed: usize,
    /// Steps issued launch by launch (no recording possible).
    pub issued: usize,
}

/// One sequence's greedy decode steps, recorded and replayed where the device records
/// ([`Gemma3Model::replays_decode`]); every step's choice equals the step issued launch by
/// launch, bit for bit (the same kernels on the same inputs).
pub struct DecodeReplay {
    /// The buffer the recordings read the token id and position from.
    inputs: StepInputs,
    recorded: Option<Recorded>,
    /// The device recorded nothing or the caches never take a step in place: issue.
    off: bool,
    /// How the steps ran.
    pub stats: ReplayStats,
}

impl std::fmt::Debug for DecodeReplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeReplay")
            .field("recorded", &self.recorded.as_ref().map(|r| &r.layout))
            .field("off", &self.off)
            .field("stats", &self.stats)
            .finish()
    }
}

impl DecodeReplay {
    /// A replayer for `model`'s decode steps; `None` where they cannot be recorded (the CPU,
    /// Burn's fusion, Gemma 4's per-layer inputs or shared K/V).
    pub fn new(model: &Gemma3Model) -> Option<Self> {
        model.replays_decode().then(|| Self {
            inputs: StepInputs::upload(&[0], &[0], model.device()),
            recorded: None,
            off: false,
            stats: ReplayStats::default(),
        })
    }

    /// The greedy choice after `token` at position `pos` of a sequence whose caches `kv`
    /// hold positions `0..pos` (they then hold `0..=pos`).
    pub(crate) fn step(
        &mut self,
        model: &Gemma3Model,
        kv: &mut SequenceKv<'_>,
        token: u32,
        pos: usize,
    ) -> Result<u32> {
        let c = &model.config;
        if token as usize >= c.vocab_size || pos >= c.max_position_embeddings {
            return Err(RuntimeError::Input(format!(
                "token {token} at position {pos}: outside the vocabulary of {} or the context of {}",
                c.vocab_size, c.max_position_embeddings
            )));
        }
        if self.off {
            return self.issue(model, kv, token, pos);
        }
        let rope = model.ensure_device_rope(pos + 1);
        let Some(caches) = model.advance_in_place(kv, pos, 1) else {
            // Not plain buffers (a bounded mode's tiers): these caches never will be.
            kv.truncate(pos)?;
            self.off = true;
            self.recorded = None;
            return self.issue(model, kv, token, pos);
        };
        let fresh = StepInputs::upload(&[token], &[pos], model.device());
        gpu::copy_into(&self.inputs.buf, &fresh.buf)
            .ok_or_else(|| RuntimeError::Input("decode replay off a GPU".into()))?;
        let layout = Layout { caches, rope };
        if let Some(r) = self.recorded.as_ref().filter(|r| r.layout == layout) {
            replay(&r.graph)?;
            self.stats.replayed += 1;
            return read_id(&r.ids);
        }
        // Recorded anew: the caches back at `pos` before each run of the step.
        self.recorded = None;
        kv.truncate(pos)?;
        let req = ForwardRequest::new(std::slice::from_ref(&token), pos, Logits::GreedyLast);
        let inputs = &self.inputs;
        let (graph, ids) = DeviceGraph::record(model.device(), || {
            kv.truncate(pos)?;
            let mut kvs: [&mut dyn KvLayers; 1] = [&mut *kv];
            model.greedy_on_device(std::slice::from_ref(&req), &mut kvs, inputs)
        })?;
        let Some(graph) = graph else {
            // The device ran the last run instead of recording it.
            self.off = true;
            self.stats.issued += 1;
            return read_id(&ids);
        };
        // The recorded run's launches were only recorded: run them.
        replay(&graph)?;
        self.stats.recorded += 1;
        let id = read_id(&ids)?;
        self.recorded = Some(Recorded { layout, graph, ids });
        Ok(id)
    }

    /// The step issued launch by launch, as [`crate::Session::step_for`] runs it.
    fn issue(
        &mut self,
        model: &Gemma3Model,
        kv: &mut SequenceKv<'_>,
        token: u32,
        pos: usize,
    ) -> Result<u32> {
        self.stats.issued += 1;
        let req = ForwardRequest::new(std::slice::from_ref(&token), pos, Logits::GreedyLast);
        let out = model.forward(&req, kv)?;
        out.greedy
            .and_then(|g| g.last().copied())
            .ok_or_else(|| RuntimeError::Input("a greedy step returned no choice".into()))
    }
}

/// Replays `graph`. Its buffers are alive: the weights and RoPE tables the model holds, the
/// inputs buffer and the ids the replayer holds, the caches' buffers the sequence holds (a
/// reallocated one changes the layout, which records anew); nothing else runs on the device's
/// stream meanwhile (the caller's thread issues every call).
fn replay(graph: &DeviceGraph) -> Result<()> {
    #[allow(unsafe_code)] // see the function's doc
    // SAFETY: as documented above.
    unsafe { graph.replay() }.map_err(|e| RuntimeError::Input(format!("decode replay: {e}")))
}

/// The one greedy id of a step, read back (the step's only copy to the host).
fn read_id(ids: &Tensor<1>) -> Result<u32> {
    let v = ids
        .clone()
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| RuntimeError::Input(format!("greedy ids: {e:?}")))?;
    v.last()
        .map(|&i| i as u32)
        .ok_or_else(|| RuntimeError::Input("a greedy step returned no choice".into()))
}
