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
use kakeya_models::DFlashDrafter;
use kakeya_runtime::kv::CompactStore;
use kakeya_runtime::speculative::tree::{DraftTree, EdgeCalibration, EdgeSource};
use kakeya_runtime::{
    DraftKind, GenerationConfig, KvSetup, Proposer, Session, SpecConfig, TreeDrafts, Verifier,
    generate, speculative_generate,
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
    /// Every source of a tree, the drafter always run.
    sources: TreeDrafts<'a>,
    /// The AR output, prompt included, by position.
    truth: Vec<u32>,
    /// Per budget: figures, and the calibrations of the two trees (each learns only from
    /// what a verify of its own tree would show).
    budgets: Vec<(BudgetFigures, EdgeCalibration, EdgeCalibration)>,
}

impl TreeProbe<'_> {
    fn probe(&mut self, tokens: &[u32], store: &mut CompactStore) -> Result<()> {
        let pos = tokens.len() - 1;
        if self.truth.get(..=pos) != Some(tokens) {
            bail!("the speculative output left the AR output at position {pos}");
        }
        let truth = self.truth[pos + 1..].to_vec();
        if truth.is_empty() {
            return Ok(());
        }
        let deepest = self.budgets.iter().map(|b| b.0.rows).max().unwrap_or(1);
        let evidence = self.sources.evidence(tokens, deepest, Some(store))?;
        let top1: Vec<u32> = evidence
            .candidates
            .iter()
            .filter_map(|c| Some(c.first()?.0))
            .collect();
        let chain_full = &evidence.chain.0;
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

            let all = evidence.candidates(tokens, rows, calib);
            // The cheapest rows reaching as deep: the accepted path itself.
            let reach = all.accepted(&truth).min(rows - 1);
            add(&mut fig.candidates_ceiling, commit(reach, reach + 1));
            let tree = all.best_first(rows);
            add(&mut fig.tree, commit(tree.accepted(&truth), tree.len()));
            calib.observe(&tree, &truth);

            let mut only = DraftTree::new(evidence.last);
            only.grow(
                &evidence.candidates,
                EdgeSource::Drafter,
                4 * rows,
                drafter_calib,
            );
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
        self.sources.drafter()
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
            sources: TreeDrafts::new(Some(&drafter), table.clone(), a.top_k),
            truth: ids.iter().chain(&ar.tokens).copied().collect(),
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
