//! Drafting without a drafter: prompt lookup (n-gram) decoding, and a proposer that combines
//! it with a model drafter. [Saxena, "Prompt Lookup Decoding", 2023; llama.cpp `lookup`;
//! vLLM's `ngram` proposer]

use super::proposer::Proposer;
use crate::error::Result;
use crate::kv::CompactStore;

/// Longest block of the n-gram proposer when nothing else bounds it (1 token + 7 drafts, as
/// the simulation in issue 16).
pub const NGRAM_BLOCK: usize = 8;

/// The most recent earlier occurrence of the sequence's tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramMatch {
    /// Tokens of the tail that matched (`min..=max` of the proposer).
    pub len: usize,
    /// Where the tokens that followed the earlier occurrence start.
    pub next: usize,
}

/// Prompt-lookup drafting: the longest tail of `max` down to `min` tokens that occurred
/// earlier in the sequence (prompt and output) proposes the tokens that followed its most
/// recent earlier occurrence. Costs a scan of the sequence, no forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramProposer {
    /// Shortest tail looked up.
    pub min: usize,
    /// Longest tail looked up (tried first).
    pub max: usize,
}

impl Default for NgramProposer {
    /// Tails of 3, 2 or 1 tokens (llama.cpp's and vLLM's usual range).
    fn default() -> Self {
        Self { min: 1, max: 3 }
    }
}

impl NgramProposer {
    /// The match the next draft would come from, if any.
    pub fn find(&self, tokens: &[u32]) -> Option<NgramMatch> {
        let len = tokens.len();
        for n in (self.min.max(1)..=self.max).rev() {
            if len <= n {
                continue;
            }
            let tail = &tokens[len - n..];
            // Earlier occurrences only, each followed by at least one token.
            if let Some(start) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == tail) {
                return Some(NgramMatch {
                    len: n,
                    next: start + n,
                });
            }
        }
        None
    }

    /// Up to `n` tokens that followed the match (none without one).
    pub fn draft(&self, tokens: &[u32], n: usize) -> (Option<NgramMatch>, Vec<u32>) {
        match self.find(tokens) {
            Some(m) => {
                let end = (m.next + n).min(tokens.len());
                (Some(m), tokens[m.next..end].to_vec())
            }
            None => (None, Vec::new()),
        }
    }
}

impl Proposer for NgramProposer {
    fn propose(
        &mut self,
        tokens: &[u32],
        n: usize,
        _store: Option<&mut CompactStore>,
    ) -> Result<Vec<u32>> {
        Ok(self.draft(tokens, n).1)
    }
}

/// Prompt lookup when the context backs it, a model drafter otherwise: the n-gram draft is
/// used when its tail match is at least `min_match` tokens long (the earlier text agrees with
/// more of the context than a single token), else the drafter drafts — while it earns its
/// forward. The lookup costs no forward, so it is always tried first. The proposer watches
/// what the drafter's drafts became (the tokens committed by the next call) and keeps a
/// running mean of drafts accepted per drafter call; below [`CombinedProposer::min_gain`] the
/// drafter sits out (the block is a plain step) except for one call in
/// [`CombinedProposer::retry_every`], so a weak drafter costs little and a good one is used.
pub struct CombinedProposer<'p> {
    /// The lookup.
    pub ngram: NgramProposer,
    /// Shortest tail match whose continuation is preferred to the drafter's.
    pub min_match: usize,
    /// The fallback.
    pub model: Box<dyn Proposer + 'p>,
    /// Accepted drafts per drafter call below which the drafter sits out.
    pub min_gain: f64,
    /// While sitting out, the drafter still drafts once per this many calls.
    pub retry_every: usize,
    /// Blocks drafted by the lookup, by the model, and left to plain decoding.
    pub counts: (usize, usize, usize),
    /// Running mean of drafts accepted per drafter call (starts optimistic).
    gain: f64,
    /// The last drafter call: sequence length then, and its drafts.
    last: Option<(usize, Vec<u32>)>,
    idle: usize,
}

impl<'p> CombinedProposer<'p> {
    /// Lookup over tails of 3 to 1 tokens, used from 2 matched tokens, then `model` while it
    /// gets at least one draft per call accepted.
    pub fn new(model: Box<dyn Proposer + 'p>) -> Self {
        Self {
            ngram: NgramProposer::default(),
            min_match: 2,
            model,
            min_gain: 1.0,
            retry_every: 32,
            counts: (0, 0, 0),
            gain: 2.0,
            last: None,
            idle: 0,
        }
    }

    /// Running mean of drafts accepted per drafter call.
    pub fn drafter_gain(&self) -> f64 {
        self.gain
    }

    /// Scores the previous drafter call against what was committed since.
    fn score_last(&mut self, tokens: &[u32]) {
        let Some((len, drafts)) = self.last.take() else {
            return;
        };
        let Some(committed) = tokens.get(len..) else {
            return; // rolled back past it: nothing to learn
        };
        let accepted = drafts
            .iter()
            .zip(committed)
            .take_while(|(d, c)| d == c)
            .count();
        self.gain = 0.8 * self.gain + 0.2 * accepted as f64;
    }
}

impl Proposer for CombinedProposer<'_> {
    fn propose(
        &mut self,
        tokens: &[u32],
        n: usize,
        store: Option<&mut CompactStore>,
    ) -> Result<Vec<u32>> {
        self.score_last(tokens);
        if let (Some(m), d) = self.ngram.draft(tokens, n)
            && m.len >= self.min_match
            && !d.is_empty()
        {
            self.counts.0 += 1;
            return Ok(d);
        }
        if self.gain < self.min_gain && self.idle + 1 < self.retry_every {
            self.idle += 1;
            self.counts.2 += 1;
            return Ok(Vec::new());
        }
        self.idle = 0;
        self.counts.1 += 1;
        let d = self.model.propose(tokens, n, store)?;
        self.last = Some((tokens.len(), d.clone()));
        Ok(d)
    }

    fn drafter(&self) -> Option<&kakeya_models::DFlashDrafter> {
        self.model.drafter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_most_recent_tail_match_proposes_what_followed() {
        let p = NgramProposer::default();
        // Tail [2, 3] occurs at 1..3 (followed by 4, 5) and at 6..8 (followed by 9): the most
        // recent earlier one wins.
        let t = [1, 2, 3, 4, 5, 1, 2, 3, 9, 7, 2, 3];
        let (m, d) = p.draft(&t, 3);
        assert_eq!(m, Some(NgramMatch { len: 2, next: 8 }));
        assert_eq!(d, vec![9, 7, 2]);
        // Tail [1, 2, 3] is tried before [2, 3].
        let t = [1, 2, 3, 4, 0, 2, 3, 8, 1, 2, 3];
        assert_eq!(p.draft(&t, 2).1, vec![4, 0]);
        // A draft stops at the end of the sequence (the continuation may overlap the tail).
        let t = [5, 5, 5];
        assert_eq!(p.draft(&t, 4).1, vec![5]);
    }

    #[test]
    fn no_match_no_draft() {
        let mut p = NgramProposer::default();
        assert_eq!(
            p.propose(&[1, 2, 3, 4], 5, None).unwrap(),
            Vec::<u32>::new()
        );
        assert_eq!(p.propose(&[7], 5, None).unwrap(), Vec::<u32>::new());
        assert_eq!(p.propose(&[], 5, None).unwrap(), Vec::<u32>::new());
        let p = NgramProposer { min: 2, max: 3 };
        // Only a 1-token tail matches: below `min`.
        assert_eq!(p.find(&[4, 1, 9, 4]), None);
    }

    struct Fixed(Vec<u32>);
    impl Proposer for Fixed {
        fn propose(
            &mut self,
            _: &[u32],
            n: usize,
            _: Option<&mut CompactStore>,
        ) -> Result<Vec<u32>> {
            Ok(self.0.iter().copied().take(n).collect())
        }
    }

    #[test]
    fn combined_uses_the_lookup_only_when_the_context_backs_it() {
        let mut c = CombinedProposer::new(Box::new(Fixed(vec![42, 43])));
        // Two-token tail [2, 3] matched: the lookup drafts.
        assert_eq!(c.propose(&[2, 3, 4, 2, 3], 2, None).unwrap(), vec![4, 2]);
        // Only a one-token match: the model drafts.
        assert_eq!(c.propose(&[2, 8, 4, 2], 2, None).unwrap(), vec![42, 43]);
        assert_eq!(c.counts, (1, 1, 0));
    }

    #[test]
    fn a_drafter_that_earns_nothing_sits_out_and_is_retried() {
        let mut c = CombinedProposer::new(Box::new(Fixed(vec![42, 43])));
        // Distinct tokens: never a lookup match. Each drafter call is followed by a commit
        // that rejects its drafts (token 7 instead of 42).
        let mut seq: Vec<u32> = vec![100];
        let mut drafted = 0;
        for i in 0..200u32 {
            let d = c.propose(&seq, 2, None).unwrap();
            drafted += usize::from(!d.is_empty());
            seq.push(1000 + i);
        }
        assert!(c.drafter_gain() < c.min_gain, "{}", c.drafter_gain());
        // A few calls while the optimistic start wears off, then one in 32.
        assert!((6..=16).contains(&drafted), "{drafted} drafter calls");
        // A drafter whose drafts are all accepted keeps drafting.
        let mut c = CombinedProposer::new(Box::new(Fixed(vec![42, 43])));
        let mut seq: Vec<u32> = vec![100];
        for _ in 0..50 {
            assert_eq!(c.propose(&seq, 2, None).unwrap(), vec![42, 43]);
            seq.extend([42, 43, 9]);
            seq.push(seq.len() as u32 + 500); // keep the tail unmatched
        }
        assert!(c.drafter_gain() > 1.9, "{}", c.drafter_gain());
    }
}
