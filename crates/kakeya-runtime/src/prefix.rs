//! Prefix caching: finished sequences' K/V kept for the next requests that start the same
//! way (a shared system prompt, the earlier turns of a chat, a fixed instruction), as
//! `llama-server`'s prompt cache and vLLM's automatic prefix caching keep them.
//!
//! An entry is a finished [`Session`] with the tokens its caches hold. A new prompt takes the
//! entry sharing its longest prefix: the entry's session is cloned — its K/V buffers are shared
//! until the new sequence first writes them (copy on write) — and truncated to that prefix,
//! and only the rest of the prompt is prefilled. At least the prompt's last token is always
//! run, since its logits pick the first generated token.
//!
//! This is lossless only where a position's K/V does not depend on how the prompt was cut
//! into chunks: every layer cached natively (the `full` KV mode: no position demoted or
//! evicted while the prompt runs) and every row computed on its own (see
//! [`GemmaModel::rows_invariant_at_any_count`]). [`PrefixCache::applies`] says when; the
//! server turns the cache off otherwise.
//!
//! Entries are evicted least recently used first, keeping the bytes their sessions hold
//! (measured from their buffers, [`Session::kv_bytes`]) within a budget.

use kakeya_models::GemmaModel;

use crate::kv::{KvMode, KvPolicy};
use crate::session::Session;

/// Fewest prompt positions worth taking from the cache: cloning a session costs a copy of its
/// buffers at the first write, about what a couple of prompt rows cost to compute.
pub const MIN_REUSE: usize = 4;

/// One finished sequence.
#[derive(Debug)]
struct Entry<'m> {
    /// The tokens at the session's positions (`session.len()` of them).
    tokens: Vec<u32>,
    session: Session<'m>,
    bytes: usize,
    /// Logical time of the last insert or hit (least recently used goes first).
    used: u64,
}

/// Figures of the cache since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Prompts that took positions from the cache.
    pub hits: u64,
    /// Prompts that found nothing worth taking.
    pub misses: u64,
    /// Prompt positions taken from the cache instead of computed.
    pub reused_tokens: u64,
    /// Entries dropped to stay within the budget.
    pub evictions: u64,
}

/// Finished sequences' sessions, by the tokens they hold, within a byte budget.
#[derive(Debug)]
pub struct PrefixCache<'m> {
    budget: usize,
    entries: Vec<Entry<'m>>,
    clock: u64,
    stats: PrefixStats,
}

impl<'m> PrefixCache<'m> {
    /// An empty cache holding at most `budget` bytes of sessions (0: it keeps nothing).
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            entries: Vec::new(),
            clock: 0,
            stats: PrefixStats::default(),
        }
    }

    /// Whether a prefix taken from the cache gives exactly the numbers of computing it: the
    /// policy keeps every position natively and `model` computes every row on its own.
    pub fn applies(model: &GemmaModel, policy: &KvPolicy) -> bool {
        policy.mode == KvMode::Full && model.rows_invariant_at_any_count()
    }

    /// A session holding the longest cached prefix of `prompt` (at most `prompt.len() − 1`
    /// positions, at least [`MIN_REUSE`]), ready to prefill the rest; `None` when no entry
    /// shares that much. The session is a clone: the entry stays for later prompts.
    pub fn fork(&mut self, prompt: &[u32]) -> Option<Session<'m>> {
        let most = prompt.len().saturating_sub(1);
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let n = common_prefix(&e.tokens, &prompt[..most]);
                // A ring that already dropped a position the prefix needs cannot go back
                // that far.
                (n >= MIN_REUSE && e.session.natively_reaches(n)).then_some((n, e.used, i))
            })
            // Longest; among equals the most recently used.
            .max_by_key(|&(n, used, _)| (n, used));
        let Some((n, _, i)) = best else {
            self.stats.misses += 1;
            return None;
        };
        let mut session = self.entries[i].session.clone();
        if let Err(e) = session.truncate(n) {
            tracing::warn!("prefix cache: cannot cut a cached sequence back to {n}: {e}");
            self.stats.misses += 1;
            return None;
        }
        self.clock += 1;
        self.entries[i].used = self.clock;
        self.stats.hits += 1;
        self.stats.reused_tokens += n as u64;
        tracing::debug!(reused = n, prompt = prompt.len(), "prefix cache hit");
        Some(session)
    }

    /// Keeps `session` (finished) for later prompts; `tokens` starts with the tokens at its
    /// positions (the last committed token, not yet in the caches, may follow). An entry that
    /// already serves every prefix of these tokens is kept instead; entries whose every
    /// prefix the new one serves are replaced by it. Then the least recently used entries go
    /// until the budget holds.
    pub fn insert(&mut self, tokens: &[u32], session: Session<'m>) {
        let len = session.len();
        if len < MIN_REUSE || tokens.len() < len {
            return;
        }
        let tokens = &tokens[..len];
        self.clock += 1;
        // Serving every prefix: holding the tokens, and able to go back to the shortest.
        let serves = |s: &Session<'_>| s.natively_reaches(MIN_REUSE);
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.tokens.starts_with(tokens) && serves(&e.session))
        {
            e.used = self.clock;
            return;
        }
        let bytes = session.kv_bytes().total;
        if bytes > self.budget {
            return;
        }
        if serves(&session) {
            self.entries.retain(|e| !tokens.starts_with(&e.tokens));
        }
        self.entries.push(Entry {
            tokens: tokens.to_vec(),
            session,
            bytes,
            used: self.clock,
        });
        while self.bytes() > self.budget {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
                .expect("over budget means entries");
            self.entries.swap_remove(oldest);
            self.stats.evictions += 1;
        }
    }

    /// Bytes the entries' sessions hold (every part, measured from their buffers).
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Hits, misses, reused positions and evictions so far.
    pub fn stats(&self) -> PrefixStats {
        self.stats
    }
}

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
