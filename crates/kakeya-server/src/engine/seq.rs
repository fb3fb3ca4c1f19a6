//! One sequence in the engine: its verifier (a fresh session, or one forked from the prefix
//! cache), proposer, sampler and stop rules, and what it sends its client.

use std::sync::Arc;
use std::time::Instant;

use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::{
    DraftKind, KvSetup, NgramTable, PrefixCache, Proposer, RuntimeError, Sampler, Scores,
    SpecConfig, SpecDecoder, StopReason, TokenSink, Verifier,
};

use super::{Event, Job, Outcome, SpecSummary};
use crate::metrics::Metrics;

/// One sequence in the engine.
pub(super) struct Seq<'m> {
    pub(super) job: Job,
    pub(super) draft: Option<DraftKind>,
    pub(super) verifier: Verifier<'m>,
    pub(super) proposer: Option<Box<dyn Proposer + 'm>>,
    pub(super) dec: Option<SpecDecoder>,
    pub(super) sampler: Sampler,
    pub(super) sink: TokenSink<'static>,
    /// Prompt and committed tokens; the newest is not yet in the caches.
    pub(super) tokens: Vec<u32>,
    pub(super) prefilled: usize,
    /// Prompt positions taken from the prefix cache.
    pub(super) cached: usize,
    pub(super) sent: usize,
    pub(super) stop: Option<StopReason>,
    pub(super) last_sent: Option<Instant>,
    pub(super) first_at: Option<Instant>,
    pub(super) batched_steps: usize,
}

impl<'m> Seq<'m> {
    /// A sequence for `job`, on a session forked from the prefix cache when it holds a
    /// prefix of the prompt.
    pub(super) fn new(
        job: Job,
        model: &'m GemmaModel,
        setup: KvSetup<'m>,
        drafter: Option<&'m DFlashDrafter>,
        table: Option<&Arc<NgramTable>>,
        speculation: Option<(DraftKind, SpecConfig)>,
        prefix: &mut PrefixCache<'m>,
    ) -> Result<Self, Box<(Job, RuntimeError)>> {
        let ctx = model.config.max_position_embeddings;
        let built = (|| {
            if job.prompt.is_empty() || job.prompt.len() >= ctx {
                return Err(RuntimeError::Input(format!(
                    "the prompt has {} tokens; the model's context holds {ctx} (prompt and output)",
                    job.prompt.len()
                )));
            }
            let block = speculation.map_or(1, |(_, c)| c.block_size);
            // Every session of this engine comes from one setup and block size, so a fork
            // keeps the rollback a block needs.
            let verifier = match prefix.fork(&job.prompt) {
                Some(session) => Verifier::from_session(session),
                None => Verifier::new(model, setup, block)?,
            };
            let proposer = speculation
                .map(|(k, _)| k.proposer(drafter, table.cloned()))
                .transpose()?;
            let dec = speculation
                .map(|(_, c)| SpecDecoder::new(c, &job.cfg.sampling, ctx))
                .transpose()?;
            Ok((verifier, proposer, dec))
        })();
        match built {
            Ok((verifier, proposer, dec)) => {
                let mut s = Self {
                    draft: speculation.map(|(k, _)| k),
                    sampler: Sampler::new(job.cfg.sampling.clone()),
                    sink: TokenSink::silent(&job.cfg),
                    tokens: Vec::new(),
                    prefilled: verifier.len(),
                    cached: verifier.len(),
                    sent: 0,
                    stop: None,
                    last_sent: None,
                    first_at: None,
                    batched_steps: 0,
                    verifier,
                    proposer,
                    dec,
                    job,
                };
                // A fork of a sequence that released its store drafts from lookups.
                s.match_proposer_to_store();
                Ok(s)
            }
            Err(e) => Err(Box::new((job, e))),
        }
    }

    /// A proposer whose drafter reads the compact store gives way to its lookups where the
    /// session keeps no store.
    fn match_proposer_to_store(&mut self) {
        let needs_store = self
            .proposer
            .as_ref()
            .is_some_and(|p| p.drafter().is_some());
        if needs_store && !self.verifier.session().keeps_store() {
            self.proposer = self.proposer.take().and_then(|p| p.lookups());
        }
    }

    /// A decode step beside other sequences' rows: the sequence drafts from lookups from now
    /// on (the drafter's drafts need a forward of their own, taken only alone), so it stops
    /// keeping the drafter's compact store ([`kakeya_runtime::Session::release_store`]; kept
    /// where the KV mode reads it).
    pub(super) fn join_batch(&mut self) {
        self.verifier.session_mut().release_store();
        self.match_proposer_to_store();
    }

    pub(super) fn decoding(&self) -> bool {
        self.stop.is_none() && self.prefilled == self.job.prompt.len()
    }

    /// Takes the token chosen for the next position (not yet in the caches).
    pub(super) fn accept(&mut self, tok: u32) {
        self.tokens.push(tok);
        self.stop = self.sink.push(tok);
        self.stop_at_context_end();
    }

    /// Stops a sequence that has filled the model's context, flushing what its sink holds.
    fn stop_at_context_end(&mut self) {
        let ctx = self.verifier.model().config.max_position_embeddings;
        if self.stop.is_none() && self.verifier.len() >= ctx {
            self.stop = Some(StopReason::ContextFull);
            self.sink.flush();
        }
    }

    /// Runs the next prefill chunk; the last one picks the first token.
    pub(super) fn prefill_chunk(&mut self, chunk: usize) -> Result<(), RuntimeError> {
        let prompt = &self.job.prompt;
        let end = (self.prefilled + chunk).min(prompt.len());
        let scores = self.verifier.session_mut().run_for(
            &prompt[self.prefilled..end],
            chunk,
            &self.sampler,
        )?;
        self.prefilled_to(end, &scores);
        Ok(())
    }

    /// The prompt is in the caches up to `end`, `scores` being what its last row gave; the
    /// whole prompt picks the first token.
    pub(super) fn prefilled_to(&mut self, end: usize, scores: &Scores) {
        self.prefilled = end;
        if end == self.job.prompt.len() {
            self.tokens = self.job.prompt.clone();
            let tok = self.sampler.pick_scores(scores, end);
            self.accept(tok);
        }
    }

    /// One speculative block.
    pub(super) fn block(&mut self, metrics: &Metrics) -> Result<(), RuntimeError> {
        let (Some(dec), Some(proposer)) = (self.dec.as_mut(), self.proposer.as_mut()) else {
            return Err(RuntimeError::Input("no speculation configured".into()));
        };
        let before = self.tokens.len();
        self.stop = dec.block(
            &mut self.verifier,
            proposer.as_mut(),
            &mut self.tokens,
            &mut self.sink,
        )?;
        if self.stop.is_some() {
            self.sink.flush();
        }
        metrics.committed(self.tokens.len() - before);
        Ok(())
    }

    /// Commits a block the batch verified beside other sequences' rows
    /// ([`SpecDecoder::commit_in_batch`]): `drafts` after the newest token (and how many of
    /// them the proposer made, the rest filler), `choices` the choice after each row.
    pub(super) fn commit_in_batch(
        &mut self,
        drafts: (&[u32], usize),
        choices: &[u32],
    ) -> Result<(), RuntimeError> {
        let Some(dec) = self.dec.as_mut() else {
            return Err(RuntimeError::Input("no speculation configured".into()));
        };
        self.stop = dec.commit_in_batch(
            &mut self.verifier,
            drafts,
            choices,
            &mut self.tokens,
            &mut self.sink,
        )?;
        if self.stop.is_some() {
            self.sink.flush();
        }
        self.stop_at_context_end();
        Ok(())
    }

    /// Sends what the sink released since last time; the final event when it stopped.
    /// Returns false when the client is gone.
    pub(super) fn emit(&mut self, metrics: &Metrics) -> bool {
        let released = self.sink.released();
        if released.len() > self.sent {
            let now = Instant::now();
            let since = self.last_sent.unwrap_or(self.job.arrived);
            let n = released.len() - self.sent;
            metrics.tokens(n, (now - since).as_secs_f64(), self.last_sent.is_none());
            if self.first_at.is_none() {
                self.first_at = Some(now);
            }
            self.last_sent = Some(now);
            let new = released[self.sent..].to_vec();
            self.sent = released.len();
            if self.job.events.send(Event::Tokens(new)).is_err() {
                return false;
            }
        }
        if let Some(reason) = self.stop {
            let outcome = self.outcome(reason);
            return self.job.events.send(Event::Done(Box::new(outcome))).is_ok();
        }
        true
    }

    pub(super) fn outcome(&self, stop_reason: StopReason) -> Outcome {
        let spec = self.dec.as_ref().map(SpecDecoder::stats);
        let speculative = spec.filter(|s| s.blocks > 0).map(|s| SpecSummary {
            draft: self.draft.unwrap_or(DraftKind::Combined),
            blocks: s.blocks,
            drafted: s.drafted,
            accepted: s.accepted,
            mean_acceptance_length: s.mean_acceptance_length,
        });
        let mode = match (&speculative, self.batched_steps) {
            (Some(_), 0) => "speculative",
            (Some(_), _) => "speculative+batched",
            (None, _) => "batched",
        };
        let generated = self.sink.tokens().len();
        let decode_secs = self
            .first_at
            .zip(self.last_sent)
            .map_or(0.0, |(a, b)| (b - a).as_secs_f64());
        let kv = self.verifier.kv_bytes();
        Outcome {
            stop_reason,
            prompt_tokens: self.job.prompt.len(),
            cached_prompt_tokens: self.cached,
            completion_tokens: generated,
            mode,
            batched_steps: self.batched_steps,
            speculative,
            kv_mode: self.verifier.session().policy().mode,
            kv,
            time_to_first_token_s: self
                .first_at
                .map_or(0.0, |t| (t - self.job.arrived).as_secs_f64()),
            decode_tok_s: if decode_secs > 0.0 {
                generated.saturating_sub(1) as f64 / decode_secs
            } else {
                0.0
            },
        }
    }
}
