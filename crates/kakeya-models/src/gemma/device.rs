//! The model's side of GPU forwards that read their token ids and positions on the device
//! ([`StepInputs`]): the RoPE tables kept there, and what a decode step recorded once and
//! replayed needs from the model — the step with its greedy choices left on the device, and
//! the host's bookkeeping of the caches a replay writes.

use std::sync::{Mutex, MutexGuard};

use burn::tensor::{Device, Tensor};
use kakeya_weights::AttentionKind;

use super::model::{ForwardRequest, GemmaModel};
use super::pass::head_input;
use super::replay::Replayer;
use crate::cache::KvLayers;
use crate::error::{ModelError, Result};
use crate::gpu::{self, StepInputs};
use crate::rope::Rope;

/// Fewest positions a device RoPE table holds; it doubles past them.
const ROPE_ROWS_MIN: usize = 1024;

/// Where a model's forwards run, chosen once when it is loaded, from its device: what the
/// model keeps for that place lives here, and only there.
#[derive(Debug, Clone)]
pub enum Backend {
    /// The CPU (burn-flex), or any device under autodiff: Burn's ops, the host's row loops
    /// and block kernels; nothing kept beside the weights.
    Host,
    /// A CubeCL device (CUDA, wgpu): the decode kernels, with the RoPE tables and recorded
    /// forwards kept on it.
    Gpu(Box<GpuSide>),
}

impl Backend {
    /// The backend of a model whose weights live on `device`: the GPU's where its kernels
    /// apply ([`gpu::kernels_on`]: a CubeCL device without an autodiff graph), the host's
    /// otherwise.
    pub(super) fn of(device: &Device) -> Self {
        if !gpu::kernels_on(device) {
            return Self::Host;
        }
        Self::Gpu(Box::new(GpuSide {
            ropes: DeviceRopes::default(),
            replayer: Replayer::default(),
            max_buffer: gpu::max_buffer_bytes(device),
        }))
    }

    /// The GPU's side, `None` on the CPU.
    pub fn gpu(&self) -> Option<&GpuSide> {
        match self {
            Self::Host => None,
            Self::Gpu(side) => Some(side),
        }
    }
}

/// What a model keeps on a GPU beside its weights.
#[derive(Debug, Clone)]
pub struct GpuSide {
    /// RoPE tables on the device, gathered from by forwards whose positions are there.
    pub(super) ropes: DeviceRopes,
    /// The recorded forwards ([`GemmaModel::replays_decode`]).
    pub(super) replayer: Replayer,
    /// The largest buffer the device holds ([`gpu::max_buffer_bytes`]; `None` under Burn's
    /// fusion, which hides it): a forward's logits must fit in one.
    pub(super) max_buffer: Option<u64>,
}

/// The RoPE tables on the device, one per attention kind (full, sliding), each of positions
/// `0..n` ([`Rope::device_table`]), grown by doubling to cover what a forward reaches.
#[derive(Debug, Default)]
pub(crate) struct DeviceRopes(Mutex<[Option<Tensor<3>>; 2]>);

impl Clone for DeviceRopes {
    fn clone(&self) -> Self {
        Self(Mutex::new(self.lock().clone()))
    }
}

impl DeviceRopes {
    fn lock(&self) -> MutexGuard<'_, [Option<Tensor<3>>; 2]> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Table `kind`, covering positions `0..reach` at least.
    ///
    /// # Shapes
    /// - → `[2, n ≥ reach, d/2]`
    pub(crate) fn table(
        &self,
        kind: usize,
        rope: &Rope,
        reach: usize,
        device: &Device,
    ) -> Tensor<3> {
        let mut tables = self.lock();
        match &tables[kind] {
            Some(t) if t.dims()[1] >= reach => t.clone(),
            _ => {
                let n = reach.next_power_of_two().max(ROPE_ROWS_MIN);
                let t = rope.device_table(n, device);
                tables[kind] = Some(t.clone());
                t
            }
        }
    }

    /// The RoPE `(cos, sin)` of `inputs`' rows for layers of `kind` (whose positions stay
    /// below `reach`).
    ///
    /// # Shapes
    /// - → two `[rows, d/2]`
    pub(super) fn rows(
        &self,
        kind: usize,
        rope: &Rope,
        reach: usize,
        inputs: &StepInputs,
    ) -> (Tensor<2>, Tensor<2>) {
        let table = self.table(kind, rope, reach, &inputs.buf.device());
        inputs
            .rope(&table)
            .expect("step inputs live on a GPU, as the model's tables")
    }
}

/// One layer cache's slots and the allocations (id, byte offset: [`gpu::buffer_of`]) of its
/// K and V: what a recorded step wrote into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheBuffers {
    /// Slots of the cache.
    pub slots: usize,
    /// The K buffer's allocation.
    pub k: (usize, u64),
    /// The V buffer's allocation.
    pub v: (usize, u64),
}

impl GemmaModel {
    /// Whether a greedy decode step of this model can be recorded once and replayed: on a
    /// GPU whose kernels write in place (not under Burn's fusion), with every layer writing
    /// its own K/V ([`crate::gpu::span_attention`]), no Gemma 4 per-layer inputs (read from
    /// the host's token ids) and no experts (routed on the host), unless
    /// [`Self::record_decode`] is off. The caches must be plain buffers too
    /// ([`Self::advance_in_place`] says so per step).
    pub fn replays_decode(&self) -> bool {
        self.record_decode
            && gpu::writes_in_place(&self.norm.scale)
            && self.per_layer.is_none()
            && self.layers.iter().all(|l| {
                l.attn.k_proj.is_some()
                    && !l.attn.shares_kv
                    && l.per_layer.is_none()
                    && l.moe.is_none()
            })
    }

    /// Makes the device RoPE tables cover positions `0..reach` (before a recording: a table
    /// grown inside one would be an upload the replays repeat with the recorded bytes);
    /// returns each table's positions (a recording is valid while they stay).
    pub fn ensure_device_rope(&self, reach: usize) -> [usize; 2] {
        let mut held = [0; 2];
        let Some(gpu) = self.backend.gpu() else {
            return held;
        };
        for (kind, n) in held.iter_mut().enumerate() {
            // The first layer of each kind gives its table (as the forward builds it).
            let of_kind = |l: &&super::model::DecoderLayer| {
                usize::from(l.attn.kind == AttentionKind::Sliding) == kind
            };
            if let Some(layer) = self.layers.iter().find(of_kind) {
                *n = gpu
                    .ropes
                    .table(kind, &layer.attn.rope, reach, &self.device)
                    .dims()[1];
            }
        }
        held
    }

    /// A forward whose every request asks for a [`crate::Choice`] (greedy or a draw: decode
    /// steps, verify blocks), whose token ids, positions and
    /// uniforms are read from `inputs` (the buffer a recording reads; the draws' uniforms
    /// after the positions, in request order: [`Self::uniforms_of`]) and whose choices stay on
    /// the device: the form of [`Self::forward_batch`] that a recording can hold (nothing read
    /// back inside it). Returns the ids of every wanted row in request order and the stacked
    /// rows after each of `hidden_after`.
    ///
    /// # Shapes
    /// - `R` stacked rows → `[wanted rows]` ids as f32 on the device, hidden `[R, hidden]` each
    pub(super) fn chosen_on_device(
        &self,
        reqs: &[ForwardRequest<'_>],
        kvs: &mut [&mut dyn KvLayers],
        inputs: &StepInputs,
    ) -> Result<(Tensor<1>, Vec<Tensor<2>>)> {
        if !reqs.iter().all(ForwardRequest::chosen_on_device) {
            return Err(ModelError::Input(
                "chosen_on_device returns greedy choices or draws, not logits".into(),
            ));
        }
        let pass = self.pass(reqs, kvs, Some(inputs))?;
        let (head_in, counts) = head_input(reqs, &pass.spans, &pass.x);
        let head_in = head_in.ok_or_else(|| ModelError::Input("no row wanted".into()))?;
        let logits = self.logits(head_in);
        let no_gpu = || ModelError::Input("chosen_on_device needs a GPU".into());
        let ids = if reqs.iter().all(|r| r.greedy()) {
            gpu::argmax_on_device(&logits).ok_or_else(no_gpu)?
        } else {
            // Each request's rows by its own rule; its uniforms where `uniforms_of` put them.
            let (mut parts, mut row, mut drawn) = (Vec::with_capacity(reqs.len()), 0, 0);
            let v = logits.dims()[1];
            for (req, n) in reqs.iter().zip(counts) {
                let rows = logits.clone().slice([row..row + n, 0..v]);
                let ids = match req.draw() {
                    Some((d, _)) => {
                        drawn += n;
                        d.ids_on_device(&rows, inputs.extra(drawn - n, n))
                    }
                    None => gpu::argmax_on_device(&rows),
                };
                parts.push(ids.ok_or_else(no_gpu)?);
                row += n;
            }
            Tensor::cat(parts, 0)
        };
        let hidden = pass
            .hidden
            .into_iter()
            .map(|t| t.ok_or_else(|| ModelError::Input("a requested layer did not run".into())))
            .collect::<Result<Vec<_>>>()?;
        Ok((ids, hidden))
    }

    /// The uniforms [`Self::chosen_on_device`] reads after the positions: each drawing
    /// request's, in request order, one per wanted row.
    pub(super) fn uniforms_of(reqs: &[ForwardRequest<'_>]) -> Vec<f32> {
        let mut u = Vec::new();
        for req in reqs {
            if let Some((d, first)) = req.draw() {
                let n = req.logits.rows(&(0..req.tokens.len())).len();
                u.extend(d.uniforms(first, n));
            }
        }
        u
    }

    /// The host's side of a replayed step of `t` rows at `start`: each layer's cache takes
    /// the chunk in place, as [`Self::forward_batch`]'s attention would ask it
    /// ([`KvLayers::in_place`]; the replay's kernels write the K/V). Returns each cache's
    /// slots and the allocations of its K and V ([`gpu::buffer_of`]): a recording is valid
    /// while they stay. `None` where a cache cannot (the layers before it have advanced: the
    /// caller truncates, then issues the step launch by launch).
    pub fn advance_in_place(
        &self,
        kv: &mut dyn KvLayers,
        start: usize,
        t: usize,
    ) -> Option<Vec<CacheBuffers>> {
        let mut slots = Vec::with_capacity(self.layers.len());
        let mut like: Option<Tensor<3>> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.attn;
            let l = match &like {
                Some(l) if l.dims() == [a.kv_heads, t, a.head_dim] => l,
                _ => like.insert(Tensor::empty([a.kv_heads, t, a.head_dim], &self.device)),
            };
            let place = kv.in_place(i, start, l)?;
            let (k, v) = (gpu::buffer_of(&place.k)?, gpu::buffer_of(&place.v)?);
            slots.push(CacheBuffers {
                slots: place.k.dims()[1],
                k,
                v,
            });
        }
        Some(slots)
    }
}
