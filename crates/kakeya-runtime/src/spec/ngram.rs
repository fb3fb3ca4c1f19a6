//! Drafting without a drafter: prompt lookup (n-gram) decoding, and a proposer that combines
//! it with a model drafter. [Saxena, "Prompt Lookup Decoding", 2023; llama.cpp `lookup`;
//! vLLM's `ngram` proposer]

use super::adaptive::DraftSource;
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
            Some(m) => (Some(m), Self::following(tokens, m, n)),
            None => (None, Vec::new()),
        }
    }

    /// Up to `n` tokens that followed match `m` of `tokens`.
    fn following(tokens: &[u32], m: NgramMatch, n: usize) -> Vec<u32> {
        let end = (m.next + n).min(tokens.len());
        tokens[m.next..end].to_vec()
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

    fn source(&mut self, tokens: &[u32]) -> DraftSource {
        self.find(tokens)
            .map_or(DraftSource::Nothing, |m| DraftSource::Lookup(m.len))
    }
}

/// Prompt lookup when the context backs it, a model drafter otherwise: the n-gram draft is
/// used when its tail match is at least `min_match` tokens long, else the drafter drafts. The
/// lookup costs no forward, so it is always tried first. Whether a block is drafted at all,
/// and how long, is the schedule's choice per source ([`DraftSource`]): a drafter that earns
/// less than its forward gets plain steps (and rare probes) while lookups keep drafting.
pub struct CombinedProposer<'p> {
    /// The lookup.
    pub ngram: NgramProposer,
    /// Shortest tail match whose continuation is preferred to the drafter's.
    pub min_match: usize,
    /// The fallback.
    pub model: Box<dyn Proposer + 'p>,
    /// Blocks drafted by the lookup and by the model.
    pub counts: (usize, usize),
}

impl<'p> CombinedProposer<'p> {
    /// Lookup over tails of 3 to 1 tokens, used from one matched token (on `kakeya bench`'s
    /// held-out prompts a one-token match's drafts are accepted more often than a weak
    /// drafter's, and cost nothing), then `model`.
    pub fn new(model: Box<dyn Proposer + 'p>) -> Self {
        Self {
            ngram: NgramProposer::default(),
            min_match: 1,
            model,
            counts: (0, 0),
        }
    }

    /// The lookup's match, when it is long enough to be used.
    fn lookup(&self, tokens: &[u32]) -> Option<NgramMatch> {
        self.ngram.find(tokens).filter(|m| m.len >= self.min_match)
    }
}

impl Proposer for CombinedProposer<'_> {
    fn propose(
        &mut self,
        tokens: &[u32],
        n: usize,
        store: Option<&mut CompactStore>,
    ) -> Result<Vec<u32>> {
        if let Some(m) = self.lookup(tokens) {
            let d = NgramProposer::following(tokens, m, n);
            if !d.is_empty() {
                self.counts.0 += 1;
                return Ok(d);
            }
        }
        self.counts.1 += 1;
        self.model.propose(tokens, n, store)
    }

    fn source(&mut self, tokens: &[u32]) -> DraftSource {
        self.lookup(tokens)
            .map_or(DraftSource::Model, |m| DraftSource::Lookup(m.len))
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
    fn combined_uses_the_lookup_when_the_context_backs_it_and_says_so() {
        let mut c = CombinedProposer::new(Box::new(Fixed(vec![42, 43])));
        // Two-token tail [2, 3] matched: the lookup drafts.
        let t = [2, 3, 4, 2, 3];
        assert_eq!(c.source(&t), DraftSource::Lookup(2));
        assert_eq!(c.propose(&t, 2, None).unwrap(), vec![4, 2]);
        // A one-token match is used too.
        let t = [2, 8, 4, 2];
        assert_eq!(c.source(&t), DraftSource::Lookup(1));
        assert_eq!(c.propose(&t, 2, None).unwrap(), vec![8, 4]);
        // No match: the model drafts.
        let t = [2, 8, 4, 5];
        assert_eq!(c.source(&t), DraftSource::Model);
        assert_eq!(c.propose(&t, 2, None).unwrap(), vec![42, 43]);
        assert_eq!(c.counts, (2, 1));
        // Requiring two matched tokens sends the one-token match to the model.
        c.min_match = 2;
        assert_eq!(c.source(&[2, 8, 4, 2]), DraftSource::Model);
        assert_eq!(c.propose(&[2, 8, 4, 2], 2, None).unwrap(), vec![42, 43]);
        // The lookup alone has nothing to offer without a match.
        let mut p = NgramProposer::default();
        assert_eq!(p.source(&[2, 8, 4, 5]), DraftSource::Nothing);
        assert_eq!(p.source(&[1, 2, 3, 1, 2, 3]), DraftSource::Lookup(3));
    }
}
