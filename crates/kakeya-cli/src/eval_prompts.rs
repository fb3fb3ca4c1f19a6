//! The prompts of `kakeya eval niah`: the generated ladder of keyed-needle prompts, or a JSONL
//! file's prompts bucketed by the nearest ladder length.

use std::path::Path;

use anyhow::{Context, Result, bail};
use kakeya_capture::prompts::keyed_needles;
use kakeya_weights::Tokenizer;
use serde::{Deserialize, Serialize};

use crate::eval::NiahArgs;

/// One prompt of the evaluation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Item {
    /// Identifier.
    pub id: String,
    /// Prompt text (`<bos>` is prepended).
    pub text: String,
    /// The string a correct output contains.
    pub answer: String,
    /// Further strings a correct output contains too (the other codes of a multi-key item).
    #[serde(default)]
    pub also: Vec<String>,
    /// Length bucket (the ladder length, or for `--prompts` items the nearest one).
    pub bucket: usize,
    /// Needle depth, for generated prompts.
    pub depth: Option<f64>,
}

fn count_tokens(tok: &Tokenizer, text: &str) -> Result<usize> {
    Ok(tok.encode(text)?.len() + 1)
}

/// The generated ladder: per length, depth and repeat, a keyed needle prompt of at most that
/// many tokens (filler lines added or removed until it is within 16 tokens below); with
/// `--multi-key N`, as many again with N needles each.
pub(crate) fn ladder(a: &NiahArgs, tok: &Tokenizer) -> Result<Vec<Item>> {
    let mut items = Vec::new();
    let kinds: &[usize] = if a.multi_key >= 2 {
        &[1, a.multi_key]
    } else {
        &[1]
    };
    for (li, &len) in a.lengths.iter().enumerate() {
        for (di, &depth) in a.depths.iter().enumerate() {
            for &keys in kinds {
                for r in 0..a.per_cell {
                    items.push(ladder_item(a, tok, (li, len), (di, depth), keys, r)?);
                }
            }
        }
    }
    Ok(items)
}

/// One ladder prompt: `keys` needles, the first at `depth`, the others spread after it.
fn ladder_item(
    a: &NiahArgs,
    tok: &Tokenizer,
    (li, len): (usize, usize),
    (di, depth): (usize, f64),
    keys: usize,
    r: usize,
) -> Result<Item> {
    let cell = ((li * a.depths.len() + di) * a.per_cell + r) as u64;
    // Single needles keep their item numbers; multi-key items take others.
    let key = if keys == 1 { cell } else { cell + (1 << 32) };
    let mut depths: Vec<f64> = (0..keys)
        .map(|i| (depth + i as f64 / keys as f64).fract())
        .collect();
    depths.sort_by(f64::total_cmp);
    let make = |n: usize| keyed_needles(a.seed, key, n, &depths, a.distractors);
    let mut n = (len / 12).max(1);
    let mut p = make(n);
    for _ in 0..24 {
        let t = count_tokens(tok, &p.0.text)?;
        if t <= len && len - t < 16 {
            break;
        }
        let step = ((len as f64 - t as f64) / 11.0).round() as i64;
        let step = if step != 0 {
            step
        } else if t > len {
            -1
        } else {
            1
        };
        n = (n as i64 + step).max(1) as usize;
        p = make(n);
    }
    while n > 1 && count_tokens(tok, &p.0.text)? > len {
        n -= 1;
        p = make(n);
    }
    let (prompt, mut codes) = p;
    let answer = codes.remove(0);
    Ok(Item {
        id: match keys {
            1 => format!("L{len}-d{depth:.2}-r{r}"),
            k => format!("L{len}-d{depth:.2}-r{r}-k{k}"),
        },
        text: prompt.text,
        answer,
        also: codes,
        bucket: len,
        depth: Some(depth),
    })
}

/// `{"id", "text", "answer"}` per line; other fields (common in JSONL datasets) are ignored.
/// Each item goes to the ladder length nearest its token count (the larger on a tie), so a
/// file of prompts of many lengths reports a few buckets, not one per length.
pub(crate) fn read_prompts(path: &Path, lengths: &[usize], tok: &Tokenizer) -> Result<Vec<Item>> {
    let body =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut items = Vec::new();
    for (n, line) in body.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        #[derive(Deserialize)]
        struct Line {
            id: String,
            text: String,
            answer: String,
        }
        let l: Line = serde_json::from_str(line).map_err(|e| {
            anyhow::anyhow!(
                "{}:{}: expected {{\"id\", \"text\", \"answer\"}}: {e}",
                path.display(),
                n + 1
            )
        })?;
        if l.text.trim().is_empty() || l.answer.is_empty() {
            bail!("{}:{}: empty text or answer", path.display(), n + 1);
        }
        let t = count_tokens(tok, &l.text)?;
        items.push(Item {
            id: l.id,
            text: l.text,
            answer: l.answer,
            also: Vec::new(),
            bucket: nearest_length(lengths, t),
            depth: None,
        });
    }
    if items.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok(items)
}

/// The ladder length nearest `tokens` (the larger on a tie); `tokens` itself without a ladder.
fn nearest_length(lengths: &[usize], tokens: usize) -> usize {
    lengths
        .iter()
        .copied()
        .min_by_key(|&b| (b.abs_diff(tokens), std::cmp::Reverse(b)))
        .unwrap_or(tokens)
}

#[cfg(test)]
mod tests {
    use super::nearest_length;

    #[test]
    fn prompts_go_to_the_nearest_ladder_length() {
        let ladder = [512, 1024, 2048, 3584];
        for (tokens, want) in [
            (10, 512),
            (700, 512),
            (768, 1024),
            (1500, 1024),
            (1600, 2048),
            (3000, 3584),
            (16_000, 3584),
        ] {
            assert_eq!(nearest_length(&ladder, tokens), want, "{tokens} tokens");
        }
        assert_eq!(nearest_length(&[], 777), 777);
    }
}
