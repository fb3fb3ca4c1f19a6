//! The Gemma 3 text decoder: embedding (× √hidden), decoder layers, final norm, tied LM head.

use burn::tensor::{Device, Int, Tensor, TensorData};
use kakeya_weights::{AttentionKind, GemmaConfig};

use super::attention::{Attention, AttentionCapture, SharedKv, Span};
use super::device::Backend;
use super::moe::Moe;
use super::pass::{Pass, head_input};
use super::per_layer::{PerLayerEmbed, PerLayerGate};
use crate::cache::{CacheSpec, KvLayers};
use crate::choice::Choice;
use crate::error::{ModelError, Result};
use crate::linear::{Kernel, Linear};
use crate::norm::RmsNorm;
use crate::tree_rows::TreeRows;

/// Which rows of a chunk go through the LM head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// None (e.g. capture of hidden states only).
    None,
    /// Only the last position's, `[1, vocab]`.
    Last,
    /// Every position's, `[T, vocab]`.
    All,
}

impl Logits {
    /// Which of the request's rows go through the head.
    pub(super) fn rows(self, span: &std::ops::Range<usize>) -> std::ops::Range<usize> {
        match self {
            Logits::None => span.start..span.start,
            Logits::All => span.clone(),
            Logits::Last => span.end - 1..span.end,
        }
    }
}

/// A forward over a chunk of tokens and what to return besides the caches' update.
#[derive(Debug, Clone)]
pub struct ForwardRequest<'a> {
    /// Token ids of the chunk (at least one).
    pub tokens: &'a [u32],
    /// Absolute position of the first token (= tokens already in the caches).
    pub start: usize,
    /// Which rows go through the head.
    pub logits: Logits,
    /// The token to choose after each of those rows, in place of their logits where the
    /// forward can ([`Choice`]); `None`: return the logits.
    pub choice: Option<Choice>,
    /// Return the hidden state after each of these layers (0-based, in this order).
    pub hidden_after: &'a [usize],
    /// Return, per layer, raw q/k/v projections and the attention output.
    pub capture_attention: bool,
    /// The rows as a tree ([`TreeRows`]: row `i` at `start + depth(i)`, seeing the cached
    /// positions and its ancestors), or `None` for a causal chunk. On the CPU only.
    pub tree: Option<&'a TreeRows>,
}

impl<'a> ForwardRequest<'a> {
    /// A plain forward returning the given logits.
    pub fn new(tokens: &'a [u32], start: usize, logits: Logits) -> Self {
        Self {
            tokens,
            start,
            logits,
            choice: None,
            hidden_after: &[],
            capture_attention: false,
            tree: None,
        }
    }

    /// The same request, choosing a token after each wanted row ([`Self::choice`]).
    pub fn choose(self, choice: Choice) -> Self {
        Self {
            choice: Some(choice),
            ..self
        }
    }

    /// Whether a forward can keep this request's choices on the device: it wants rows and a
    /// [`Choice`] for them.
    pub(super) fn chosen_on_device(&self) -> bool {
        self.choice.is_some() && self.logits != Logits::None
    }

    /// Whether only the greedy choices are wanted.
    pub(super) fn greedy(&self) -> bool {
        self.choice == Some(Choice::Greedy)
    }

    /// The draw asked for, with the position its first wanted row predicts.
    pub(super) fn draw(&self) -> Option<(crate::Draw, usize)> {
        let d = self.choice?.draw()?;
        let first = self.logits.rows(&(0..self.tokens.len())).start;
        Some((d, self.start + first + 1))
    }
}

/// What a forward returns.
#[derive(Debug, Clone)]
pub struct ForwardOutput {
    /// Logits, `[1 or T, vocab]`, when asked for.
    pub logits: Option<Tensor<2>>,
    /// The chosen tokens (1 or `T` ids) where the request asked for a [`Choice`]: the
    /// greedy choices always, the draws on a GPU.
    pub chosen: Option<Vec<u32>>,
    /// Hidden states after the requested layers, each `[T, hidden]`.
    pub hidden: Vec<Tensor<2>>,
    /// Per-layer attention captures, when asked for.
    pub attention: Vec<AttentionCapture>,
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    /// Self-attention.
    pub attn: Attention,
    /// Norm before attention.
    pub input_norm: RmsNorm,
    /// Norm of the attention output.
    pub post_attn_norm: RmsNorm,
    /// Norm before the MLP.
    pub pre_ffn_norm: RmsNorm,
    /// Norm of the MLP output.
    pub post_ffn_norm: RmsNorm,
    /// `[intermediate, hidden]`.
    pub gate_proj: Linear,
    /// `[intermediate, hidden]`.
    pub up_proj: Linear,
    /// `[hidden, intermediate]`.
    pub down_proj: Linear,
    /// Gemma 4's per-layer input branch.
    pub per_layer: Option<PerLayerGate>,
    /// Gemma 4's multiplier of the whole residual stream after the layer.
    pub layer_scalar: Option<f32>,
    /// Gemma 4's mixture-of-experts branch beside the dense MLP.
    pub moe: Option<Moe>,
}

impl DecoderLayer {
    /// # Shapes
    /// - `x`: `[R, hidden]` (the spans' rows stacked) → `[R, hidden]`; `rope`: two `[R, d/2]`,
    ///   `positions`: the stacked rows' on a GPU; see [`Attention::forward`]
    /// - `per_layer_input`: `[R, P]` (Gemma 4 with per-layer inputs)
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        x: Tensor<2>,
        spans: &[Span],
        (rope, positions): (&(Tensor<2>, Tensor<2>), Option<(&Tensor<1>, usize)>),
        kv: (&mut [&mut dyn KvLayers], usize),
        capture: bool,
        per_layer_input: Option<Tensor<2>>,
        shared: &mut SharedKv,
    ) -> Result<(Tensor<2>, Vec<AttentionCapture>)> {
        let (a, cap) = self.attn.forward(
            self.input_norm.forward(x.clone()),
            spans,
            (rope, positions),
            kv,
            capture,
            shared,
        )?;
        let mut out = if self.moe.is_none()
            && Linear::gelu_mlp_on_host(&self.gate_proj, &self.up_proj, &self.down_proj)
        {
            self.residual_tail_host(a, x)
        } else {
            let (h, m) = self
                .post_attn_norm
                .forward_add_norm(a, x, &self.pre_ffn_norm);
            let mut m = Linear::gelu_mlp(&self.gate_proj, &self.up_proj, &self.down_proj, m);
            if let Some(moe) = &self.moe {
                m = moe.forward(h.clone(), m);
            }
            self.post_ffn_norm.forward_add(m, h)
        };
        if let (Some(gate), Some(input)) = (&self.per_layer, per_layer_input) {
            out = gate.forward(out, input);
        }
        if let Some(s) = self.layer_scalar {
            out = out.mul_scalar(s);
        }
        Ok((out, cap))
    }
}

impl DecoderLayer {
    /// The layer after attention on the CPU, over host rows with no tensor in between:
    /// `h = x + norm(a)`, then `h + norm(mlp(norm(h)))` (the dense MLP alone: no experts).
    ///
    /// # Shapes
    /// - `a` (attention's output), `x` (the layer's input): `[R, hidden]` → `[R, hidden]`
    fn residual_tail_host(&self, a: Tensor<2>, x: Tensor<2>) -> Tensor<2> {
        let ([t, hidden], device) = (x.dims(), x.device());
        let mut h = crate::linear::host_rows(a);
        self.post_attn_norm.forward_host(&mut h);
        for (v, r) in h.iter_mut().zip(crate::linear::host_rows(x)) {
            *v += r;
        }
        let mut m = h.clone();
        self.pre_ffn_norm.forward_host(&mut m);
        let mut y = Linear::gelu_mlp_host(&self.gate_proj, &self.up_proj, &self.down_proj, &m, t);
        self.post_ffn_norm.forward_host(&mut y);
        for (v, r) in y.iter_mut().zip(&h) {
            *v += r;
        }
        Tensor::from_data(TensorData::new(y, [t, hidden]), &device)
    }
}

/// The Gemma text model (Gemma 3; Gemma 4's per-layer inputs and experts where configured).
#[derive(Debug, Clone)]
pub struct GemmaModel {
    /// Hyper-parameters.
    pub config: GemmaConfig,
    /// Token embedding, `[vocab, hidden]`.
    pub embed: Tensor<2>,
    /// Tied LM head: the embedding as a linear map `hidden → vocab`.
    pub head: Linear,
    /// Decoder layers.
    pub layers: Vec<DecoderLayer>,
    /// Final norm.
    pub norm: RmsNorm,
    /// Gemma 4's per-layer input embeddings.
    pub per_layer: Option<PerLayerEmbed>,
    pub(super) device: Device,
    /// Where the forwards run, chosen at load from the device, with what is kept there.
    pub(super) backend: Backend,
    /// On a GPU, greedy forwards are recorded once and replayed ([`Self::replays_decode`]);
    /// false: issued launch by launch (the CLI's `--no-graph`).
    pub record_decode: bool,
}

impl GemmaModel {
    /// Chooses the products of the decoder layers' quantised weights ([`Kernel`]); the LM
    /// head keeps its exact greedy search. Returns how many weights take the kernel (0: the
    /// model has no quantised weights on the CPU, so nothing changed).
    pub fn set_kernel(&mut self, kernel: Kernel) -> usize {
        let mut n = 0;
        let mut set = |l: &mut Linear| {
            if let Linear::Quant { matrix, kernel: k } = l {
                // The int8 panels are made now, not in the first request.
                matrix.prepare(false, kernel == Kernel::Int8);
                *k = kernel;
                n += 1;
            }
        };
        for layer in &mut self.layers {
            let a = &mut layer.attn;
            set(&mut a.q_proj);
            a.k_proj.iter_mut().for_each(&mut set);
            a.v_proj.iter_mut().for_each(&mut set);
            set(&mut a.o_proj);
            set(&mut layer.gate_proj);
            set(&mut layer.up_proj);
            set(&mut layer.down_proj);
            if let Some(p) = &mut layer.per_layer {
                set(&mut p.gate);
                set(&mut p.proj);
            }
            if let Some(m) = &mut layer.moe {
                for e in &mut m.experts {
                    set(&mut e.gate_up);
                    set(&mut e.down);
                }
            }
        }
        n
    }

    /// Whether every decoder-layer projection gives each row the same bits however many rows
    /// run together — true when they all have GGUF blocks on the CPU (the block kernel, exact
    /// or int8, at any count); otherwise that holds up to [`crate::linear::QUANT_MAX_ROWS`]
    /// rows in all. (Attention runs per sequence either way.)
    pub fn rows_invariant_at_any_count(&self) -> bool {
        self.layers.iter().all(|l| {
            let a = &l.attn;
            [
                Some(&a.q_proj),
                a.k_proj.as_ref(),
                a.v_proj.as_ref(),
                Some(&a.o_proj),
            ]
            .into_iter()
            .flatten()
            .chain([&l.gate_proj, &l.up_proj, &l.down_proj])
            .all(|p| p.quant_matrix().is_some())
                && l.per_layer.is_none()
                && l.moe.is_none()
        })
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Where the forwards run (chosen at load from [`Self::device`]).
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The cache each layer needs, in layer order (the caller builds and owns the caches).
    pub fn cache_specs(&self) -> Vec<CacheSpec> {
        let c = &self.config;
        c.layer_types
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let window = (*k == AttentionKind::Sliding).then_some(c.sliding_window);
                match (c.kv_source(i), window) {
                    (Some(source), _) => CacheSpec::Shared { source, window },
                    (None, None) => CacheSpec::Full,
                    (None, Some(window)) => CacheSpec::Sliding { window },
                }
            })
            .collect()
    }

    /// Scaled token embeddings.
    ///
    /// # Shapes
    /// - `tokens`: `T` ids → `[T, hidden]`
    pub fn embed_tokens(&self, tokens: &[u32]) -> Tensor<2> {
        let scale = (self.config.hidden_size as f32).sqrt();
        embedding_rows(&self.embed, tokens, scale, &self.device)
    }

    /// The tied embedding as the device holds it: the head's row blocks where the table is
    /// larger than one buffer there ([`Linear::within`]), else the whole table.
    ///
    /// # Shapes
    /// - → `[rows_b, hidden]` each, `Σ rows_b = vocab`
    pub(crate) fn embed_blocks(&self) -> &[Tensor<2>] {
        match self.head.row_blocks() {
            [] => std::slice::from_ref(&self.embed),
            blocks => blocks,
        }
    }

    /// Final norm + tied LM head (+ soft-cap when configured).
    ///
    /// # Shapes
    /// - `h`: `[T, hidden]` (before the final norm) → `[T, vocab]`
    pub fn logits(&self, h: Tensor<2>) -> Tensor<2> {
        self.head_logits(self.norm.forward(h))
    }

    /// The head (and soft-cap) over rows already through the final norm.
    ///
    /// # Shapes
    /// - `x`: `[T, hidden]` → `[T, vocab]`
    fn head_logits(&self, x: Tensor<2>) -> Tensor<2> {
        let logits = self.head.forward(x);
        match self.config.final_logit_softcapping {
            Some(cap) => logits.div_scalar(cap).tanh().mul_scalar(cap),
            None => logits,
        }
    }

    /// The greedy choice after each row: exactly the argmax (first on ties) of
    /// [`Self::logits`]'s rows. On the CPU with a quantised head (GGUF Q8_0) and no soft-cap
    /// (whose tanh could round distinct logits to a tie), the certified search of
    /// [`Linear::argmax`] finds it computing only the few exact logits its error bound cannot
    /// exclude; otherwise the logits are computed and searched ([`crate::choice::argmax_rows`]: on the host on
    /// the CPU, on the device elsewhere).
    ///
    /// # Shapes
    /// - `h`: `[T, hidden]` (before the final norm) → `T` ids
    pub fn greedy(&self, h: Tensor<2>) -> Vec<u32> {
        let x = self.norm.forward(h);
        if self.config.final_logit_softcapping.is_none()
            && let Some(ids) = self.head.argmax(&x)
        {
            return ids;
        }
        crate::choice::argmax_rows(self.head_logits(x))
    }

    /// Runs a chunk through the model, updating `kv` (one cache per layer, built by the caller
    /// from [`Self::cache_specs`] under its own policy).
    ///
    /// # Shapes
    /// - `req.tokens`: `T` ids at positions `start..start+T`
    /// - returns logits `[1, vocab]` (`Last`) or `[T, vocab]` (`All`); hidden states `[T, hidden]`
    pub fn forward(
        &self,
        req: &ForwardRequest<'_>,
        kv: &mut dyn KvLayers,
    ) -> Result<ForwardOutput> {
        let mut out = self.forward_batch(std::slice::from_ref(req), &mut [kv])?;
        Ok(out.pop().expect("one output per request"))
    }

    /// Runs chunks of several sequences in one pass, each with its own caches: the chunks'
    /// rows are stacked for every projection and MLP (one weight pass for all), and each
    /// sequence attends only over its own caches. With GGUF blocks on the CPU every projection
    /// runs the batch-invariant block kernel (other weights: with at most
    /// [`crate::linear::QUANT_MAX_ROWS`] rows in all), so each sequence's results are bit for
    /// bit those of its own [`Self::forward`]. All requests ask for the same `hidden_after` and
    /// `capture_attention`. On a GPU, a greedy forward of at most 16 rows replays a recording
    /// of the same forward where one exists (`gemma::replay`; [`Self::replay_stats`]): the
    /// same kernels on the same inputs, so the same bits.
    ///
    /// # Shapes
    /// - per request as in [`Self::forward`]; `kvs[i]` holds request `i`'s caches
    pub fn forward_batch(
        &self,
        reqs: &[ForwardRequest<'_>],
        kvs: &mut [&mut dyn KvLayers],
    ) -> Result<Vec<ForwardOutput>> {
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        // On a GPU, a greedy forward recorded before replays in one dispatch.
        if let Some(outs) = self.replayed(reqs, kvs)? {
            return Ok(outs);
        }
        let Pass {
            x,
            spans,
            hidden,
            attention,
        } = self.pass(reqs, kvs, None)?;
        let h = self.config.hidden_size;
        let rows = |t: &Tensor<2>, r: &std::ops::Range<usize>| t.clone().slice([r.clone(), 0..h]);
        // Every request's wanted rows through the head in one call: greedy choices only when
        // no request wants logits, else logits (searched on the host for greedy requests).
        let (head_in, counts) = head_input(reqs, &spans, &x);
        let total: usize = counts.iter().sum();
        let only_greedy = reqs.iter().all(|r| r.logits == Logits::None || r.greedy());
        let (logits, greedy) = match head_in {
            None => (None, None),
            Some(h) if only_greedy => (None, Some(self.greedy(h))),
            Some(h) => (Some(self.logits(h)), None),
        };
        let mut at = 0;
        let mut outs = Vec::with_capacity(reqs.len());
        for (((req, span), n), attention) in reqs.iter().zip(&spans).zip(counts).zip(attention) {
            let part = (n > 0).then(|| {
                let l = logits.as_ref().map(|l| {
                    if n == total {
                        return l.clone();
                    }
                    let v = l.dims()[1];
                    l.clone().slice([at..at + n, 0..v])
                });
                let g = greedy.as_ref().map(|g| g[at..at + n].to_vec());
                at += n;
                (l, g)
            });
            // Greedy choices searched in the logits, or (on a GPU) a draw: only the ids.
            let chosen = match (&part, req.choice, req.draw()) {
                (Some((Some(l), _)), Some(c), first) => {
                    c.from_logits(l, first.map_or(0, |(_, f)| f))
                }
                _ => None,
            };
            let (logits, chosen) = match part {
                None => (None, None),
                Some(_) if chosen.is_some() => (None, chosen),
                Some((l, g)) => (l, g),
            };
            outs.push(ForwardOutput {
                logits,
                chosen,
                hidden: hidden
                    .iter()
                    .map(|t| rows(t.as_ref().expect("every requested layer ran"), &span.rows))
                    .collect(),
                attention,
            });
        }
        Ok(outs)
    }

    /// Refuses a request the model or its caches cannot run.
    pub(super) fn check_request(&self, req: &ForwardRequest<'_>, kv: &dyn KvLayers) -> Result<()> {
        let c = &self.config;
        let t = req.tokens.len();
        if t == 0 {
            return Err(ModelError::Input("empty token chunk".into()));
        }
        if let Some(&bad) = req.tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(ModelError::Input(format!(
                "token id {bad} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        if req.start + t > c.max_position_embeddings {
            return Err(ModelError::Input(format!(
                "positions up to {} exceed the model's context of {}",
                req.start + t,
                c.max_position_embeddings
            )));
        }
        if let Some(tree) = req.tree {
            if tree.len() != t {
                return Err(ModelError::Input(format!(
                    "a tree of {} rows for a chunk of {t} tokens",
                    tree.len()
                )));
            }
            if self.device != Device::flex() {
                return Err(ModelError::Input(
                    "tree rows run on the CPU: verify a chain on this device".into(),
                ));
            }
        }
        if kv.layer_count() != self.layers.len() {
            return Err(ModelError::Cache(format!(
                "{} caches for {} layers",
                kv.layer_count(),
                self.layers.len()
            )));
        }
        if let Some(&bad) = req.hidden_after.iter().find(|&&l| l >= self.layers.len()) {
            return Err(ModelError::Input(format!(
                "hidden_after layer {bad} >= {} layers",
                self.layers.len()
            )));
        }
        Ok(())
    }
}

/// Rows `tokens` of an embedding table times `scale`, on `device` (the table may be on the
/// host where the device holds it in row blocks: [`Linear::within`]).
///
/// # Shapes
/// - `table`: `[vocab, hidden]`, `tokens`: `T` ids → `[T, hidden]`
pub fn embedding_rows(table: &Tensor<2>, tokens: &[u32], scale: f32, device: &Device) -> Tensor<2> {
    let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
    let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [tokens.len()]), &table.device());
    table
        .clone()
        .select(0, ids)
        .mul_scalar(scale)
        .to_device(device)
}
