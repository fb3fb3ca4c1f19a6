//! `kakeya bench --drafter DIR` / `--replay-drafts`: autoregressive vs speculative decode
//! measured side by side in one run over a prompt set, after warm-up, median of runs.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_runtime::speculative::tree_drafts::DEFAULT_TOP_K;
use kakeya_runtime::{
    Generation, GenerationConfig, KvSetup, Proposer, ReplayProposer, Schedule, Session, SpecConfig,
    TreeDrafts, Verifier, generate, speculative_generate, speculative_generate_tree,
};
use kakeya_weights::Tokenizer;
use serde::Serialize;

use crate::bench::median;
use crate::draft::DraftKind;

/// Prompts used when `--prompts` is not given (general text, code, lists; not training data).
pub const DEFAULT_PROMPTS: [&str; 20] = [
    "The history of the printing press begins",
    "Write a short story about a lighthouse keeper who",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "The main differences between rivers and canals are",
    "Here is a recipe for banana bread. Ingredients:\n",
    "In economics, inflation refers to",
    "The following is a letter from a student to her teacher:\n\nDear",
    "A list of common houseplants and how to care for them:\n1.",
    "class Stack:\n    def __init__(self):\n",
    "The planet Mars has two moons,",
    "Explain how a bicycle stays upright:",
    "The year was 1848, and the city",
    "SQL query to find the ten largest orders:\n",
    "Tips for a good night's sleep:\n-",
    "The theory of evolution by natural selection states that",
    "Once there was a robot who wanted to",
    "function debounce(fn, ms) {\n",
    "The Great Wall of China is",
    "Summary of the water cycle: evaporation,",
    "My favourite season is autumn because",
];

/// The prompts of `path` ([`read_prompts`]), or the built-in [`DEFAULT_PROMPTS`].
pub fn prompts_or_default(path: Option<&Path>) -> Result<Vec<String>> {
    match path {
        Some(p) => read_prompts(p),
        None => Ok(DEFAULT_PROMPTS.iter().map(|s| s.to_string()).collect()),
    }
}

/// Reads `{"text": ...}` JSON lines.
pub fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let body = std::fs::read_to_string(path)
        .with_context(|| format!("reading prompts {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in body.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: invalid JSON", path.display(), i + 1))?;
        let text = v["text"]
            .as_str()
            .with_context(|| format!("{}:{}: expected {{\"text\": ...}}", path.display(), i + 1))?;
        out.push(text.to_string());
    }
    if out.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok(out)
}

/// What drafts the tokens.
pub enum Drafts<'a> {
    /// A proposer kind, with the drafter it uses and the static n-gram table its lookups use.
    Kind(
        DraftKind,
        Option<&'a DFlashDrafter>,
        Option<std::sync::Arc<kakeya_runtime::NgramTable>>,
    ),
    /// The AR output itself (every draft right): the engine's ceiling and overhead.
    Replay,
    /// A tree per block from every source (the drafter's top-k, lookups, the table).
    Tree(
        Option<&'a DFlashDrafter>,
        Option<std::sync::Arc<kakeya_runtime::NgramTable>>,
    ),
}

impl Drafts<'_> {
    fn drafter(&self) -> Option<&DFlashDrafter> {
        match self {
            Drafts::Kind(_, d, _) | Drafts::Tree(d, _) => *d,
            Drafts::Replay => None,
        }
    }
}

/// One prompt's figures (medians over the measured runs).
#[derive(Debug, Serialize)]
pub struct PromptFigure {
    prompt_tokens: usize,
    generated: usize,
    ar_decode_tok_s: f64,
    spec_decode_tok_s: f64,
    speedup: f64,
    mean_acceptance_length: f64,
    identical: bool,
    /// Where speculative decoding first left AR's tokens, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    divergence: Option<Divergence>,
}

/// The first step at which the speculative tokens differ from AR's, with AR's logits there (a
/// fresh plain forward over the prompt and AR's tokens before it): a gap near the device's
/// numeric drift marks a near-tie that a verify block's different summation order can flip
/// (GPU matmuls are not batch-invariant; the CPU kernels are).
#[derive(Debug, Serialize)]
pub struct Divergence {
    step: usize,
    ar_token: u32,
    spec_token: u32,
    /// AR's logit of its token minus its logit of the speculative token.
    logit_gap: f32,
}

/// [`Divergence`] of `spec` from `ar` (both continuations of `ids`), if any.
fn divergence(
    model: &GemmaModel,
    setup: KvSetup<'_>,
    ids: &[u32],
    ar: &[u32],
    spec: &[u32],
) -> Result<Option<Divergence>> {
    let Some(step) = ar.iter().zip(spec).position(|(a, b)| a != b) else {
        return Ok(None);
    };
    let context: Vec<u32> = ids.iter().chain(&ar[..step]).copied().collect();
    let logits = Session::with_kv(model, setup)?.run(&context, 512)?;
    let (a, b) = (ar[step], spec[step]);
    Ok(Some(Divergence {
        step,
        ar_token: a,
        spec_token: b,
        logit_gap: logits[a as usize] - logits[b as usize],
    }))
}

/// The whole comparison.
#[derive(Debug, Serialize)]
pub struct SpecBench {
    drafts: String,
    block_size: usize,
    schedule: Schedule,
    /// Verify forwards by block length over all measured prompts (length 1: plain steps).
    blocks_by_length: Vec<usize>,
    /// The same by where the drafts would come from (the adaptive schedule's sources).
    blocks_by_source: BTreeMap<&'static str, Vec<usize>>,
    /// Drafts accepted by source.
    accepted_by_source: BTreeMap<&'static str, usize>,
    probes: usize,
    gen_tokens: usize,
    runs: usize,
    warmup: usize,
    prompts: Vec<PromptFigure>,
    /// Generated tokens / decode seconds over all prompts (medians per prompt).
    ar_decode_tok_s: f64,
    spec_decode_tok_s: f64,
    speedup: f64,
    mean_acceptance_length: f64,
    per_position_acceptance: Vec<f64>,
    all_identical: bool,
}

fn run_spec(
    model: &GemmaModel,
    drafts: &Drafts<'_>,
    ids: &[u32],
    reference: &[u32],
    cfg: &GenerationConfig,
    (spec, base): (SpecConfig, KvSetup<'_>),
) -> Result<Generation> {
    let setup = match drafts.drafter() {
        Some(d) => base.drafter(d),
        None => base,
    };
    let mut verifier = Verifier::new(model, setup, spec.block_size)?;
    let mut proposer: Box<dyn Proposer + '_> = match drafts {
        Drafts::Kind(kind, d, t) => kind.proposer(*d, t.clone())?,
        Drafts::Replay => Box::new(ReplayProposer::new(ids, reference)),
        Drafts::Tree(d, t) => {
            let mut sources = TreeDrafts::new(*d, t.clone(), DEFAULT_TOP_K);
            return Ok(speculative_generate_tree(
                &mut verifier,
                &mut sources,
                ids,
                cfg,
                spec,
                &mut |_| {},
            )?);
        }
    };
    Ok(speculative_generate(
        &mut verifier,
        proposer.as_mut(),
        ids,
        cfg,
        spec,
        &mut |_| {},
    )?)
}

/// The speculative runs' sums over prompts.
struct Totals {
    /// Tokens decoded and the seconds they took at each prompt's median rate: AR, then
    /// speculative.
    ar_tok: usize,
    ar_secs: f64,
    sp_tok: usize,
    sp_secs: f64,
    blocks: usize,
    committed: usize,
    probes: usize,
    by_length: Vec<usize>,
    by_source: BTreeMap<&'static str, Vec<usize>>,
    accepted_by_source: BTreeMap<&'static str, usize>,
    slot_tried: Vec<usize>,
    slot_hit: Vec<usize>,
}

impl Totals {
    fn new(block: usize) -> Self {
        Self {
            ar_tok: 0,
            ar_secs: 0.0,
            sp_tok: 0,
            sp_secs: 0.0,
            blocks: 0,
            committed: 0,
            probes: 0,
            by_length: vec![0; block],
            by_source: BTreeMap::new(),
            accepted_by_source: BTreeMap::new(),
            slot_tried: vec![0; block.saturating_sub(1)],
            slot_hit: vec![0; block.saturating_sub(1)],
        }
    }

    /// One prompt: `decoded` tokens at the median rates, and its last run's statistics.
    fn add(
        &mut self,
        decoded: usize,
        (ar_rate, sp_rate): (f64, f64),
        st: &kakeya_runtime::speculative::SpecStats,
    ) {
        self.ar_tok += decoded;
        self.ar_secs += decoded as f64 / ar_rate.max(1e-9);
        self.sp_tok += decoded;
        self.sp_secs += decoded as f64 / sp_rate.max(1e-9);
        self.blocks += st.blocks;
        self.committed += st.blocks + st.accepted;
        self.probes += st.schedule_stats.probes;
        for (n, &c) in self
            .by_length
            .iter_mut()
            .zip(&st.schedule_stats.blocks_by_length)
        {
            *n += c;
        }
        let block = self.by_length.len();
        for (&name, counts) in &st.schedule_stats.blocks_by_source {
            let sum = self.by_source.entry(name).or_insert_with(|| vec![0; block]);
            for (n, &c) in sum.iter_mut().zip(counts) {
                *n += c;
            }
        }
        for (&name, &a) in &st.schedule_stats.accepted_by_source {
            *self.accepted_by_source.entry(name).or_default() += a;
        }
        for (k, (&t, &h)) in st
            .per_position_drafted
            .iter()
            .zip(&st.per_position_accepted)
            .enumerate()
        {
            self.slot_tried[k] += t;
            self.slot_hit[k] += h;
        }
    }
}

/// What drafted, as the report names it.
fn drafts_label(drafts: &Drafts<'_>) -> String {
    match drafts {
        Drafts::Kind(k, _, t) => match (*k, t) {
            (DraftKind::Ngram | DraftKind::Combined, Some(t)) => {
                format!("{} (n-gram table: {} contexts)", k.name(), t.len())
            }
            _ => k.name().into(),
        },
        Drafts::Replay => "replay (AR output; every draft right)".into(),
        Drafts::Tree(_, t) => format!(
            "trees (drafter top-{DEFAULT_TOP_K}, lookups{})",
            t.as_ref().map_or(String::new(), |t| format!(
                ", n-gram table: {} contexts",
                t.len()
            ))
        ),
    }
}

/// Runs AR and speculative decoding on every prompt: `warmup` unmeasured rounds on the first
/// prompt, then `runs` measured rounds per prompt, AR and speculative interleaved.
#[allow(clippy::too_many_arguments)]
pub fn run(
    model: &GemmaModel,
    tok: &Tokenizer,
    drafts: Drafts<'_>,
    prompts: &[String],
    (spec, base): (SpecConfig, KvSetup<'_>),
    gen_tokens: usize,
    runs: usize,
    warmup: usize,
) -> Result<SpecBench> {
    let block = spec.block_size;
    // Plain decoding in a restored mode still fills the drafter's store.
    let ar_setup = match drafts.drafter() {
        Some(d) if base.policy.mode.restores() && base.drafter.is_none() => base.drafter(d),
        _ => base,
    };
    let cfg = GenerationConfig::greedy(gen_tokens, 512);
    let bar = indicatif::ProgressBar::new((prompts.len() * runs + warmup) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix("AR vs speculative");
    let mut figures = Vec::new();
    let mut sum = Totals::new(block);
    for (pi, text) in prompts.iter().enumerate() {
        let mut ids = vec![tok.bos];
        ids.extend(tok.encode(text)?);
        let rounds = runs + if pi == 0 { warmup } else { 0 };
        let (mut ar_rates, mut sp_rates) = (Vec::new(), Vec::new());
        let mut last = None;
        for r in 0..rounds {
            let t = Instant::now();
            let ar = generate(
                &mut Session::with_kv(model, ar_setup)?,
                &ids,
                &cfg,
                &mut |_| {},
            )?;
            let ar_wall = t.elapsed().as_secs_f64();
            let sp = run_spec(model, &drafts, &ids, &ar.tokens, &cfg, (spec, base))?;
            tracing::debug!(prompt = pi, run = r, ar_wall, "bench round");
            let measured = pi > 0 || r >= warmup;
            if measured {
                ar_rates.push(ar.stats.decode_tok_s);
                sp_rates.push(sp.stats.decode_tok_s);
                bar.set_message(format!(
                    "prompt {pi}: AR {:.1} tok/s, spec {:.1} tok/s",
                    ar.stats.decode_tok_s, sp.stats.decode_tok_s
                ));
            }
            bar.inc(1);
            last = Some((ar, sp));
        }
        let (ar, sp) = last.expect("at least one run");
        let st = sp.spec.as_ref().expect("speculative stats");
        let (ar_rate, sp_rate) = (median(ar_rates), median(sp_rates));
        sum.add(sp.tokens.len().saturating_sub(1), (ar_rate, sp_rate), st);
        figures.push(PromptFigure {
            prompt_tokens: ids.len(),
            generated: sp.tokens.len(),
            ar_decode_tok_s: ar_rate,
            spec_decode_tok_s: sp_rate,
            speedup: sp_rate / ar_rate.max(1e-9),
            mean_acceptance_length: st.mean_acceptance_length,
            identical: sp.tokens == ar.tokens,
            divergence: divergence(model, ar_setup, &ids, &ar.tokens, &sp.tokens)?,
        });
    }
    bar.finish_and_clear();
    let ar_rate = sum.ar_tok as f64 / sum.ar_secs.max(1e-9);
    let sp_rate = sum.sp_tok as f64 / sum.sp_secs.max(1e-9);
    Ok(SpecBench {
        drafts: drafts_label(&drafts),
        block_size: block,
        schedule: spec.schedule,
        blocks_by_length: sum.by_length,
        blocks_by_source: sum.by_source,
        accepted_by_source: sum.accepted_by_source,
        probes: sum.probes,
        gen_tokens,
        runs,
        warmup,
        all_identical: figures.iter().all(|f| f.identical),
        prompts: figures,
        ar_decode_tok_s: ar_rate,
        spec_decode_tok_s: sp_rate,
        speedup: sp_rate / ar_rate.max(1e-9),
        mean_acceptance_length: sum.committed as f64 / sum.blocks.max(1) as f64,
        per_position_acceptance: sum
            .slot_tried
            .iter()
            .zip(&sum.slot_hit)
            .map(|(&t, &h)| if t > 0 { h as f64 / t as f64 } else { 0.0 })
            .collect(),
    })
}

/// Prints the comparison as a Markdown table.
pub fn print(b: &SpecBench) {
    println!(
        "AR vs speculative ({}), {:?} blocks up to {}, {} new tokens, median of {} runs after {} warm-up",
        b.drafts, b.schedule, b.block_size, b.gen_tokens, b.runs, b.warmup
    );
    println!(
        "blocks by length (1 = plain step): {:?}; probes: {}",
        b.blocks_by_length, b.probes
    );
    for (source, counts) in &b.blocks_by_source {
        let drafted: usize = counts.iter().skip(1).sum();
        let accepted = b.accepted_by_source.get(source).copied().unwrap_or(0);
        println!(
            "  drafts from {source}: blocks by length {counts:?}; {:.2} drafts accepted per drafted block",
            accepted as f64 / drafted.max(1) as f64
        );
    }
    println!(
        "| prompt | prompt tok | AR tok/s | spec tok/s | speed-up | acceptance length | identical |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (i, f) in b.prompts.iter().enumerate() {
        println!(
            "| {i} | {} | {:.1} | {:.1} | {:.2}× | {:.2} | {} |",
            f.prompt_tokens,
            f.ar_decode_tok_s,
            f.spec_decode_tok_s,
            f.speedup,
            f.mean_acceptance_length,
            f.identical
        );
        if let Some(d) = &f.divergence {
            println!(
                "|   | first difference at step {}: AR {} vs spec {}, AR logit gap {:.3e} | | | | | |",
                d.step, d.ar_token, d.spec_token, d.logit_gap
            );
        }
    }
    println!(
        "| all | | {:.1} | {:.1} | {:.2}× | {:.2} | {} |",
        b.ar_decode_tok_s,
        b.spec_decode_tok_s,
        b.speedup,
        b.mean_acceptance_length,
        b.all_identical
    );
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;
    use kakeya_models::GemmaModel;
    use kakeya_models::testing::{random_checkpoint, tiny_config};
    use kakeya_runtime::{GenerationConfig, KvSetup, Session, generate};

    use super::divergence;

    /// The first differing step, both tokens, and AR's logit of its own token minus that of the
    /// other: positive, since AR's token is the argmax there (the CPU path is bit for bit).
    #[test]
    fn a_divergence_reports_its_step_tokens_and_ar_gap() {
        let m = GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(8), 5), &Device::flex())
            .unwrap();
        let prompt = [3u32, 14, 15, 92, 65];
        let cfg = GenerationConfig::greedy(6, 512);
        let ar = generate(&mut Session::new(&m, 0), &prompt, &cfg, &mut |_| {})
            .unwrap()
            .tokens;
        let setup = KvSetup::full(0);
        assert!(divergence(&m, setup, &prompt, &ar, &ar).unwrap().is_none());
        let mut spec = ar.clone();
        spec[3] = (ar[3] + 1) % 97;
        let d = divergence(&m, setup, &prompt, &ar, &spec).unwrap().unwrap();
        assert_eq!((d.step, d.ar_token, d.spec_token), (3, ar[3], spec[3]));
        assert!(
            d.logit_gap > 0.0,
            "AR's token is the argmax: gap {}",
            d.logit_gap
        );
    }
}
