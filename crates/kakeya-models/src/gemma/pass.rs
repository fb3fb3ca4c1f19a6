//! A forward's decoder layers over the stacked chunks of its requests ([`GemmaModel::pass`]),
//! the checks of a batch, and the rows each request wants through the head: what the issued
//! forward ([`GemmaModel::forward_batch`]) and a recorded one (`super::replay`) share.

use burn::tensor::Tensor;
use kakeya_weights::AttentionKind;

use super::attention::{AttentionCapture, SharedKv, Span};
use super::model::{ForwardRequest, GemmaModel};
use crate::cache::KvLayers;
use crate::error::{ModelError, Result};
use crate::gpu::StepInputs;

/// The rows each request wants through the head (its `logits` rows of its span), stacked,
/// and how many each gave: the stacked rows as they are when every row is wanted (decode
/// steps, verify blocks).
///
/// # Shapes
/// - `x`: `[R, hidden]` → `[Σ counts, hidden]` (`None`: no row wanted)
pub(super) fn head_input(
    reqs: &[ForwardRequest<'_>],
    spans: &[Span],
    x: &Tensor<2>,
) -> (Option<Tensor<2>>, Vec<usize>) {
    let h = x.dims()[1];
    let mut wanted: Vec<Tensor<2>> = Vec::new();
    let mut counts = Vec::with_capacity(reqs.len());
    let mut every_row = true;
    for (req, span) in reqs.iter().zip(spans) {
        let r = req.logits.rows(&span.rows);
        counts.push(r.len());
        every_row &= r == span.rows;
        if !r.is_empty() {
            wanted.push(x.clone().slice([r, 0..h]));
        }
    }
    if every_row && wanted.len() > 1 {
        wanted = vec![x.clone()];
    }
    let head_in = match wanted.len() {
        0 => None,
        1 => wanted.pop(),
        _ => Some(Tensor::cat(wanted, 0)),
    };
    (head_in, counts)
}

/// What the decoder layers of a forward leave ([`GemmaModel::pass`]).
pub(super) struct Pass {
    /// The last layer's rows, `[R, hidden]`.
    pub(super) x: Tensor<2>,
    /// Each request's rows and first position.
    pub(super) spans: Vec<Span>,
    /// The rows after each requested layer.
    pub(super) hidden: Vec<Option<Tensor<2>>>,
    /// Per request, each layer's attention capture (when asked).
    pub(super) attention: Vec<Vec<AttentionCapture>>,
}

impl GemmaModel {
    /// The decoder layers over the stacked chunks of `reqs` (each sequence's caches in
    /// `kvs`): the last layer's rows and what the requests asked to keep. On a GPU the rows'
    /// ids and positions are read from `given` when the caller holds them on the device (a
    /// recorded decode step), else from one upload.
    ///
    /// # Shapes
    /// - per request as in [`Self::forward`] → `x`: `[R, hidden]` (every request's rows)
    pub(super) fn pass(
        &self,
        reqs: &[ForwardRequest<'_>],
        kvs: &mut [&mut dyn KvLayers],
        given: Option<&StepInputs>,
    ) -> Result<Pass> {
        self.check_batch(reqs, kvs)?;
        let first = &reqs[0];
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(reqs.len());
        for req in reqs {
            let r0 = tokens.len();
            tokens.extend_from_slice(req.tokens);
            match req.tree {
                Some(tree) => positions.extend(tree.depths().iter().map(|d| req.start + d)),
                None => positions.extend(req.start..req.start + req.tokens.len()),
            }
            spans.push(Span {
                start: req.start,
                rows: r0..tokens.len(),
                tree: req.tree.map(|t| std::sync::Arc::new(t.clone())),
            });
        }
        // On a GPU: the ids and positions in one device buffer, read there.
        let uploaded = (given.is_none() && self.backend.gpu().is_some())
            .then(|| StepInputs::upload(&tokens, &positions, &self.device));
        let inputs = given.or(uploaded.as_ref());
        let scale = (self.config.hidden_size as f32).sqrt();
        let mut x = match inputs.and_then(|i| i.embed(self.embed_blocks(), scale)) {
            Some(x) => x,
            None => self.embed_tokens(&tokens),
        };
        let reach = positions.iter().max().map_or(0, |p| p + 1);
        let per_layer = self
            .per_layer
            .as_ref()
            .map(|p| (p, p.inputs(&tokens, x.clone())));
        let mut shared = SharedKv::new();
        let hidden_after = first.hidden_after;
        let mut hidden = vec![None; hidden_after.len()];
        let mut attention: Vec<Vec<AttentionCapture>> = vec![Vec::new(); reqs.len()];
        // RoPE tables depend only on the positions and the layer kind: build each once.
        let mut rope_tables: [Option<(Tensor<2>, Tensor<2>)>; 2] = [None, None];
        for (i, layer) in self.layers.iter().enumerate() {
            let kind = usize::from(layer.attn.kind == AttentionKind::Sliding);
            let rope =
                rope_tables[kind].get_or_insert_with(|| match (inputs, self.backend.gpu()) {
                    (Some(i), Some(gpu)) => gpu.ropes.rows(kind, &layer.attn.rope, reach, i),
                    _ => layer.attn.rope.tables(&positions, &self.device),
                });
            let (y, caps) = layer.forward(
                x,
                &spans,
                (rope, inputs.map(StepInputs::positions)),
                (&mut *kvs, i),
                first.capture_attention,
                per_layer.as_ref().map(|(p, all)| p.of_layer(all, i)),
                &mut shared,
            )?;
            x = y;
            for (per_seq, cap) in attention.iter_mut().zip(caps) {
                per_seq.push(cap);
            }
            for (slot, _) in hidden_after.iter().enumerate().filter(|(_, l)| **l == i) {
                hidden[slot] = Some(x.clone());
            }
        }
        Ok(Pass {
            x,
            spans,
            hidden,
            attention,
        })
    }

    /// Refuses a batch the model cannot run: no requests, a cache set per request, each
    /// request runnable ([`Self::check_request`]), one set of hidden states and captures.
    pub(super) fn check_batch(
        &self,
        reqs: &[ForwardRequest<'_>],
        kvs: &[&mut dyn KvLayers],
    ) -> Result<()> {
        let Some(first) = reqs.first() else {
            return Err(ModelError::Input("a forward of no requests".into()));
        };
        if kvs.len() != reqs.len() {
            return Err(ModelError::Input(format!(
                "{} cache sets for {} requests",
                kvs.len(),
                reqs.len()
            )));
        }
        for (req, kv) in reqs.iter().zip(kvs.iter()) {
            self.check_request(req, &**kv)?;
            if req.hidden_after != first.hidden_after
                || req.capture_attention != first.capture_attention
            {
                return Err(ModelError::Input(
                    "requests of one batch must ask for the same hidden states and captures".into(),
                ));
            }
        }
        // On a GPU the wanted rows' logits are one tensor: more than one buffer there holds
        // would fail at allocation (lavapipe and WebGPU hold 128 MiB, 128 rows of Gemma 3's).
        let rows: usize = reqs
            .iter()
            .map(|r| r.logits.rows(&(0..r.tokens.len())).len())
            .sum();
        let bytes = (rows * self.config.vocab_size * 4) as u64;
        let max_buffer = self.backend.gpu().and_then(|g| g.max_buffer);
        if let Some(max) = max_buffer.filter(|&max| bytes > max) {
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            return Err(ModelError::Input(format!(
                "the logits of {rows} rows ({:.1} MiB) are more than one buffer on this device \
                 holds ({:.1} MiB): ask for fewer rows' logits in one forward",
                mib(bytes),
                mib(max)
            )));
        }
        Ok(())
    }
}
