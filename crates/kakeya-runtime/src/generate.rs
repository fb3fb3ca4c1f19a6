//! Autoregressive generation over the Gemma verifier with caller-owned caches.

use std::time::Instant;

use burn::tensor::Tensor;
use kakeya_models::{ForwardRequest, Gemma3Model, Logits};
use serde::Serialize;

use crate::error::{Result, RuntimeError};
use crate::kv::KvCache;
use crate::sampler::{Sampler, Sampling};

/// Copies one row of logits `[1, vocab]` to the host.
pub fn logits_row(logits: Tensor<2>) -> Vec<f32> {
    logits
        .into_data()
        .try_into_vec::<f32>()
        .expect("logits are f32")
}

/// A model plus the caches of one sequence.
#[derive(Debug)]
pub struct Session<'m> {
    model: &'m Gemma3Model,
    caches: Vec<KvCache>,
    len: usize,
}

impl<'m> Session<'m> {
    /// An empty sequence; rings keep `slack` positions of exact rollback.
    pub fn new(model: &'m Gemma3Model, slack: usize) -> Self {
        Self {
            model,
            caches: KvCache::for_specs(&model.cache_specs(), slack),
            len: 0,
        }
    }

    /// Positions processed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before any token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The model.
    pub fn model(&self) -> &'m Gemma3Model {
        self.model
    }

    /// Bytes of K/V held by all layers' caches.
    pub fn kv_bytes(&self) -> usize {
        self.caches.iter().map(KvCache::nbytes).sum()
    }

    /// Runs `tokens` in chunks of at most `chunk`; returns the last position's logits.
    pub fn prefill(&mut self, tokens: &[u32], chunk: usize) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(RuntimeError::Input("empty prompt: nothing to run".into()));
        }
        let ctx = self.model.config.max_position_embeddings;
        if self.len + tokens.len() > ctx {
            return Err(RuntimeError::Input(format!(
                "prompt of {} tokens (plus {} already in context) is longer than the model's context of {ctx}",
                tokens.len(),
                self.len
            )));
        }
        let mut last = None;
        let n = tokens.chunks(chunk.max(1)).count();
        for (i, part) in tokens.chunks(chunk.max(1)).enumerate() {
            let logits = if i + 1 == n {
                Logits::Last
            } else {
                Logits::None
            };
            let out = self.model.forward(
                &ForwardRequest::new(part, self.len, logits),
                &mut self.caches,
            )?;
            self.len += part.len();
            last = out.logits;
        }
        Ok(logits_row(last.expect("last chunk returns logits")))
    }

    /// Runs one token; returns its logits.
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        let out = self.model.forward(
            &ForwardRequest::new(&[token], self.len, Logits::Last),
            &mut self.caches,
        )?;
        self.len += 1;
        Ok(logits_row(out.logits.expect("asked for logits")))
    }

    /// Forgets positions `>= len` in every cache.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        for c in &mut self.caches {
            c.truncate(len)?;
        }
        self.len = len;
        Ok(())
    }
}

/// Generation settings.
#[derive(Debug, Clone)]
pub struct GenerationConfig {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Token choice.
    pub sampling: Sampling,
    /// Tokens that end generation (EOS, end-of-turn); not emitted.
    pub stop_tokens: Vec<u32>,
    /// Prefill chunk length.
    pub prefill_chunk: usize,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A stop token was produced.
    StopToken,
    /// `max_tokens` reached.
    MaxTokens,
    /// The model's context is full.
    ContextFull,
}

/// Measured figures of one generation.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GenerationStats {
    /// Prompt tokens prefilled.
    pub prompt_tokens: usize,
    /// Tokens generated (the stop token excluded).
    pub generated_tokens: usize,
    /// Seconds of prefill.
    pub prefill_secs: f64,
    /// Decode forwards (one per generated token after the first).
    pub decode_steps: usize,
    /// Seconds of decode forwards and sampling.
    pub decode_secs: f64,
    /// Prompt tokens per second of prefill.
    pub prefill_tok_s: f64,
    /// Decode forwards per second.
    pub decode_tok_s: f64,
    /// K/V bytes the caches hold at the end.
    pub kv_bytes: usize,
}

/// Output of [`generate`].
#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    /// Generated ids (without the stop token).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub stop_reason: StopReason,
    /// Figures.
    pub stats: GenerationStats,
}

/// Prefills `prompt` into `session` and generates; `on_token` sees each emitted token.
pub fn generate(
    session: &mut Session<'_>,
    prompt: &[u32],
    cfg: &GenerationConfig,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    let mut sampler = Sampler::new(cfg.sampling.clone());
    let ctx = session.model().config.max_position_embeddings;
    let t0 = Instant::now();
    let mut logits = session.prefill(prompt, cfg.prefill_chunk)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let mut tokens = Vec::new();
    let t1 = Instant::now();
    let mut steps = 0;
    let stop_reason = loop {
        let tok = sampler.pick(&logits);
        if cfg.stop_tokens.contains(&tok) {
            break StopReason::StopToken;
        }
        tokens.push(tok);
        on_token(tok);
        if tokens.len() >= cfg.max_tokens {
            break StopReason::MaxTokens;
        }
        if session.len() >= ctx {
            break StopReason::ContextFull;
        }
        logits = session.step(tok)?;
        steps += 1;
    };
    let decode_secs = t1.elapsed().as_secs_f64();
    let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    let stats = GenerationStats {
        prompt_tokens: prompt.len(),
        generated_tokens: tokens.len(),
        prefill_secs,
        decode_steps: steps,
        decode_secs,
        prefill_tok_s: rate(prompt.len(), prefill_secs),
        decode_tok_s: rate(steps, decode_secs),
        kv_bytes: session.kv_bytes(),
    };
    Ok(Generation {
        tokens,
        stop_reason,
        stats,
    })
}
