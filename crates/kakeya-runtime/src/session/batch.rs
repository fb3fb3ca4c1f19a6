//! Several sessions in one stacked forward: decode steps, prompt chunks and verify blocks of
//! different sequences side by side (a server's continuous batching).

use super::{Session, Verified, Want, logits_row, scores};
use crate::error::{Result, RuntimeError};
use crate::sampler::{Sampler, Scores};
use kakeya_models::Logits;

impl<'m> Session<'m> {
    /// Runs one token in each session in one stacked forward
    /// ([`GemmaModel::forward_batch`]: bit for bit each session's own [`Self::step_for`] while
    /// the batch stays within the block kernel's rows); returns what each session's sampler
    /// picks from. The sessions must share one model and one drafter (or none).
    pub fn step_batch(
        sessions: &mut [&mut Session<'m>],
        tokens: &[u32],
        samplers: &[&Sampler],
    ) -> Result<Vec<Scores>> {
        if sessions.len() != tokens.len() || samplers.len() != tokens.len() {
            return Err(RuntimeError::Input(format!(
                "{} tokens and {} samplers for {} sessions",
                tokens.len(),
                samplers.len(),
                sessions.len()
            )));
        }
        let chunks: Vec<&[u32]> = tokens.iter().map(std::slice::from_ref).collect();
        Self::run_batch(sessions, &chunks, samplers)
    }

    /// Runs `chunks[i]` at session `i`'s next positions, all in one stacked forward — decode
    /// steps beside a prompt chunk, continuous-batching style — and returns, per session, what
    /// its sampler picks the token after its chunk from. Bit for bit each session's own
    /// forward of its chunk while the rows stay within the block kernel's (or at any count
    /// when [`GemmaModel::rows_invariant_at_any_count`]) and at most
    /// [`kakeya_models::linear::QUANT_MAX_ROWS`] sessions run. The sessions must share one
    /// model and one drafter (or none).
    pub fn run_batch(
        sessions: &mut [&mut Session<'m>],
        chunks: &[&[u32]],
        samplers: &[&Sampler],
    ) -> Result<Vec<Scores>> {
        let wants: Vec<Want<'_>> = samplers.iter().copied().map(Want::Next).collect();
        Ok(Self::verify_batch(sessions, chunks, &wants)?
            .into_iter()
            .map(|v| match v {
                Verified::Scores(s) => s,
                Verified::Block(_) => unreachable!("every session runs its next chunk"),
            })
            .collect())
    }

    /// [`Self::run_batch`] where some sessions verify a block: session `i` with
    /// [`Want::Block`] runs `blocks[i]` (its newest token, then drafts) and gets its sampler's
    /// choice after every row, as [`crate::Verifier::verify`] (greedy) or
    /// [`crate::Verifier::verify_sampled`] gives it — the rows stay in its caches until it
    /// truncates the rejected ones ([`Self::truncate`]); the others run their chunk as
    /// `run_batch` does. Bit for bit each session's own forward under `run_batch`'s
    /// conditions.
    pub fn verify_batch(
        sessions: &mut [&mut Session<'m>],
        blocks: &[&[u32]],
        wants: &[Want<'_>],
    ) -> Result<Vec<Verified>> {
        Self::check_batch(sessions, blocks, wants.len())?;
        let logits: Vec<Logits> = wants
            .iter()
            .map(|w| match w {
                Want::Next(s) => s.wants(),
                Want::Block(s) => s.draw().map_or(Logits::GreedyAll, Logits::DrawAll),
            })
            .collect();
        let outs = Self::forward_many(sessions, blocks, &logits, &[], &[])?;
        let mut verified = Vec::with_capacity(outs.len());
        for (((s, out), want), block) in sessions.iter_mut().zip(outs).zip(wants).zip(blocks) {
            verified.push(match *want {
                Want::Next(sampler) => {
                    s.commit()?;
                    Verified::Scores(scores(out, sampler))
                }
                Want::Block(sampler) => Verified::Block(match out.chosen {
                    Some(ids) => ids,
                    // A draw on the host: row `i` predicts the block's position `i + 1`.
                    None => {
                        let rows = logits_row(out.logits.expect("asked for logits"));
                        let vocab = s.model.config.vocab_size;
                        let first = s.len - block.len() + 1;
                        crate::speculative::sampled_choices(&rows, vocab, first, sampler)
                    }
                }),
            });
        }
        Ok(verified)
    }

    /// Refuses a batch whose counts disagree or whose chunk is empty or past the context.
    fn check_batch(
        sessions: &[&mut Session<'m>],
        chunks: &[&[u32]],
        samplers: usize,
    ) -> Result<()> {
        if sessions.len() != chunks.len() || samplers != chunks.len() {
            return Err(RuntimeError::Input(format!(
                "{} chunks and {samplers} samplers for {} sessions",
                chunks.len(),
                sessions.len()
            )));
        }
        if let Some((s, c)) = sessions
            .iter()
            .zip(chunks)
            .find(|(s, c)| c.is_empty() || s.len + c.len() > s.model.config.max_position_embeddings)
        {
            return Err(RuntimeError::Input(format!(
                "a chunk of {} tokens after {} does not fit the model's context of {}",
                c.len(),
                s.len,
                s.model.config.max_position_embeddings
            )));
        }
        Ok(())
    }
}
