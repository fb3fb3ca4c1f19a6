//! Prompt sources: JSON-lines files and the synthetic needle-in-a-haystack generator.

use std::path::Path;

use kakeya_runtime::chat::{self, Message};
use serde::{Deserialize, Serialize};

use crate::config::SourceConfig;
use crate::error::{CaptureError, Result};

/// One prompt, with where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prompt {
    /// Index of the source in the config.
    pub source: usize,
    /// Index within the source (line number − 1 for files, `i` for the generator).
    pub item: usize,
    /// The prompt text (chat template already applied for messages).
    pub text: String,
    /// For needle prompts: the code the answer should contain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
}

/// Reads every source in order.
pub fn load_sources(sources: &[SourceConfig]) -> Result<Vec<Prompt>> {
    let mut out = Vec::new();
    for (i, s) in sources.iter().enumerate() {
        match s {
            SourceConfig::Jsonl { path, limit } => out.extend(read_jsonl(i, path, *limit)?),
            SourceConfig::Needle { count, seed, lines } => {
                out.extend((0..*count).map(|k| needle(i, k, *seed, *lines)));
            }
        }
    }
    Ok(out)
}

/// `{"text": ...}` or `{"messages": [...]}` per line; blank lines are skipped.
fn read_jsonl(source: usize, path: &Path, limit: Option<usize>) -> Result<Vec<Prompt>> {
    let body = std::fs::read_to_string(path).map_err(|e| CaptureError::io(path, e))?;
    let mut out = Vec::new();
    for (n, line) in body.lines().enumerate() {
        if limit.is_some_and(|l| out.len() >= l) {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        let err = |msg: String| CaptureError::Prompt {
            path: path.to_path_buf(),
            line: n + 1,
            msg,
        };
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| err(format!("invalid JSON: {e}")))?;
        let text = if let Some(t) = v.get("text").and_then(|t| t.as_str()) {
            t.to_string()
        } else if let Some(m) = v.get("messages") {
            let msgs: Vec<Message> = serde_json::from_value(m.clone())
                .map_err(|e| err(format!("messages must be [{{role, content}}]: {e}")))?;
            chat::format_chat(&msgs).map_err(|e| err(e.to_string()))?
        } else {
            return Err(err(
                r#"expected {"text": ...} or {"messages": [...]}"#.into()
            ));
        };
        if text.trim().is_empty() {
            return Err(err("empty prompt".into()));
        }
        out.push(Prompt {
            source,
            item: n,
            text,
            answer: None,
        });
    }
    Ok(out)
}

/// splitmix64: a tiny deterministic stream (prompt `i` depends only on seed and `i`).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const FILLER: [&str; 12] = [
    "The grass is green and the sky is blue.",
    "A gentle breeze moved through the trees by the river.",
    "The market opened early, as it did every day of the week.",
    "Clouds drifted slowly over the hills in the afternoon.",
    "The library kept its old books on the highest shelves.",
    "Children played in the park until the streetlights came on.",
    "The baker sold out of bread before noon.",
    "Rain fell softly on the roofs of the quiet town.",
    "A cat slept in the sun on the windowsill.",
    "The train to the coast left on time this morning.",
    "Farmers brought apples and pears to the square.",
    "The museum was closed for repairs all summer.",
];

/// Needle prompt `k` of a source: `lines` filler lines, the needle at a random depth, the
/// question last.
pub fn needle(source: usize, k: usize, seed: u64, lines: [usize; 2]) -> Prompt {
    let mut state = mix(seed ^ mix(k as u64));
    let mut next = || {
        state = mix(state);
        state
    };
    let n = lines[0] + (next() % (lines[1] - lines[0] + 1) as u64) as usize;
    let code = format!("{:06}", next() % 1_000_000);
    let depth = (next() % (n as u64 + 1)) as usize;
    let needle = format!("The secret code is {code}.");
    let text = haystack(&mut next, n, &[(depth, needle)])
        + "Question: what is the secret code?\nAnswer: The secret code is";
    Prompt {
        source,
        item: k,
        text,
        answer: Some(code),
    }
}

/// `n` filler lines drawn from `next`, with `inserts` (line index, text) placed before the
/// filler line of that index (`n` = after the last), each line ending in a newline.
fn haystack(next: &mut dyn FnMut() -> u64, n: usize, inserts: &[(usize, String)]) -> String {
    let mut text = String::new();
    for i in 0..=n {
        for (_, t) in inserts.iter().filter(|(at, _)| *at == i) {
            text.push_str(t);
            text.push('\n');
        }
        if i < n {
            text.push_str(FILLER[(next() % FILLER.len() as u64) as usize]);
            text.push('\n');
        }
    }
    text
}

/// Names of the keys of [`keyed_needle`].
const KEYS: [&str; 16] = [
    "alpha", "bravo", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo",
    "juniper", "kestrel", "lantern", "meadow", "nickel", "orchid", "pepper",
];

/// A needle with distractors: `n` filler lines; the needle "The secret code for `key` is
/// NNNNNN." at `depth` (a fraction of the haystack, 0 = first line, 1 = last); `distractors`
/// other keys with their own codes at random depths; the question asks for `key`'s code.
/// Deterministic in (`seed`, `item`).
pub fn keyed_needle(seed: u64, item: u64, n: usize, depth: f64, distractors: usize) -> Prompt {
    let (p, _) = keyed_needles(seed, item, n, &[depth], distractors);
    p
}

/// Several needles, all asked for: needle `i` ("The secret code for `key_i` is NNNNNN.") at
/// `depths[i]`, `distractors` other keys at random depths, and a question asking for every
/// needle's code in order; the answer begins with the first. Returns the prompt (its `answer`
/// the first code) and every code asked for, in order. With one depth this is
/// [`keyed_needle`]'s prompt. Deterministic in (`seed`, `item`).
pub fn keyed_needles(
    seed: u64,
    item: u64,
    n: usize,
    depths: &[f64],
    distractors: usize,
) -> (Prompt, Vec<String>) {
    let mut state = mix(seed ^ mix(item.wrapping_add(0x6e65_6564)));
    let mut next = || {
        state = mix(state);
        state
    };
    let mut keys: Vec<&str> = KEYS.to_vec();
    for i in (1..keys.len()).rev() {
        keys.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    let code = |next: &mut dyn FnMut() -> u64| format!("{:06}", next() % 1_000_000);
    let asked = depths.len().clamp(1, KEYS.len());
    let mut answers = Vec::with_capacity(asked);
    let mut inserts = Vec::new();
    for (key, &depth) in keys.iter().zip(depths).take(asked) {
        let answer = code(&mut next);
        let at = ((depth.clamp(0.0, 1.0) * n as f64).round() as usize).min(n);
        inserts.push((at, format!("The secret code for {key} is {answer}.")));
        answers.push(answer);
    }
    for key in keys
        .iter()
        .skip(asked)
        .take(distractors.min(KEYS.len() - asked))
    {
        let c = code(&mut next);
        let d = (next() % (n as u64 + 1)) as usize;
        inserts.push((d, format!("The secret code for {key} is {c}.")));
    }
    let question = match asked {
        1 => format!("what is the secret code for {}?", keys[0]),
        _ => {
            let (last, rest) = keys[..asked].split_last().expect("asked >= 1");
            format!(
                "what are the secret codes for {} and {last}?",
                rest.join(", ")
            )
        }
    };
    let text = haystack(&mut next, n, &inserts)
        + &format!(
            "Question: {question}\nAnswer: The secret code for {} is",
            keys[0]
        );
    let prompt = Prompt {
        source: 0,
        item: item as usize,
        text,
        answer: Some(answers[0].clone()),
    };
    (prompt, answers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jsonl(name: &str, body: &str) -> (kakeya_models::testing::Scratch, std::path::PathBuf) {
        let s = kakeya_models::testing::Scratch::new(name);
        let p = s.0.join("prompts.jsonl");
        std::fs::write(&p, body).unwrap();
        (s, p)
    }

    fn source(path: &Path) -> Vec<SourceConfig> {
        vec![SourceConfig::Jsonl {
            path: path.to_path_buf(),
            limit: None,
        }]
    }

    #[test]
    fn messages_lines_go_through_gemmas_chat_template() {
        let (_s, p) = jsonl(
            "prompts-messages",
            concat!(
                r#"{"text": "plain text"}"#,
                "\n\n",
                r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]}"#,
                "\n",
                r#"{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}"#,
                "\n"
            ),
        );
        let got = load_sources(&source(&p)).unwrap();
        let texts: Vec<&str> = got.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(
            texts,
            [
                "plain text",
                "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n",
                "<start_of_turn>user\na<end_of_turn>\n<start_of_turn>model\nb<end_of_turn>\n\
                 <start_of_turn>user\nc<end_of_turn>\n<start_of_turn>model\n",
            ]
        );
        assert_eq!(
            got.iter().map(|p| p.item).collect::<Vec<_>>(),
            [0, 2, 3],
            "items are line numbers − 1"
        );
    }

    #[test]
    fn bad_messages_name_the_file_and_line() {
        for (body, why) in [
            (
                r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
                "robot",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}"#,
                "alternate",
            ),
            (r#"{"messages": [{"role": "user"}]}"#, "content"),
            (r#"{"messages": []}"#, "no user message"),
        ] {
            let (_s, p) = jsonl(
                "prompts-bad-messages",
                &format!("{{\"text\": \"ok\"}}\n{body}\n"),
            );
            let err = load_sources(&source(&p)).unwrap_err().to_string();
            assert!(
                err.contains("prompts.jsonl") && err.contains(":2") && err.contains(why),
                "{body}: {err}"
            );
        }
    }

    #[test]
    fn needles_hold_their_answer_where_asked() {
        let p = needle(0, 3, 2, [20, 80]);
        let code = p.answer.clone().unwrap();
        assert_eq!(
            p.text
                .matches(&format!("The secret code is {code}."))
                .count(),
            1
        );
        assert_eq!(p, needle(0, 3, 2, [20, 80]), "deterministic");
        for (depth, want_line) in [(0.0, 0), (0.5, 20), (1.0, 40)] {
            let k = keyed_needle(7, 1, 40, depth, 3);
            let code = k.answer.clone().unwrap();
            let lines: Vec<&str> = k.text.lines().collect();
            // 40 filler lines + the needle + 3 distractors + the question's two lines.
            assert_eq!(lines.len(), 40 + 4 + 2);
            let key = lines.last().unwrap().split(' ').nth(5).unwrap();
            let needle_at = lines
                .iter()
                .position(|l| *l == format!("The secret code for {key} is {code}."))
                .unwrap();
            let before = lines[..needle_at]
                .iter()
                .filter(|l| !l.starts_with("The secret code for"))
                .count();
            assert_eq!(before, want_line, "depth {depth}");
            let others = lines
                .iter()
                .filter(|l| l.starts_with("The secret code for"))
                .count();
            assert_eq!(others, 4, "the needle and 3 distractors");
            assert!(
                !lines[..lines.len() - 2]
                    .iter()
                    .any(|l| l.contains(&format!("for {key} is"))
                        && !l.ends_with(&format!("{code}."))),
                "distractors use other keys"
            );
        }
        assert_ne!(
            keyed_needle(7, 1, 40, 0.5, 3),
            keyed_needle(7, 2, 40, 0.5, 3)
        );
    }

    #[test]
    fn multi_key_needles_ask_for_every_code_in_order() {
        let (p, codes) = keyed_needles(3, 9, 60, &[0.2, 0.5, 0.8], 2);
        assert_eq!(codes.len(), 3);
        assert_eq!(p.answer.as_deref(), Some(codes[0].as_str()));
        // Each asked-for code is in the haystack once, before the question, in depth order.
        let at: Vec<usize> = codes
            .iter()
            .map(|c| p.text.find(c.as_str()).unwrap())
            .collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{at:?}");
        assert!(p.text.contains("what are the secret codes for "));
        assert!(p.text.matches("The secret code for ").count() >= 3 + 2);
        // One depth is the single-needle prompt.
        let (one, codes) = keyed_needles(3, 9, 60, &[0.5], 2);
        assert_eq!(one.text, keyed_needle(3, 9, 60, 0.5, 2).text);
        assert_eq!(codes.len(), 1);
    }
}
