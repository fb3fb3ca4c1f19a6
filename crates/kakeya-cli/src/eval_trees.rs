//! `kakeya eval trees`: how many tokens a verify would commit if it checked a tree of drafts
//! instead of one chain, at each row budget, on the model's own greedy outputs. Greedy
//! verification accepts the deepest tree node on the path of the verifier's tokens, so with
//! the AR output known the count is exact without running tree verification: the probe rides
//! on chain decoding (fixed blocks), and at each block builds, from the same evidence, the
//! chain the engine drafts and the trees, and counts what each would commit.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use kakeya_models::{DFlashDrafter, DraftRequest};
use kakeya_runtime::kv::CompactStore;
use kakeya_runtime::spec::DraftSource;
use kakeya_runtime::spec::tree::{DraftTree, EdgeCalibration, EdgeSource, LOOKUP_OCCURRENCES};
use kakeya_runtime::{
    DraftKind, GenerationConfig, KvSetup, NgramProposer, NgramTable, Proposer, Session, SpecConfig,
    Verifier, generate, speculative_generate,
};
use serde::Serialize;

use crate::common::{ModelArgs, drafter_dir, load_drafter};
use crate::ngram::TableArgs;

/// Arguments of `kakeya eval trees`.
#[derive(Args, Debug)]
pub struct TreesArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// DFlash drafter folder (default: the default model's drafter).
    #[arg(long)]
    pub drafter: Option<PathBuf>,
    #[command(flatten)]
    pub table: TableArgs,
    /// Prompts, one per line (default: `kakeya bench`'s 20 built-in prompts).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// New tokens per prompt (greedy).
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Row budgets of one verify (the last committed token's row included), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,8,12,16,24,32")]
    pub budgets: Vec<usize>,
    /// Candidates per drafted position taken from the drafter's distribution.
    #[arg(long, default_value_t = 4)]
    pub top_k: usize,
    /// Block of the chain decoding the probe rides on.
    #[arg(long, default_value_t = 8)]
    pub block_size: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// What one kind of draft would commit per verify at one budget.
#[derive(Debug, Default, Clone, Serialize)]
struct Committed {
    /// Tokens committed (drafts accepted + the verifier's own), summed over blocks.
    tokens: usize,
    /// Rows verified (root included), summed over blocks.
    rows: usize,
}

/// The figures of one row budget.
#[derive(Debug, Default, Clone, Serialize)]
struct BudgetFigures {
    rows: usize,
    blocks: usize,
    /// The engine's chain (lookup, else table, else the drafter's top-1), `rows − 1` drafts.
    chain: Committed,
    /// A tree from every source: the engine's chain, every earlier occurrence of the tail,
    /// the table's chain and the drafter's top-k per position, merged.
    tree: Committed,
    /// What the best choice of rows from that tree's candidates (every node the sources
    /// offered, before the cut) would commit: the ceiling of those candidates.
    candidates_ceiling: Committed,
    /// The drafter's top-1 chain.
    drafter_chain: Committed,
    /// A tree from the drafter's top-k per position alone.
    drafter_tree: Committed,
}

/// A proposer that drafts as the engine's chain proposer does and, before each block,
/// measures what chains and trees of each budget would have committed there.
struct TreeProbe<'a> {
    chain: Box<dyn Proposer + 'a>,
    drafter: &'a DFlashDrafter,
    lookups: NgramProposer,
    table: Option<std::sync::Arc<NgramTable>>,
    /// The AR output, prompt included, by position.
    truth: Vec<u32>,
    top_k: usize,
    /// Per budget: figures, and the calibrations of the two trees (each learns only from
    /// what a verify of its own tree would show).
    budgets: Vec<(BudgetFigures, EdgeCalibration, EdgeCalibration)>,
}

impl TreeProbe<'_> {
    /// The drafter's top-k tokens and probabilities at each drafted position of one block.
    fn drafter_candidates(
        &self,
        last: u32,
        store: &mut CompactStore,
    ) -> Result<Vec<Vec<(u32, f32)>>> {
        let d = self.drafter;
        let mut block = vec![d.config.mask_token_id; d.block_size()];
        block[0] = last;
        let out = d.forward(
            &DraftRequest {
                context: None,
                block: &block,
                capture_context: false,
            },
            store,
        )?;
        let [b, h] = out.hidden.dims();
        let logits = d.logits(out.hidden.slice([1..b, 0..h]));
        let [rows, vocab] = logits.dims();
        let data = logits
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| anyhow::anyhow!("drafter logits: {e:?}"))?;
        Ok((0..rows)
            .map(|r| top_k_probs(&data[r * vocab..(r + 1) * vocab], self.top_k))
            .map(|c| c.into_iter().map(|(id, p)| (d.to_target(id), p)).collect())
            .collect())
    }

    fn probe(&mut self, tokens: &[u32], store: &mut CompactStore) -> Result<()> {
        let pos = tokens.len() - 1;
        if self.truth.get(..=pos) != Some(tokens) {
            bail!("the speculative output left the AR output at position {pos}");
        }
        let truth = self.truth[pos + 1..].to_vec();
        if truth.is_empty() {
            return Ok(());
        }
        let last = tokens[pos];
        let candidates = self.drafter_candidates(last, store)?;
        let top1: Vec<u32> = candidates
            .iter()
            .filter_map(|c| Some(c.first()?.0))
            .collect();
        let deepest = self.budgets.iter().map(|b| b.0.rows).max().unwrap_or(1);
        let lookup_nexts = self
            .lookups
            .all_matches(tokens, LOOKUP_OCCURRENCES)
            .map_or_else(Vec::new, |m| m.1);
        let lookup_chain = self
            .lookups
            .find(tokens)
            .map(|m| NgramProposer::following_from(tokens, m.next, deepest));
        let table_chain = self
            .table
            .as_ref()
            .map(|t| t.draft(tokens, deepest).1)
            .unwrap_or_default();
        let (chain_full, chain_source) = match (&lookup_chain, table_chain.is_empty()) {
            (Some(l), _) => (l.clone(), self.lookups.source(tokens)),
            (None, false) => (table_chain.clone(), self.lookups.source(tokens)),
            (None, true) => (top1.clone(), DraftSource::Model),
        };
        let commit = |accepted: usize, rows: usize| Committed {
            tokens: (accepted + 1).min(truth.len()),
            rows,
        };
        for (fig, calib, drafter_calib) in &mut self.budgets {
            let rows = fig.rows;
            let chain = &chain_full[..chain_full.len().min(rows - 1)];
            let a = kakeya_models::dflash::accepted_drafts(chain, &truth);
            add(&mut fig.chain, commit(a, chain.len() + 1));

            let d = &top1[..top1.len().min(rows - 1)];
            let a = kakeya_models::dflash::accepted_drafts(d, &truth);
            add(&mut fig.drafter_chain, commit(a, d.len() + 1));

            let mut all = DraftTree::new(last);
            all.add_path(chain, EdgeSource::Chain(chain_source), 1.0, calib);
            all.add_lookups(tokens, &lookup_nexts, rows - 1, calib);
            if !table_chain.is_empty() {
                let t = &table_chain[..table_chain.len().min(rows - 1)];
                all.add_path(t, EdgeSource::Table, 1.0, calib);
            }
            all.grow(&candidates, EdgeSource::Drafter, 4 * rows, calib);
            // The cheapest rows reaching as deep: the accepted path itself.
            let reach = all.accepted(&truth).min(rows - 1);
            add(&mut fig.candidates_ceiling, commit(reach, reach + 1));
            let tree = all.best_first(rows);
            add(&mut fig.tree, commit(tree.accepted(&truth), tree.len()));
            calib.observe(&tree, &truth);

            let mut only = DraftTree::new(last);
            only.grow(&candidates, EdgeSource::Drafter, 4 * rows, drafter_calib);
            let tree = only.best_first(rows);
            add(
                &mut fig.drafter_tree,
                commit(tree.accepted(&truth), tree.len()),
            );
            drafter_calib.observe(&tree, &truth);
            fig.blocks += 1;
        }
        Ok(())
    }
}

fn add(sum: &mut Committed, c: Committed) {
    sum.tokens += c.tokens;
    sum.rows += c.rows;
}

/// The `k` largest softmax probabilities of `logits` with their indices, largest first (ties:
/// the lower index).
fn top_k_probs(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(k - 1, |&a, &b| {
        logits[b].total_cmp(&logits[a]).then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    idx.into_iter()
        .map(|i| (i, (logits[i] - max).exp() / sum))
        .collect()
}

impl Proposer for TreeProbe<'_> {
    fn propose(
        &mut self,
        tokens: &[u32],
        n: usize,
        mut store: Option<&mut CompactStore>,
    ) -> kakeya_runtime::Result<Vec<u32>> {
        if let Some(s) = store.as_deref_mut() {
            self.probe(tokens, s)
                .map_err(|e| kakeya_runtime::RuntimeError::Input(format!("{e:#}")))?;
        }
        self.chain.propose(tokens, n, store)
    }

    fn drafter(&self) -> Option<&DFlashDrafter> {
        Some(self.drafter)
    }
}

/// The report.
#[derive(Debug, Serialize)]
struct TreesReport {
    prompts: usize,
    gen_tokens: usize,
    top_k: usize,
    block_size: usize,
    /// Verifies of the chain decoding the probe rode on (fixed blocks), and the tokens they
    /// committed: a block the engine runs without asking for drafts (the last token of a
    /// request) is not probed.
    engine_blocks: usize,
    engine_tokens: usize,
    engine_tokens_per_verify: f64,
    budgets: Vec<BudgetFigures>,
}

/// Runs `kakeya eval trees`.
pub fn run(a: TreesArgs) -> Result<()> {
    if a.budgets.is_empty() || a.budgets.contains(&0) {
        bail!("--budgets: each budget must be at least 1 row");
    }
    if a.block_size < 2 {
        bail!("--block-size must be at least 2");
    }
    let (model, tok) = a.model.load()?;
    let Some(dir) = drafter_dir(a.drafter.as_ref(), true, &a.model, false) else {
        bail!("eval trees needs a DFlash drafter: pass --drafter DIR");
    };
    let drafter = load_drafter(&dir, &model)?;
    let table = a
        .table
        .load(&a.model, model.config.vocab_size, DraftKind::Combined)?;
    let prompts = crate::bench_spec::prompts_or_default(a.prompts.as_deref())?;
    let mut budgets: Vec<usize> = a.budgets.clone();
    budgets.sort_unstable();
    budgets.dedup();
    let cfg = GenerationConfig::greedy(a.gen_tokens, 512);
    let spec = SpecConfig::fixed(a.block_size);
    let bar = indicatif::ProgressBar::new(prompts.len() as u64);
    let mut figures: BTreeMap<usize, BudgetFigures> = BTreeMap::new();
    let (mut blocks, mut committed) = (0usize, 0usize);
    for text in &prompts {
        let mut ids = vec![tok.bos];
        ids.extend(tok.encode(text)?);
        let ar = generate(
            &mut Session::with_kv(&model, KvSetup::full(0))?,
            &ids,
            &cfg,
            &mut |_| {},
        )?;
        let mut probe = TreeProbe {
            chain: DraftKind::Combined.proposer(Some(&drafter), table.clone())?,
            drafter: &drafter,
            lookups: NgramProposer::with_table(table.clone()),
            table: table.clone(),
            truth: ids.iter().chain(&ar.tokens).copied().collect(),
            top_k: a.top_k,
            budgets: budgets
                .iter()
                .map(|&rows| {
                    let fig = BudgetFigures {
                        rows,
                        ..Default::default()
                    };
                    (fig, EdgeCalibration::default(), EdgeCalibration::default())
                })
                .collect(),
        };
        let mut verifier = Verifier::new(&model, KvSetup::full(0).drafter(&drafter), a.block_size)?;
        let sp = speculative_generate(&mut verifier, &mut probe, &ids, &cfg, spec, &mut |_| {})
            .with_context(|| format!("prompt {text:?}"))?;
        if sp.tokens != ar.tokens {
            bail!("speculative decoding left AR's output on prompt {text:?}");
        }
        let st = sp.spec.as_ref().context("speculative stats")?;
        blocks += st.blocks;
        committed += st.blocks + st.accepted;
        for (fig, _, _) in probe.budgets {
            let sum = figures.entry(fig.rows).or_insert_with(|| BudgetFigures {
                rows: fig.rows,
                ..Default::default()
            });
            sum.blocks += fig.blocks;
            add(&mut sum.chain, fig.chain);
            add(&mut sum.tree, fig.tree);
            add(&mut sum.candidates_ceiling, fig.candidates_ceiling);
            add(&mut sum.drafter_chain, fig.drafter_chain);
            add(&mut sum.drafter_tree, fig.drafter_tree);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let report = TreesReport {
        prompts: prompts.len(),
        gen_tokens: a.gen_tokens,
        top_k: a.top_k,
        block_size: a.block_size,
        engine_blocks: blocks,
        engine_tokens: committed,
        engine_tokens_per_verify: committed as f64 / blocks.max(1) as f64,
        budgets: figures.into_values().collect(),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print(&report);
    }
    Ok(())
}

fn print(r: &TreesReport) {
    println!(
        "{} prompts, {} tokens each; the chain decoding probed (block {}) committed {:.2} tokens per verify",
        r.prompts, r.gen_tokens, r.block_size, r.engine_tokens_per_verify
    );
    println!(
        "| rows | blocks | chain: tokens per verify (rows) | tree, every source | ceiling of its candidates | drafter chain | tree, drafter top-{} only |",
        r.top_k
    );
    println!("|---|---|---|---|---|---|---|");
    let per = |c: &Committed, blocks: usize| {
        let b = blocks.max(1) as f64;
        format!("{:.2} ({:.1})", c.tokens as f64 / b, c.rows as f64 / b)
    };
    for f in &r.budgets {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            f.rows,
            f.blocks,
            per(&f.chain, f.blocks),
            per(&f.tree, f.blocks),
            per(&f.candidates_ceiling, f.blocks),
            per(&f.drafter_chain, f.blocks),
            per(&f.drafter_tree, f.blocks)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::top_k_probs;

    #[test]
    fn top_k_probs_are_the_softmax_of_the_largest_logits_in_order() {
        let p = top_k_probs(&[0.0, 2.0, 1.0, 2.0], 3);
        let ids: Vec<usize> = p.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        let z = 1.0 + 2.0 * 2f32.exp() + 1f32.exp();
        assert!((p[0].1 - 2f32.exp() / z).abs() < 1e-6);
        assert!((p[2].1 - 1f32.exp() / z).abs() < 1e-6);
        assert!(top_k_probs(&[1.0], 0).is_empty());
        assert_eq!(top_k_probs(&[1.0, 3.0], 5).len(), 2);
    }
}
