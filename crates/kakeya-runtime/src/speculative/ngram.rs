//! Drafting without a drafter: prompt lookup (n-gram) decoding, backed by a static n-gram
//! table where the sequence has no match, and a proposer that combines them with a model
//! drafter. [Saxena, "Prompt Lookup Decoding", 2023; llama.cpp `lookup`; vLLM's `ngram`
//! proposer]

use std::sync::Arc;

use super::adaptive::DraftSource;
use super::proposer::Proposer;
use super::table::NgramTable;
use crate::error::Result;
use crate::kv::CompactStore;

/// Longest block of the n-gram proposer under a fixed schedule when nothing else bounds it (1
/// token + 7 drafts, as simulated in `docs/train-drafter.md`).
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
/// recent earlier occurrence. Where no tail matches, the static `table` (if any) drafts.
/// Costs a scan of the sequence and a few hash probes, no forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NgramProposer {
    /// Shortest tail looked up.
    pub min: usize,
    /// Longest tail looked up (tried first).
    pub max: usize,
    /// Drafts where the sequence has no match.
    pub table: Option<Arc<NgramTable>>,
}

impl Default for NgramProposer {
    /// Tails of 6 down to 1 tokens, no table. (llama.cpp's lookup tries up to 4, vLLM's
    /// `prompt_lookup_max` is the user's; on the default model's greedy outputs, tails up to 6
    /// commit more per block than up to 3 on every held-out prompt set measured, see
    /// `docs/train-drafter.md`.)
    fn default() -> Self {
        Self {
            min: 1,
            max: 6,
            table: None,
        }
    }
}

impl NgramProposer {
    /// Tails of 6 down to 1 tokens, then `table`.
    pub fn with_table(table: Option<Arc<NgramTable>>) -> Self {
        Self {
            table,
            ..Self::default()
        }
    }

    /// The context length the table's first draft after `tokens` would come from.
    fn table_order(&self, tokens: &[u32]) -> Option<usize> {
        Some(self.table.as_ref()?.next(tokens)?.0)
    }

    /// Up to `n` tokens of the table after `tokens`, and the context length the first came
    /// from (0 and none without a table).
    fn table_draft(&self, tokens: &[u32], n: usize) -> (usize, Vec<u32>) {
        self.table
            .as_ref()
            .map_or_else(|| (0, Vec::new()), |t| t.draft(tokens, n))
    }

    /// The match the next draft would come from, if any: the most recent earlier occurrence
    /// of the longest tail that has one. A one-token tail is a weak match, so it picks among
    /// its occurrences: the most recent one followed by the table's choice, if any is; else
    /// the most recent one followed by the token that most often followed it (ties: the more
    /// recent). On the default model's greedy outputs each of the two choices commits more per
    /// block than the most recent occurrence, on every held-out prompt set measured
    /// (`docs/train-drafter.md`).
    pub fn find(&self, tokens: &[u32]) -> Option<NgramMatch> {
        let (n, latest) = self.longest_tail(tokens)?;
        let start = if n == 1 {
            let all: Vec<usize> = std::iter::once(latest)
                .chain(Self::occurrences_before(tokens, n, latest))
                .collect();
            self.pick_one_token_occurrence(tokens, &all)
        } else {
            latest
        };
        Some(NgramMatch {
            len: n,
            next: start + n,
        })
    }

    /// Every earlier occurrence of the longest tail that has one (the tail [`Self::find`]
    /// matches): its length, and where the tokens that followed each occurrence start, latest
    /// first, at most `limit` of them.
    pub fn all_matches(&self, tokens: &[u32], limit: usize) -> Option<(usize, Vec<usize>)> {
        let (n, _) = self.longest_tail(tokens)?;
        Some((
            n,
            Self::occurrences_before(tokens, n, tokens.len() - n)
                .take(limit)
                .map(|i| i + n)
                .collect(),
        ))
    }

    /// The longest tail of `max` down to `min` tokens that occurred earlier (followed by at
    /// least one token), and where its latest earlier occurrence starts.
    fn longest_tail(&self, tokens: &[u32]) -> Option<(usize, usize)> {
        (self.min.max(1)..=self.max)
            .rev()
            .filter(|&n| tokens.len() > n)
            .find_map(|n| {
                Some((
                    n,
                    Self::occurrences_before(tokens, n, tokens.len() - n).next()?,
                ))
            })
    }

    /// Where the earlier occurrences of the last `n` tokens that start before `end` start
    /// (`end` at most `tokens.len() - n`, so each is followed by at least one token), latest
    /// first.
    fn occurrences_before(
        tokens: &[u32],
        n: usize,
        end: usize,
    ) -> impl Iterator<Item = usize> + '_ {
        let tail = &tokens[tokens.len() - n..];
        (0..end).rev().filter(move |&i| &tokens[i..i + n] == tail)
    }

    /// Among `occurrences` (latest first) of the last token, the one a one-token tail drafts
    /// from (see [`Self::find`]).
    fn pick_one_token_occurrence(&self, tokens: &[u32], occurrences: &[usize]) -> usize {
        let after = |i: usize| tokens[i + 1];
        if let Some(want) = self
            .table
            .as_ref()
            .and_then(|t| t.next(tokens))
            .map(|x| x.1)
            && let Some(&i) = occurrences.iter().find(|&&i| after(i) == want)
        {
            return i;
        }
        // (count, rank of its latest occurrence) per following token.
        let mut counts: std::collections::HashMap<u32, (usize, usize)> = Default::default();
        for (rank, &i) in occurrences.iter().enumerate() {
            counts.entry(after(i)).or_insert((0, rank)).0 += 1;
        }
        let best = counts
            .into_values()
            .max_by_key(|&(count, rank)| (count, std::cmp::Reverse(rank)))
            .map_or(0, |(_, rank)| rank);
        occurrences[best]
    }

    /// `n` tokens that followed the match (none without one).
    pub fn draft(&self, tokens: &[u32], n: usize) -> (Option<NgramMatch>, Vec<u32>) {
        match self.find(tokens) {
            Some(m) => (Some(m), Self::following(tokens, m, n)),
            None => (None, Vec::new()),
        }
    }

    /// The `n` tokens that followed match `m` of `tokens`. A copy that reaches the end of the
    /// sequence goes on copying what it has drafted (as an LZ77 match may overlap itself): a
    /// repeat that ran to the end keeps repeating, as greedy decoding's loops do.
    fn following(tokens: &[u32], m: NgramMatch, n: usize) -> Vec<u32> {
        Self::following_from(tokens, m.next, n)
    }

    /// The `n` tokens of `tokens` from index `next` on, a copy that reaches the end going on
    /// copying what it has drafted (see [`Self::draft`]).
    pub fn following_from(tokens: &[u32], next: usize, n: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(n);
        for k in 0..n {
            let i = next + k;
            let t = match tokens.get(i) {
                Some(&t) => t,
                None => out[i - tokens.len()],
            };
            out.push(t);
        }
        out
    }
}

impl Proposer for NgramProposer {
    fn propose(
        &mut self,
        tokens: &[u32],
        n: usize,
        _store: Option<&mut CompactStore>,
    ) -> Result<Vec<u32>> {
        let (m, d) = self.draft(tokens, n);
        Ok(if m.is_some() {
            d
        } else {
            self.table_draft(tokens, n).1
        })
    }

    fn source(&mut self, tokens: &[u32]) -> DraftSource {
        if let Some(m) = self.find(tokens) {
            return DraftSource::Lookup(m.len);
        }
        self.table_order(tokens)
            .map_or(DraftSource::Nothing, DraftSource::Table)
    }

    fn lookups(&self) -> Option<Box<dyn Proposer>> {
        Some(Box::new(self.clone()))
    }
}

/// Prompt lookup when the context backs it, the static table next, a model drafter otherwise:
/// the n-gram draft is used when its tail match is at least `min_match` tokens long, the
/// table's when its context is at least `table_min` tokens long, else the drafter drafts. The
/// lookups cost no forward, so they are always tried first. Whether a block is drafted at all,
/// and how long, is the schedule's choice per source ([`DraftSource`]): a drafter that earns
/// less than its forward gets plain steps (and rare probes) while lookups keep drafting.
pub struct CombinedProposer<'p> {
    /// The lookup.
    pub ngram: NgramProposer,
    /// Shortest tail match whose continuation is preferred to the drafter's.
    pub min_match: usize,
    /// Shortest table context whose draft is preferred to the drafter's.
    pub table_min: usize,
    /// The fallback.
    pub model: Box<dyn Proposer + 'p>,
    /// Blocks drafted by the lookup and by the model.
    pub counts: (usize, usize),
    /// Blocks drafted by the table.
    pub table_blocks: usize,
}

impl<'p> CombinedProposer<'p> {
    /// Lookup over tails of 6 to 1 tokens, used from one matched token (on `kakeya bench`'s
    /// held-out prompts a one-token match's drafts are accepted more often than a weak
    /// drafter's, and cost nothing), then `table` from one token of context, then `model`.
    pub fn new(model: Box<dyn Proposer + 'p>, table: Option<Arc<NgramTable>>) -> Self {
        Self {
            ngram: NgramProposer::with_table(table),
            min_match: 1,
            table_min: 1,
            model,
            counts: (0, 0),
            table_blocks: 0,
        }
    }

    /// The lookup's match, when it is long enough to be used.
    fn lookup(&self, tokens: &[u32]) -> Option<NgramMatch> {
        self.ngram.find(tokens).filter(|m| m.len >= self.min_match)
    }

    /// The table's context length, when it is long enough to be used.
    fn table(&self, tokens: &[u32]) -> Option<usize> {
        self.ngram
            .table_order(tokens)
            .filter(|&o| o >= self.table_min)
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
        } else {
            let (order, d) = self.ngram.table_draft(tokens, n);
            if order >= self.table_min && !d.is_empty() {
                self.table_blocks += 1;
                return Ok(d);
            }
        }
        self.counts.1 += 1;
        self.model.propose(tokens, n, store)
    }

    fn source(&mut self, tokens: &[u32]) -> DraftSource {
        if let Some(m) = self.lookup(tokens) {
            return DraftSource::Lookup(m.len);
        }
        self.table(tokens)
            .map_or(DraftSource::Model, DraftSource::Table)
    }

    fn drafter(&self) -> Option<&kakeya_models::DFlashDrafter> {
        self.model.drafter()
    }

    fn lookups(&self) -> Option<Box<dyn Proposer>> {
        self.ngram.lookups()
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
        // A copy that reaches the end of the sequence repeats what it copied.
        let t = [5, 5, 5];
        assert_eq!(p.draft(&t, 4).1, vec![5, 5, 5, 5]);
        let t = [1, 2, 3, 9, 1, 2, 3];
        assert_eq!(p.draft(&t, 6).1, vec![9, 1, 2, 3, 9, 1]);
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
        let p = NgramProposer {
            min: 2,
            ..NgramProposer::default()
        };
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
        let mut c = CombinedProposer::new(Box::new(Fixed(vec![42, 43])), None);
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

    #[test]
    fn the_table_drafts_where_the_sequence_has_no_match_and_the_model_after_it() {
        // The table knows 7 → 8 → 9 and, from a two-token context, [3, 7] → 1.
        let corpus: Vec<Vec<u32>> = vec![vec![7, 8, 9], vec![7, 8, 9], vec![3, 7, 1]];
        let table = Arc::new(
            NgramTable::build(corpus.iter().map(|s| s.as_slice()), 2, 50, [0; 32]).unwrap(),
        );
        let mut p = NgramProposer::with_table(Some(table.clone()));
        // No earlier 7 in the sequence: the table drafts, and says from how long a context.
        assert_eq!(p.source(&[5, 7]), DraftSource::Table(1));
        assert_eq!(p.propose(&[5, 7], 3, None).unwrap(), vec![8, 9]);
        assert_eq!(p.source(&[3, 7]), DraftSource::Table(2));
        assert_eq!(p.propose(&[3, 7], 1, None).unwrap(), vec![1]);
        // A match in the sequence comes first.
        assert_eq!(p.source(&[7, 4, 7]), DraftSource::Lookup(1));
        assert_eq!(p.propose(&[7, 4, 7], 2, None).unwrap(), vec![4, 7]);
        // Neither knows 6.
        assert_eq!(p.source(&[6]), DraftSource::Nothing);
        assert_eq!(p.propose(&[6], 2, None).unwrap(), Vec::<u32>::new());

        let mut c = CombinedProposer::new(Box::new(Fixed(vec![42])), Some(table));
        assert_eq!(c.source(&[5, 7]), DraftSource::Table(1));
        assert_eq!(c.propose(&[5, 7], 2, None).unwrap(), vec![8, 9]);
        assert_eq!(c.source(&[6]), DraftSource::Model);
        assert_eq!(c.propose(&[6], 2, None).unwrap(), vec![42]);
        // Requiring two tokens of table context sends the one-token one to the model.
        c.table_min = 2;
        assert_eq!(c.source(&[5, 7]), DraftSource::Model);
        assert_eq!(c.propose(&[5, 7], 2, None).unwrap(), vec![42]);
        assert_eq!(c.source(&[3, 7]), DraftSource::Table(2));
        assert_eq!(c.propose(&[3, 7], 2, None).unwrap(), vec![1]);
        assert_eq!((c.counts, c.table_blocks), ((0, 2), 2));
    }

    #[test]
    fn a_one_token_tail_follows_the_occurrence_the_table_agrees_with() {
        // The table says 7 → 1; the sequence has 7 → 1 (older) and 7 → 2 (newer).
        let corpus: Vec<Vec<u32>> = vec![vec![7, 1], vec![7, 1]];
        let table = Arc::new(
            NgramTable::build(corpus.iter().map(|s| s.as_slice()), 1, 50, [0; 32]).unwrap(),
        );
        let t = [7, 1, 9, 7, 2, 5, 7];
        let mut plain = NgramProposer::default();
        assert_eq!(plain.propose(&t, 2, None).unwrap(), vec![2, 5]);
        let mut p = NgramProposer::with_table(Some(table.clone()));
        assert_eq!(p.find(&t), Some(NgramMatch { len: 1, next: 1 }));
        assert_eq!(p.propose(&t, 2, None).unwrap(), vec![1, 9]);
        // No occurrence agrees: the most recent one (each follower once).
        let t = [7, 3, 7, 2, 5, 7];
        assert_eq!(p.propose(&t, 2, None).unwrap(), vec![2, 5]);
        // ... or the most recent of the follower seen most often, with or without a table.
        let t = [7, 4, 1, 7, 4, 2, 7, 9, 7];
        assert_eq!(p.find(&t), Some(NgramMatch { len: 1, next: 4 }));
        assert_eq!(plain.propose(&t, 4, None).unwrap(), vec![4, 2, 7, 9]);
        // Longer tails keep the most recent occurrence.
        let t = [4, 7, 1, 4, 7, 2, 4, 7];
        assert_eq!(p.propose(&t, 1, None).unwrap(), vec![2]);
    }
}
