//! Autoregressive generation over the Gemma verifier with caller-owned caches.

use std::time::Instant;

use serde::Serialize;

use crate::error::{Result, RuntimeError};
use crate::guard::RunawayGuard;
use crate::kv::{KvBytes, KvMode};
use crate::sampler::{Sampler, Sampling};
use crate::session::{Session, Want};

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
    /// Stop runaway repetition (`None`: never).
    pub loop_guard: Option<RunawayGuard>,
}

impl GenerationConfig {
    /// Greedy decoding of up to `max_tokens` tokens with no stop token and no loop guard:
    /// every token generated (benchmarks, equivalence tests, verifier rollouts).
    pub fn greedy(max_tokens: usize, prefill_chunk: usize) -> Self {
        Self {
            max_tokens,
            sampling: Sampling::Greedy,
            stop_tokens: Vec::new(),
            prefill_chunk,
            loop_guard: None,
        }
    }
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
    /// The runaway-loop guard fired (the repeated tail was trimmed).
    Runaway,
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
    /// K/V bytes held at the end, in total (`kv.total`).
    pub kv_bytes: usize,
    /// The KV mode.
    pub kv_mode: Option<KvMode>,
    /// K/V bytes held at the end, by part.
    pub kv: KvBytes,
}

/// Output of [`generate`].
#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    /// Generated ids (without the stop token).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub stop_reason: StopReason,
    /// True when the runaway-loop guard ended it.
    pub stopped_on_runaway: bool,
    /// Figures.
    pub stats: GenerationStats,
    /// Speculation figures (speculative decoding only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec: Option<crate::speculative::SpecStats>,
}

/// Collects generated tokens and applies the stop rules one token at a time, so that every
/// decoder (autoregressive, speculative, or a server's batch) stops at exactly the same token.
/// A token is *released* as soon as no rule can take it back (the loop guard may hold back a
/// repeating tail): [`Self::released`] lists them, and `on_token`, when given, sees each one.
pub struct TokenSink<'a> {
    tokens: Vec<u32>,
    released: usize,
    stop_tokens: Vec<u32>,
    max_tokens: usize,
    loop_guard: Option<RunawayGuard>,
    on_token: Option<&'a mut dyn FnMut(u32)>,
}

impl std::fmt::Debug for TokenSink<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenSink")
            .field("tokens", &self.tokens.len())
            .field("released", &self.released)
            .field("max_tokens", &self.max_tokens)
            .finish_non_exhaustive()
    }
}

impl<'a> TokenSink<'a> {
    /// An empty output under `cfg`'s stop rules; `on_token` sees each released token.
    pub fn new(cfg: &GenerationConfig, on_token: &'a mut dyn FnMut(u32)) -> Self {
        Self {
            on_token: Some(on_token),
            ..TokenSink::silent(cfg)
        }
    }

    /// Tokens kept so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Tokens no rule can take back any more (a prefix of [`Self::tokens`]).
    pub fn released(&self) -> &[u32] {
        &self.tokens[..self.released]
    }

    /// Tokens still allowed before `max_tokens`.
    pub fn remaining(&self) -> usize {
        self.max_tokens.saturating_sub(self.tokens.len())
    }

    fn release(&mut self, upto: usize) {
        while self.released < upto {
            if let Some(f) = self.on_token.as_mut() {
                f(self.tokens[self.released]);
            }
            self.released += 1;
        }
    }

    /// Offers the next generated token; `Some(reason)` when generation must stop here.
    pub fn push(&mut self, tok: u32) -> Option<StopReason> {
        if self.stop_tokens.contains(&tok) {
            self.release(self.tokens.len());
            return Some(StopReason::StopToken);
        }
        self.tokens.push(tok);
        if let Some(guard) = &self.loop_guard {
            if let Some(keep) = guard.check(&self.tokens) {
                self.tokens.truncate(keep);
                self.release(keep);
                return Some(StopReason::Runaway);
            }
            let hold = guard.holdback(&self.tokens);
            self.release(self.tokens.len() - hold);
        } else {
            self.release(self.tokens.len());
        }
        if self.tokens.len() >= self.max_tokens {
            self.release(self.tokens.len());
            return Some(StopReason::MaxTokens);
        }
        None
    }

    /// Releases anything held back (the output ended for a reason outside the sink's rules).
    pub fn flush(&mut self) {
        self.release(self.tokens.len());
    }

    /// Releases anything held back and returns the tokens.
    pub fn finish(mut self) -> Vec<u32> {
        self.flush();
        self.tokens
    }
}

impl TokenSink<'static> {
    /// An empty output under `cfg`'s stop rules that only records what it releases (read it
    /// with [`Self::released`]).
    pub fn silent(cfg: &GenerationConfig) -> Self {
        Self {
            tokens: Vec::new(),
            released: 0,
            stop_tokens: cfg.stop_tokens.clone(),
            max_tokens: cfg.max_tokens,
            loop_guard: cfg.loop_guard,
            on_token: None,
        }
    }
}

/// Tokens per second, 0 for an empty interval.
pub(crate) fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 { n as f64 / secs } else { 0.0 }
}

/// Prefills `prompt` into `session` and generates; `on_token` sees each emitted token.
pub fn generate(
    session: &mut Session<'_>,
    prompt: &[u32],
    cfg: &GenerationConfig,
    on_token: &mut dyn FnMut(u32),
) -> Result<Generation> {
    if cfg.max_tokens == 0 {
        return Err(RuntimeError::Input("max_tokens must be at least 1".into()));
    }
    let sampler = Sampler::new(cfg.sampling.clone());
    let ctx = session.model().config.max_position_embeddings;
    let t0 = Instant::now();
    let mut scores = session.run_for(prompt, cfg.prefill_chunk, &sampler)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let mut sink = TokenSink::new(cfg, on_token);
    let t1 = Instant::now();
    let mut steps = 0;
    let stop_reason = loop {
        let tok = sampler.pick_scores(&scores, session.len());
        if let Some(reason) = sink.push(tok) {
            break reason;
        }
        if session.len() >= ctx {
            break StopReason::ContextFull;
        }
        scores = session.run_for(&[tok], 1, &sampler)?;
        steps += 1;
    };
    let decode_secs = t1.elapsed().as_secs_f64();
    Ok(finished(
        session,
        prompt.len(),
        sink.finish(),
        stop_reason,
        (prefill_secs, steps, decode_secs),
    ))
}

/// The [`Generation`] of a finished sequence; `timing` = (prefill seconds, decode steps,
/// decode seconds).
fn finished(
    session: &Session<'_>,
    prompt_len: usize,
    tokens: Vec<u32>,
    stop_reason: StopReason,
    (prefill_secs, steps, decode_secs): (f64, usize, f64),
) -> Generation {
    let stats = GenerationStats {
        prompt_tokens: prompt_len,
        generated_tokens: tokens.len(),
        prefill_secs,
        decode_steps: steps,
        decode_secs,
        prefill_tok_s: rate(prompt_len, prefill_secs),
        decode_tok_s: rate(steps, decode_secs),
        kv_bytes: session.kv_bytes().total,
        kv_mode: Some(session.policy().mode),
        kv: session.kv_bytes(),
    };
    Generation {
        tokens,
        stop_reason,
        stopped_on_runaway: stop_reason == StopReason::Runaway,
        stats,
        spec: None,
    }
}

/// Generates for several prompts at once, `sessions[i]` for `prompts[i]`: each prompt is
/// prefilled alone, then the sequences still running decode in lock-step, one stacked forward
/// per step ([`Session::run_batch`]), so each sequence's output is exactly what [`generate`]
/// gives it alone (same stop rules, same position-keyed sampling). Keep the batch within
/// [`kakeya_models::linear::QUANT_MAX_ROWS`] sequences for the bit-for-bit guarantee on the CPU.
/// A sequence's `decode_secs` is the wall time of the steps it took part in.
pub fn generate_batch(
    sessions: &mut [Session<'_>],
    prompts: &[&[u32]],
    cfg: &GenerationConfig,
) -> Result<Vec<Generation>> {
    if cfg.max_tokens == 0 {
        return Err(RuntimeError::Input("max_tokens must be at least 1".into()));
    }
    if sessions.len() != prompts.len() {
        return Err(RuntimeError::Input(format!(
            "{} sessions for {} prompts",
            sessions.len(),
            prompts.len()
        )));
    }
    let sampler = Sampler::new(cfg.sampling.clone());
    let mut scores = Vec::with_capacity(prompts.len());
    let mut prefill_secs = Vec::with_capacity(prompts.len());
    for (session, prompt) in sessions.iter_mut().zip(prompts) {
        let t0 = Instant::now();
        scores.push(session.run_for(prompt, cfg.prefill_chunk, &sampler)?);
        prefill_secs.push(t0.elapsed().as_secs_f64());
    }
    let mut sinks: Vec<TokenSink<'_>> = prompts.iter().map(|_| TokenSink::silent(cfg)).collect();
    let mut stop: Vec<Option<StopReason>> = vec![None; prompts.len()];
    let mut steps = vec![0usize; prompts.len()];
    let mut decode_secs = vec![0f64; prompts.len()];
    loop {
        let t = Instant::now();
        let mut live = Vec::new();
        let mut next = Vec::new();
        for (i, session) in sessions.iter().enumerate() {
            if stop[i].is_some() {
                continue;
            }
            let tok = sampler.pick_scores(&scores[i], session.len());
            stop[i] = sinks[i].push(tok);
            if stop[i].is_none() && session.len() >= session.model().config.max_position_embeddings
            {
                stop[i] = Some(StopReason::ContextFull);
            }
            if stop[i].is_none() {
                live.push(i);
                next.push(tok);
            }
        }
        if live.is_empty() {
            break;
        }
        let mut running: Vec<&mut Session<'_>> = sessions
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| stop[*i].is_none())
            .map(|(_, s)| s)
            .collect();
        let chunks: Vec<&[u32]> = next.iter().map(std::slice::from_ref).collect();
        let wants = vec![Want::Next(&sampler); next.len()];
        let out = Session::run_batch(&mut running, &chunks, &wants)?;
        let secs = t.elapsed().as_secs_f64();
        for (&i, l) in live.iter().zip(out) {
            scores[i] = l.into_scores().expect("every session ran its next token");
            steps[i] += 1;
            decode_secs[i] += secs;
        }
    }
    Ok(sessions
        .iter()
        .zip(sinks)
        .enumerate()
        .map(|(i, (session, sink))| {
            finished(
                session,
                prompts[i].len(),
                sink.finish(),
                stop[i].expect("every sequence stopped"),
                (prefill_secs[i], steps[i], decode_secs[i]),
            )
        })
        .collect())
}
