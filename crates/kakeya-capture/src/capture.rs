//! Capturing sequences: the verifier's greedy continuations (several decoded together), then
//! per sequence one pass over prompt + continuation recording the chosen per-layer tensors,
//! aux hidden states and drafter K/V.

use burn::tensor::Tensor;
use kakeya_models::{DFlashDrafter, ForwardRequest, GemmaModel, Logits};
use kakeya_runtime::{GenerationConfig, KvCache, Sampling, Session, generate_batch};
use kakeya_weights::Tokenizer;

use crate::config::{CaptureConfig, VerifierTensor};
use crate::error::Result;

/// Host copy of a `[rows, dim]` tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct HostMatrix {
    /// Elements per row.
    pub dim: usize,
    /// Row-major values.
    pub data: Vec<f32>,
}

impl HostMatrix {
    fn from_tensor(t: Tensor<2>) -> Self {
        let dim = t.dims()[1];
        let data = t.into_data().try_into_vec::<f32>().expect("f32 tensor");
        Self { dim, data }
    }

    fn append(&mut self, other: HostMatrix) {
        self.data.extend(other.data);
    }

    /// Keeps only `rows`, in that order.
    pub fn select(&self, rows: &[usize]) -> Self {
        let mut data = Vec::with_capacity(rows.len() * self.dim);
        for &r in rows {
            data.extend_from_slice(&self.data[r * self.dim..(r + 1) * self.dim]);
        }
        Self {
            dim: self.dim,
            data,
        }
    }
}

/// Which layers and tensors a job keeps (resolved against the models).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Verifier layers with per-layer columns.
    pub verifier_layers: Vec<usize>,
    /// Tensors kept for each of those layers.
    pub verifier_tensors: Vec<VerifierTensor>,
    /// Verifier layers whose hidden states are kept.
    pub aux_layers: Vec<usize>,
    /// Drafter layers whose context K/V are kept.
    pub drafter_layers: Vec<usize>,
}

/// Everything captured for one sequence, all positions.
#[derive(Debug, Clone)]
pub struct SequenceCapture {
    /// Token ids: `<bos>`, prompt, continuation.
    pub tokens: Vec<u32>,
    /// Prompt length (the rest is the verifier's continuation).
    pub prompt_len: usize,
    /// Vector columns in [`crate::schema::Manifest::columns`] order.
    pub columns: Vec<HostMatrix>,
}

/// Prompt ids: `<bos>` + the encoded text, cut to `max_prompt_tokens`.
pub fn prompt_ids(tok: &Tokenizer, text: &str, max: usize) -> Result<Vec<u32>> {
    let mut ids = vec![tok.bos];
    ids.extend(tok.encode(text)?);
    ids.truncate(max);
    Ok(ids)
}

/// The sequences of `texts`: `<bos>` + prompt, then the verifier's greedy continuation (up to
/// `gen_len` tokens, ending before a stop token), with the prompt length. Continuations of up
/// to `generation.batch` prompts are decoded together ([`generate_batch`]: one stacked forward
/// per step, each continuation exactly what it would be alone).
pub fn continuations(
    model: &GemmaModel,
    tok: &Tokenizer,
    texts: &[&str],
    cfg: &CaptureConfig,
) -> Result<Vec<(Vec<u32>, usize)>> {
    let g = &cfg.generation;
    let mut out = Vec::with_capacity(texts.len());
    for group in texts.chunks(g.batch.max(1)) {
        let prompts: Vec<Vec<u32>> = group
            .iter()
            .map(|t| prompt_ids(tok, t, g.max_prompt_tokens))
            .collect::<Result<_>>()?;
        let ctx = model.config.max_position_embeddings;
        // Sequences with the same length limit (gen_len, or less room in the context)
        // generate together; a prompt that fills the context stays as it is.
        let mut by_limit: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for (i, p) in prompts.iter().enumerate() {
            let limit = g.gen_len.min(ctx.saturating_sub(p.len()));
            if limit > 0 {
                by_limit.entry(limit).or_default().push(i);
            }
        }
        let mut generated: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
        for (limit, live) in by_limit {
            let gen_cfg = GenerationConfig {
                max_tokens: limit,
                sampling: Sampling::Greedy,
                stop_tokens: [Some(tok.eos), tok.end_of_turn]
                    .into_iter()
                    .flatten()
                    .collect(),
                prefill_chunk: g.chunk,
                loop_guard: None,
            };
            let mut sessions: Vec<Session<'_>> =
                live.iter().map(|_| Session::new(model, 0)).collect();
            let refs: Vec<&[u32]> = live.iter().map(|&i| prompts[i].as_slice()).collect();
            for (&i, out) in live
                .iter()
                .zip(generate_batch(&mut sessions, &refs, &gen_cfg)?)
            {
                generated[i] = out.tokens;
            }
        }
        for (mut p, tail) in prompts.into_iter().zip(generated) {
            let prompt_len = p.len();
            p.extend(tail);
            out.push((p, prompt_len));
        }
    }
    Ok(out)
}

/// Records one sequence (`tokens`, the first `prompt_len` of them the prompt) in one chunked
/// pass. Columns come out in manifest order: per verifier layer its tensors, then aux layers,
/// then per drafter layer K and V.
pub fn capture_tokens(
    model: &GemmaModel,
    drafter: Option<&DFlashDrafter>,
    (tokens, prompt_len): (Vec<u32>, usize),
    cfg: &CaptureConfig,
    sel: &Selection,
) -> Result<SequenceCapture> {
    let g = &cfg.generation;
    let n_v = sel.verifier_layers.len() * sel.verifier_tensors.len();
    if n_v == 0 && sel.aux_layers.is_empty() && sel.drafter_layers.is_empty() {
        // Nothing but token ids is kept (a continuations-only dataset): no pass to run.
        return Ok(SequenceCapture {
            tokens,
            prompt_len,
            columns: Vec::new(),
        });
    }
    // One pass over the whole sequence, chunked, into fresh caches.
    // f32 caches: the captured attention outputs are targets that f_θ's loss recomputes in
    // f32 from the captured raw Q/K/V.
    let mut caches = KvCache::for_specs(&model.cache_specs(), 0, kakeya_runtime::KvDtype::F32);
    let mut columns: Vec<Option<HostMatrix>> = vec![None; n_v + sel.aux_layers.len()];
    let mut drafter_aux: Vec<Tensor<2>> = Vec::new();
    let drafter_targets: Vec<usize> = drafter
        .filter(|_| !sel.drafter_layers.is_empty())
        .map(|d| d.config.target_layer_ids.clone())
        .unwrap_or_default();
    let mut hidden_after = sel.aux_layers.clone();
    hidden_after.extend(&drafter_targets);
    let mut start = 0;
    for chunk in tokens.chunks(g.chunk) {
        let mut req = ForwardRequest::new(chunk, start, Logits::None);
        req.hidden_after = &hidden_after;
        req.capture_attention = !sel.verifier_layers.is_empty() && !sel.verifier_tensors.is_empty();
        let out = model.forward(&req, &mut caches)?;
        start += chunk.len();
        let mut put = |slot: usize, t: Tensor<2>| {
            let m = HostMatrix::from_tensor(t);
            match &mut columns[slot] {
                Some(c) => c.append(m),
                None => columns[slot] = Some(m),
            }
        };
        for (li, &layer) in sel.verifier_layers.iter().enumerate() {
            let cap = &out.attention[layer];
            for (ti, t) in sel.verifier_tensors.iter().enumerate() {
                let v = match t {
                    VerifierTensor::QRaw => cap.q_raw.clone(),
                    VerifierTensor::KRaw => cap.k_raw.clone(),
                    VerifierTensor::VRaw => cap.v_raw.clone(),
                    VerifierTensor::AttnOut => cap.out.clone(),
                };
                put(li * sel.verifier_tensors.len() + ti, v);
            }
        }
        let (aux, dr) = out.hidden.split_at(sel.aux_layers.len());
        for (ai, h) in aux.iter().enumerate() {
            put(n_v + ai, h.clone());
        }
        if !dr.is_empty() {
            let chunk_aux = Tensor::cat(dr.to_vec(), 1);
            drafter_aux.push(chunk_aux);
        }
    }
    let mut columns: Vec<HostMatrix> = columns
        .into_iter()
        .map(|c| c.expect("every chunk fills every column"))
        .collect();
    if let Some(d) = drafter.filter(|_| !sel.drafter_layers.is_empty()) {
        // The drafter's context rows, exactly as the runtime's compact store holds them.
        let (k, v) = d.context_rows(Tensor::cat(drafter_aux, 0))?;
        let n = k.dims()[0];
        let kv = d.context_width() / d.num_layers();
        for &l in &sel.drafter_layers {
            let cols = l * kv..(l + 1) * kv;
            columns.push(HostMatrix::from_tensor(
                k.clone().slice([0..n, cols.clone()]),
            ));
            columns.push(HostMatrix::from_tensor(v.clone().slice([0..n, cols])));
        }
    }
    Ok(SequenceCapture {
        tokens,
        prompt_len,
        columns,
    })
}

/// `count` distinct positions of `0..n`, sorted, chosen by a stream seeded with
/// `(seed, sequence)`; all positions when `count >= n`.
pub fn sample_positions(n: usize, count: usize, seed: u64, sequence: usize) -> Vec<usize> {
    let mut all: Vec<usize> = (0..n).collect();
    if count >= n {
        return all;
    }
    let mut state = seed ^ (sequence as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for i in 0..count {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let j = i + (z % (n - i) as u64) as usize;
        all.swap(i, j);
    }
    let mut picked = all[..count].to_vec();
    picked.sort_unstable();
    picked
}
