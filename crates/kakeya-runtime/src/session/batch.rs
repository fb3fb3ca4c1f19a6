//! Several sessions in one stacked forward: decode steps, prompt chunks and verify blocks of
//! different sequences side by side (a server's continuous batching).

use super::{Session, Verified, Want, logits_row, scores};
use crate::error::{Result, RuntimeError};
use kakeya_models::Logits;

impl<'m> Session<'m> {
    /// Runs `chunks[i]` at session `i`'s next positions, all in one stacked forward — decode
    /// steps (one token each) beside a prompt chunk and verify blocks, continuous-batching
    /// style ([`GemmaModel::forward_batch`]). A session with [`Want::Next`] gets what its
    /// sampler picks the token after its chunk from; one with [`Want::Block`] runs its block
    /// (its newest token, then drafts) and gets its sampler's choice after every row, as
    /// [`crate::Verifier::verify`] (greedy) or [`crate::Verifier::verify_sampled`] gives it —
    /// the rows stay in its caches until it truncates the rejected ones ([`Self::truncate`]).
    /// Bit for bit each session's own forward of its chunk while the rows stay within the
    /// block kernel's (or at any count when [`GemmaModel::rows_invariant_at_any_count`]) and
    /// at most [`kakeya_models::linear::QUANT_MAX_ROWS`] sessions run. The sessions must share
    /// one model and one drafter (or none).
    ///
    /// [`GemmaModel::forward_batch`]: kakeya_models::GemmaModel::forward_batch
    /// [`GemmaModel::rows_invariant_at_any_count`]: kakeya_models::GemmaModel::rows_invariant_at_any_count
    pub fn run_batch(
        sessions: &mut [&mut Session<'m>],
        blocks: &[&[u32]],
        wants: &[Want<'_>],
    ) -> Result<Vec<Verified>> {
        Self::check_batch(sessions, blocks, wants.len())?;
        let heads: Vec<_> = wants
            .iter()
            .map(|w| match w {
                Want::Next(s) => (Logits::Last, Some(s.choice())),
                Want::Block(s) => (Logits::All, Some(s.choice())),
            })
            .collect();
        let outs = Self::forward_many(sessions, blocks, &heads, &[], &[])?;
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
