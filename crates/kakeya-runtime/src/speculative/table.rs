//! A static n-gram table: the verifier's most frequent next token after each context of 1 to
//! `max_order` tokens, counted over a corpus of the verifier's own greedy continuations. It
//! drafts where the running sequence has no earlier match of its tail (prompt lookup has
//! nothing then), at the cost of a few hash probes per token. [llama.cpp `lookup` with a static
//! cache, `llama-lookup-create`]
//!
//! Drafting backs off: each token comes from the longest context the table holds. Building
//! drops every context whose choice equals that of its one-token-shorter suffix — backing off
//! from it then reaches the same token — so the table is small (≈ 64 k entries for 474 k
//! corpus tokens at order 6) and drafts exactly as the unpruned one would.
//!
//! File (`kakeya ngram build`), little-endian: magic `KKNGRAM1`, `u32` max order, `u32`
//! vocabulary size, 32 bytes of the source verifier's SHA-256 (zeros if unknown), `u64` entry
//! count, then the entries sorted by key: `u64` context key ([`NgramTable::key`]), `u32` token.

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Result, RuntimeError};

const MAGIC: &[u8; 8] = b"KKNGRAM1";
const HEADER: usize = 8 + 4 + 4 + 32 + 8;
const ENTRY: usize = 12;

/// Longest context a table may have (drafting hashes every order per token).
pub const MAX_ORDER: usize = 16;

/// The static n-gram table (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NgramTable {
    max_order: usize,
    vocab: u32,
    source_sha256: [u8; 32],
    /// Sorted by key, keys unique.
    entries: Vec<(u64, u32)>,
}

impl NgramTable {
    /// Counts every position of `sequences` (each position's token after the 1 to `max_order`
    /// tokens before it) and keeps, per context, the most frequent next token (ties: the
    /// smallest id), then prunes what backing off reproduces. `vocab` bounds the ids;
    /// `source_sha256` records the verifier the corpus came from.
    pub fn build<'a>(
        sequences: impl IntoIterator<Item = &'a [u32]>,
        max_order: usize,
        vocab: u32,
        source_sha256: [u8; 32],
    ) -> Result<Self> {
        check_order(max_order)?;
        let mut counts: HashMap<(usize, u64), HashMap<u32, u32>> = HashMap::new();
        let mut suffix: HashMap<(usize, u64), u64> = HashMap::new();
        for seq in sequences {
            if let Some(&t) = seq.iter().find(|&&t| t >= vocab) {
                return Err(RuntimeError::Input(format!(
                    "token id {t} is outside the vocabulary of {vocab}"
                )));
            }
            for i in 1..seq.len() {
                for n in 1..=max_order.min(i) {
                    let ctx = &seq[i - n..i];
                    let key = Self::key(ctx);
                    *counts
                        .entry((n, key))
                        .or_default()
                        .entry(seq[i])
                        .or_default() += 1;
                    if n > 1 {
                        suffix.insert((n, key), Self::key(&ctx[1..]));
                    }
                }
            }
        }
        let best: HashMap<(usize, u64), u32> = counts
            .into_iter()
            .map(|(k, next)| {
                let top = next
                    .into_iter()
                    .max_by_key(|&(t, c)| (c, std::cmp::Reverse(t)))
                    .map(|(t, _)| t)
                    .unwrap_or(0);
                (k, top)
            })
            .collect();
        let mut entries: Vec<(u64, u32)> = best
            .iter()
            .filter(|&(&(n, key), &tok)| {
                n == 1 || best.get(&(n - 1, suffix[&(n, key)])) != Some(&tok)
            })
            .map(|(&(_, key), &tok)| (key, tok))
            .collect();
        entries.sort_unstable();
        entries.dedup_by_key(|e| e.0);
        Ok(Self {
            max_order,
            vocab,
            source_sha256,
            entries,
        })
    }

    /// The key of a context (oldest token first); its length is part of the key.
    pub fn key(ctx: &[u32]) -> u64 {
        // splitmix64 over the length and then each token.
        let mix = |mut z: u64| {
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let mut h = mix(0x9e37_79b9_7f4a_7c15 ^ ctx.len() as u64);
        for &t in ctx {
            h = mix(h.wrapping_add(0x9e37_79b9_7f4a_7c15) ^ u64::from(t));
        }
        h
    }

    fn get(&self, ctx: &[u32]) -> Option<u32> {
        let key = Self::key(ctx);
        self.entries
            .binary_search_by_key(&key, |e| e.0)
            .ok()
            .map(|i| self.entries[i].1)
    }

    /// The table's choice after `tokens`, and the length of the context it came from (the
    /// longest the table holds); `None` when not even the last token was seen.
    pub fn next(&self, tokens: &[u32]) -> Option<(usize, u32)> {
        (1..=self.max_order.min(tokens.len()))
            .rev()
            .find_map(|n| self.get(&tokens[tokens.len() - n..]).map(|t| (n, t)))
    }

    /// Up to `n` tokens drafted one after another (each appended to the context of the next),
    /// and the context length the first came from (0: no draft).
    pub fn draft(&self, tokens: &[u32], n: usize) -> (usize, Vec<u32>) {
        let keep = self.max_order.min(tokens.len());
        let mut ctx = tokens[tokens.len() - keep..].to_vec();
        let (mut first, mut out) = (0, Vec::with_capacity(n));
        while out.len() < n {
            let Some((order, t)) = self.next(&ctx) else {
                break;
            };
            if out.is_empty() {
                first = order;
            }
            out.push(t);
            ctx.push(t);
        }
        (first, out)
    }

    /// Bytes its entries hold (the buffer's capacity, header fields aside).
    pub fn nbytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<(u64, u32)>()
    }

    /// Contexts held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Longest context.
    pub fn max_order(&self) -> usize {
        self.max_order
    }

    /// Vocabulary size the ids are bounded by.
    pub fn vocab(&self) -> u32 {
        self.vocab
    }

    /// SHA-256 of the verifier the corpus came from (zeros if unknown).
    pub fn source_sha256(&self) -> [u8; 32] {
        self.source_sha256
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER + ENTRY * self.entries.len());
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&(self.max_order as u32).to_le_bytes());
        b.extend_from_slice(&self.vocab.to_le_bytes());
        b.extend_from_slice(&self.source_sha256);
        b.extend_from_slice(&(self.entries.len() as u64).to_le_bytes());
        for &(k, t) in &self.entries {
            b.extend_from_slice(&k.to_le_bytes());
            b.extend_from_slice(&t.to_le_bytes());
        }
        b
    }

    /// Parses a file's bytes; errors say what is wrong (the caller names the file).
    pub fn from_bytes(b: &[u8]) -> std::result::Result<Self, String> {
        if b.len() < HEADER || &b[..8] != MAGIC {
            return Err("not a kakeya n-gram table (no KKNGRAM1 header)".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let max_order = u32_at(8) as usize;
        let vocab = u32_at(12);
        let source_sha256: [u8; 32] = b[16..48].try_into().expect("32 bytes");
        let count = u64::from_le_bytes(b[48..56].try_into().expect("8 bytes"));
        check_order(max_order).map_err(|e| e.to_string())?;
        let body = &b[HEADER..];
        if (body.len() / ENTRY) as u64 != count || !body.len().is_multiple_of(ENTRY) {
            return Err(format!(
                "the header counts {count} entries but {} bytes of entries follow (truncated or corrupt)",
                body.len()
            ));
        }
        let mut entries = Vec::with_capacity(body.len() / ENTRY);
        for e in body.chunks_exact(ENTRY) {
            let key = u64::from_le_bytes(e[..8].try_into().expect("8 bytes"));
            let tok = u32::from_le_bytes(e[8..].try_into().expect("4 bytes"));
            if tok >= vocab {
                return Err(format!(
                    "entry {} holds token id {tok}, outside its vocabulary of {vocab}",
                    entries.len()
                ));
            }
            if entries.last().is_some_and(|&(k, _)| k >= key) {
                return Err(format!("entry {} is out of order (corrupt)", entries.len()));
            }
            entries.push((key, tok));
        }
        Ok(Self {
            max_order,
            vocab,
            source_sha256,
            entries,
        })
    }

    /// Reads a table file.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| {
            RuntimeError::Input(format!("cannot read n-gram table {}: {e}", path.display()))
        })?;
        Self::from_bytes(&bytes)
            .map_err(|e| RuntimeError::Input(format!("n-gram table {}: {e}", path.display())))
    }

    /// Writes the table to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        kakeya_weights::fsio::write_file(path, &self.to_bytes()).map_err(|e| {
            RuntimeError::Input(format!("cannot write n-gram table {}: {e}", path.display()))
        })
    }
}

fn check_order(max_order: usize) -> Result<()> {
    if (1..=MAX_ORDER).contains(&max_order) {
        Ok(())
    } else {
        Err(RuntimeError::Input(format!(
            "an n-gram table's order must be 1 to {MAX_ORDER}, not {max_order}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The unpruned model the table must draft exactly like: for each context length from the
    /// longest down, the most frequent next token (ties: smallest id).
    fn reference_next(corpus: &[Vec<u32>], max_order: usize, tokens: &[u32]) -> Option<u32> {
        for n in (1..=max_order.min(tokens.len())).rev() {
            let ctx = &tokens[tokens.len() - n..];
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for s in corpus {
                for i in n..s.len() {
                    if &s[i - n..i] == ctx {
                        *counts.entry(s[i]).or_default() += 1;
                    }
                }
            }
            if let Some((t, _)) = counts
                .into_iter()
                .max_by_key(|&(t, c)| (c, std::cmp::Reverse(t)))
            {
                return Some(t);
            }
        }
        None
    }

    fn corpus() -> Vec<Vec<u32>> {
        // A small pseudo-random corpus over 12 ids with repeated phrases.
        let mut x: u64 = 7;
        let mut rnd = move || {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (x >> 33) as u32
        };
        (0..40)
            .map(|_| {
                let mut s = Vec::new();
                while s.len() < 30 {
                    if rnd() % 3 == 0 {
                        s.extend_from_slice(&[1, 2, 3, 4]);
                    } else {
                        s.push(rnd() % 12);
                    }
                }
                s
            })
            .collect()
    }

    #[test]
    fn pruned_table_drafts_as_the_unpruned_counts_would() {
        let c = corpus();
        for order in [1, 2, 4] {
            let t = NgramTable::build(c.iter().map(|s| s.as_slice()), order, 12, [0; 32]).unwrap();
            let unpruned: usize = (1..=order)
                .map(|n| {
                    let mut seen = std::collections::HashSet::new();
                    for s in &c {
                        for i in n..s.len() {
                            seen.insert(&s[i - n..i]);
                        }
                    }
                    seen.len()
                })
                .sum();
            assert!(
                t.len() < unpruned || order == 1,
                "{} vs {unpruned}",
                t.len()
            );
            // Every context of every length in the corpus, and some unseen ones.
            for s in &c {
                for i in 1..s.len() {
                    for from in i.saturating_sub(order + 2)..i {
                        let ctx = &s[from..i];
                        assert_eq!(t.next(ctx).map(|x| x.1), reference_next(&c, order, ctx));
                    }
                }
            }
            assert_eq!(
                t.next(&[11, 11, 11, 11, 11, 11]).map(|x| x.1),
                reference_next(&c, order, &[11; 6])
            );
            assert_eq!(t.next(&[]), None);
        }
    }

    #[test]
    fn drafts_chain_and_report_the_first_context_length() {
        let seqs: Vec<Vec<u32>> = vec![vec![5, 1, 2, 3, 4], vec![6, 1, 2, 3, 4], vec![7, 2, 9]];
        let t = NgramTable::build(seqs.iter().map(|s| s.as_slice()), 3, 10, [0; 32]).unwrap();
        // After [.., 1, 2]: 3 (from the 1-token context: [1, 2] and [x, 1, 2] make the same
        // choice and were pruned), then 4, then what follows 4 (nothing: the draft stops).
        let (order, d) = t.draft(&[8, 1, 2], 5);
        assert_eq!((order, d), (1, vec![3, 4]));
        // [7, 2] disagrees with [2] (9 against 3) and is kept: it wins over the shorter one.
        assert_eq!(t.next(&[7, 2]), Some((2, 9)));
        assert_eq!(t.next(&[1, 2]).map(|x| x.1), Some(3));
        // Never-seen last token: nothing.
        assert_eq!(t.draft(&[0], 3), (0, vec![]));
    }

    #[test]
    fn round_trips_and_rejects_bad_files() {
        let c = corpus();
        let t = NgramTable::build(c.iter().map(|s| s.as_slice()), 3, 12, [9; 32]).unwrap();
        let b = t.to_bytes();
        assert_eq!(NgramTable::from_bytes(&b).unwrap(), t);
        assert!(
            NgramTable::from_bytes(b"nonsense")
                .unwrap_err()
                .contains("KKNGRAM1")
        );
        assert!(
            NgramTable::from_bytes(&b[..b.len() - 3])
                .unwrap_err()
                .contains("truncated")
        );
        let mut bad = b.clone();
        bad[HEADER + 8..HEADER + 12].copy_from_slice(&99u32.to_le_bytes());
        assert!(
            NgramTable::from_bytes(&bad)
                .unwrap_err()
                .contains("outside")
        );
        let mut bad = b.clone();
        let (a, z) = (HEADER, HEADER + ENTRY);
        let first: Vec<u8> = bad[a..z].to_vec();
        bad.copy_within(z..z + ENTRY, a);
        bad[z..z + ENTRY].copy_from_slice(&first);
        assert!(
            NgramTable::from_bytes(&bad)
                .unwrap_err()
                .contains("out of order")
        );
        let mut bad = b;
        bad[8..12].copy_from_slice(&0u32.to_le_bytes());
        assert!(NgramTable::from_bytes(&bad).unwrap_err().contains("order"));
        assert!(NgramTable::build([[1u32, 20].as_slice()], 2, 12, [0; 32]).is_err());
    }
}
