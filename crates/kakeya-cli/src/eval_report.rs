//! The report of `kakeya eval niah`: per-item results, per-mode recall by length bucket against
//! `full`, bytes held and their ratio to the full cache in 16-bit floats, speeds, fidelity; the
//! recall-against-bytes plot.

use std::collections::{BTreeMap, HashMap};

use kakeya_runtime::{KvBytes, KvMode};
use kakeya_train::plot::{Series, chart};
use serde::{Deserialize, Serialize};

use crate::bench::median;
use crate::eval::Settings;

/// Version of the report layout.
pub const SCHEMA_VERSION: u32 = 1;

/// One prompt in one mode.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ItemResult {
    /// Prompt id.
    pub id: String,
    /// KV mode.
    pub mode: KvMode,
    /// Length bucket.
    pub bucket: usize,
    /// Needle depth (generated prompts).
    pub depth: Option<f64>,
    /// Prompt tokens (`<bos>` included).
    pub prompt_tokens: usize,
    /// The answer looked for.
    pub answer: String,
    /// Further answers looked for (a multi-key item's other codes).
    #[serde(default)]
    pub also: Vec<String>,
    /// The generated text.
    pub output: String,
    /// The generated ids.
    pub tokens: Vec<u32>,
    /// Whether the output contains the answer.
    pub correct: bool,
    /// Index of the first generated token that differs from `full`'s (`None`: identical).
    pub first_divergence_from_full: Option<usize>,
    /// Total K/V bytes held at the end.
    pub kv_bytes: usize,
    /// The bytes by part.
    pub kv: KvBytes,
    /// Prefill tokens per second.
    pub prefill_tok_s: f64,
    /// Decode tokens per second.
    pub decode_tok_s: f64,
}

/// One length bucket of one mode.
#[derive(Debug, Clone, Serialize)]
pub struct Bucket {
    /// Bucket length (tokens).
    pub length: usize,
    /// Items.
    pub items: usize,
    /// Fraction correct.
    pub recall: f64,
    /// `|recall − full's recall|` in points (100 = all items).
    pub delta_points: f64,
    /// Mean total bytes held at the end.
    pub kv_bytes: f64,
    /// Mean bytes of the native cache in 16-bit floats at the same lengths.
    pub full_f16_bytes: f64,
    /// `full_f16_bytes / kv_bytes`.
    pub ratio_to_full_f16: f64,
    /// Median prefill tok/s.
    pub prefill_tok_s: f64,
    /// Median decode tok/s.
    pub decode_tok_s: f64,
}

/// One mode over every item.
#[derive(Debug, Clone, Serialize)]
pub struct ModeSummary {
    /// The mode.
    pub mode: KvMode,
    /// Items run.
    pub items: usize,
    /// Fraction correct.
    pub recall: f64,
    /// `|recall − full's recall|` in points.
    pub delta_points: f64,
    /// Per length bucket.
    pub by_length: Vec<Bucket>,
    /// Items whose output equals `full`'s token for token.
    pub identical_to_full: usize,
    /// Mean index of the first token that differs from `full`'s, over the items that differ.
    pub mean_first_divergence: Option<f64>,
    /// Fraction of generated positions (up to the shorter output) holding `full`'s token.
    pub token_match_rate: f64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Precision of Kakeya's exact K/V (the `full` mode's cache).
    pub full_cache_dtype: &'static str,
    /// What the ratios are against.
    pub ratio_reference: &'static str,
    /// The settings of the run.
    pub settings: Settings,
    /// Per mode.
    pub modes: Vec<ModeSummary>,
    /// Per item and mode.
    pub items: Vec<ItemResult>,
}

fn recall(rs: &[&ItemResult]) -> f64 {
    if rs.is_empty() {
        return 0.0;
    }
    rs.iter().filter(|r| r.correct).count() as f64 / rs.len() as f64
}

/// Aggregates the per-item results.
pub fn report(settings: &Settings, results: &[ItemResult]) -> Report {
    let full: HashMap<&str, &ItemResult> = results
        .iter()
        .filter(|r| r.mode == KvMode::Full)
        .map(|r| (r.id.as_str(), r))
        .collect();
    let mut modes = Vec::new();
    for &mode in &settings.modes {
        let rs: Vec<&ItemResult> = results.iter().filter(|r| r.mode == mode).collect();
        let full_of = |rs: &[&ItemResult]| -> Vec<&ItemResult> {
            rs.iter()
                .filter_map(|r| full.get(r.id.as_str()).copied())
                .collect()
        };
        let mut buckets: BTreeMap<usize, Vec<&ItemResult>> = BTreeMap::new();
        for r in &rs {
            buckets.entry(r.bucket).or_default().push(r);
        }
        let by_length = buckets
            .into_iter()
            .map(|(length, b)| {
                let n = b.len() as f64;
                let kv_bytes = b.iter().map(|r| r.kv.total as f64).sum::<f64>() / n;
                let full_f16_bytes = b.iter().map(|r| r.kv.full_f16 as f64).sum::<f64>() / n;
                let rec = recall(&b);
                Bucket {
                    length,
                    items: b.len(),
                    recall: rec,
                    delta_points: 100.0 * (rec - recall(&full_of(&b))).abs(),
                    kv_bytes,
                    full_f16_bytes,
                    ratio_to_full_f16: if kv_bytes > 0.0 {
                        full_f16_bytes / kv_bytes
                    } else {
                        0.0
                    },
                    prefill_tok_s: median(b.iter().map(|r| r.prefill_tok_s).collect()),
                    decode_tok_s: median(b.iter().map(|r| r.decode_tok_s).collect()),
                }
            })
            .collect();
        let diverged: Vec<f64> = rs
            .iter()
            .filter_map(|r| r.first_divergence_from_full.map(|i| i as f64))
            .collect();
        let (mut same, mut compared) = (0usize, 0usize);
        for r in &rs {
            if let Some(f) = full.get(r.id.as_str()) {
                let n = f.tokens.len().min(r.tokens.len());
                compared += n;
                same += f.tokens[..n]
                    .iter()
                    .zip(&r.tokens[..n])
                    .filter(|(a, b)| a == b)
                    .count();
            }
        }
        let rec = recall(&rs);
        modes.push(ModeSummary {
            mode,
            items: rs.len(),
            recall: rec,
            delta_points: 100.0 * (rec - recall(&full_of(&rs))).abs(),
            by_length,
            identical_to_full: rs.len() - diverged.len(),
            mean_first_divergence: (!diverged.is_empty())
                .then(|| diverged.iter().sum::<f64>() / diverged.len() as f64),
            token_match_rate: if compared > 0 {
                same as f64 / compared as f64
            } else {
                0.0
            },
        });
    }
    Report {
        schema_version: SCHEMA_VERSION,
        full_cache_dtype: kakeya_runtime::KvDtype::default().name(),
        ratio_reference: "the model's native cache layout (global layers every position, sliding layers their window) at the same length in 16-bit floats",
        settings: settings.clone(),
        modes,
        items: results.to_vec(),
    }
}

const COLOURS: [[u8; 3]; 11] = [
    [0, 0, 0],
    [200, 40, 40],
    [30, 90, 200],
    [20, 150, 60],
    [160, 60, 180],
    [220, 130, 0],
    [0, 150, 160],
    [120, 80, 40],
    [230, 80, 160],
    [90, 90, 90],
    [140, 160, 0],
];

/// Recall against total KV bytes (MiB, log2), one line per mode through its length buckets.
pub fn plot(rep: &Report) -> Vec<u8> {
    let series: Vec<Series> = rep
        .modes
        .iter()
        .enumerate()
        .map(|(i, m)| Series {
            label: m.mode.name().to_string(),
            rgb: COLOURS[i % COLOURS.len()],
            points: m
                .by_length
                .iter()
                .map(|b| ((b.kv_bytes.max(1.0) / (1u64 << 20) as f64).log2(), b.recall))
                .collect(),
        })
        .collect();
    chart(
        "NIAH RECALL VS KV BYTES (EACH LINE: ONE MODE, POINTS: LENGTHS)",
        "LOG2 KV MIB HELD",
        &series,
        Some((0.0, 1.0)),
    )
}

/// The table on stderr.
pub fn print_table(rep: &Report) {
    eprintln!(
        "{:<17} {:>6} {:>7} {:>7} {:>10} {:>8} {:>9} {:>9}",
        "mode", "length", "recall", "|Δ|pt", "KV MiB", "vs f16", "prefill", "decode"
    );
    for m in &rep.modes {
        for b in &m.by_length {
            eprintln!(
                "{:<17} {:>6} {:>7.3} {:>7.1} {:>10.2} {:>7.2}x {:>9.1} {:>9.1}",
                m.mode.name(),
                b.length,
                b.recall,
                b.delta_points,
                b.kv_bytes / (1u64 << 20) as f64,
                b.ratio_to_full_f16,
                b.prefill_tok_s,
                b.decode_tok_s
            );
        }
        eprintln!(
            "{:<17} {:>6} {:>7.3} {:>7.1}   identical to full: {}/{}, token match {:.3}",
            m.mode.name(),
            "all",
            m.recall,
            m.delta_points,
            m.identical_to_full,
            m.items,
            m.token_match_rate
        );
    }
}
