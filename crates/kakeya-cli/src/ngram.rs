//! `kakeya ngram build`: the static n-gram table behind `--draft ngram` and `combined`,
//! counted over capture datasets' token ids (the verifier's own greedy continuations and
//! their prompts), as llama.cpp's `llama-lookup-create` builds its static lookup cache.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use kakeya_capture::{Dataset, Query};
use kakeya_runtime::{DraftKind, NgramTable};

use crate::common::ModelArgs;

/// The default model's table (`docs/train-drafter.md` says how it was built).
pub const DEFAULT_NGRAM_TABLE: &str = "checkpoints/ngram-gemma3-270m.bin";

/// `kakeya ngram ...`.
#[derive(Args, Debug)]
pub struct NgramArgs {
    #[command(subcommand)]
    command: NgramCommand,
}

#[derive(Subcommand, Debug)]
enum NgramCommand {
    /// Count a table over capture datasets and write it.
    Build(BuildArgs),
}

/// `kakeya ngram build`.
#[derive(Args, Debug)]
struct BuildArgs {
    /// Capture dataset folders (`kakeya capture`) whose sequences are counted; all must come
    /// from the same verifier.
    #[arg(long = "data", required = true)]
    data: Vec<PathBuf>,
    /// The table file to write.
    #[arg(long)]
    out: PathBuf,
    /// Longest context, in tokens.
    #[arg(long, default_value_t = 6)]
    order: usize,
    /// Leave out every N-th sequence of each dataset (ids N−1, 2N−1, …; 0: none), as
    /// `kakeya train drafter`'s `heldout_every` does, so that its held-out prompts stay held
    /// out from the table too.
    #[arg(long, default_value_t = 0)]
    heldout_every: usize,
}

/// Runs `kakeya ngram`.
pub fn run(a: NgramArgs) -> Result<()> {
    match a.command {
        NgramCommand::Build(b) => build(b),
    }
}

fn build(a: BuildArgs) -> Result<()> {
    let mut seqs: Vec<Vec<u32>> = Vec::new();
    let mut source: Option<(String, u32)> = None;
    for dir in &a.data {
        let ds = Dataset::open(dir).with_context(|| format!("opening {}", dir.display()))?;
        let m = ds.manifest();
        let vocab = m
            .dims
            .get("vocab")
            .and_then(|v| v.as_u64())
            .and_then(|v| u32::try_from(v).ok())
            .with_context(|| format!("{}: the manifest gives no vocabulary size", dir.display()))?;
        let this = (m.verifier.sha256.clone(), vocab);
        match &source {
            Some(s) if *s != this => bail!(
                "{} comes from verifier {} (vocabulary {}), the first dataset from {} ({}): count one model's data",
                dir.display(),
                this.0,
                this.1,
                s.0,
                s.1
            ),
            _ => source = Some(this),
        }
        for b in ds.read(&Query::default())? {
            let b = b?;
            if !kakeya_capture::held_out(b.seq, a.heldout_every) {
                seqs.push(b.token);
            }
        }
    }
    let (sha, vocab) = source.expect("clap requires one --data");
    let table = NgramTable::build(
        seqs.iter().map(|s| s.as_slice()),
        a.order,
        vocab,
        sha_bytes(&sha),
    )
    .with_context(|| format!("counting {} sequences", seqs.len()))?;
    table.save(&a.out)?;
    let tokens: usize = seqs.iter().map(Vec::len).sum();
    eprintln!(
        "kakeya ngram: {} sequences, {tokens} tokens → {} contexts (order ≤ {}) in {}",
        seqs.len(),
        table.len(),
        a.order,
        a.out.display()
    );
    Ok(())
}

/// A hex SHA-256 as bytes (zeros when it is not one).
fn sha_bytes(hex: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    if hex.len() == 64 {
        for (i, o) in out.iter_mut().enumerate() {
            match u8::from_str_radix(&hex[2 * i..2 * i + 2], 16) {
                Ok(b) => *o = b,
                Err(_) => return [0; 32],
            }
        }
    }
    out
}

/// `--ngram-table` / `--no-ngram-table`.
#[derive(Args, Debug, Clone, Default)]
pub struct TableArgs {
    /// A static n-gram table (`kakeya ngram build`): `--draft ngram` and `combined` draft from
    /// it where the sequence has no earlier match of its tail. Default: the default model's
    /// table, when present.
    #[arg(long, conflicts_with = "no_ngram_table")]
    pub ngram_table: Option<PathBuf>,
    /// Draft without a static n-gram table.
    #[arg(long)]
    pub no_ngram_table: bool,
}

impl TableArgs {
    /// The table a run drafting with `kind` uses: `--ngram-table`, or the default model's,
    /// checked against the model's vocabulary; none for a kind that does not look up.
    pub fn load(
        &self,
        model: &ModelArgs,
        vocab: usize,
        kind: DraftKind,
    ) -> Result<Option<Arc<NgramTable>>> {
        if !kind.looks_up() {
            return Ok(None);
        }
        let path = match &self.ngram_table {
            Some(p) => p.clone(),
            None if self.no_ngram_table || !model.uses_default_model() => return Ok(None),
            None => {
                let p = PathBuf::from(DEFAULT_NGRAM_TABLE);
                if !p.is_file() {
                    return Ok(None);
                }
                p
            }
        };
        load(&path, vocab).map(|t| Some(Arc::new(t)))
    }
}

fn load(path: &Path, vocab: usize) -> Result<NgramTable> {
    let t = NgramTable::load(path)?;
    if t.vocab() as usize != vocab {
        bail!(
            "n-gram table {} was counted over a vocabulary of {} tokens; this model has {vocab}",
            path.display(),
            t.vocab()
        );
    }
    tracing::info!("n-gram table {}: {} contexts", path.display(), t.len());
    Ok(t)
}
