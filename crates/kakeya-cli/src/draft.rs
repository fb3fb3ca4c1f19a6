//! What drafts the tokens of speculative decoding (`--draft`), and the block schedule
//! (`--block-size` fixes it; otherwise it adapts).

use anyhow::{Result, bail};
use clap::ValueEnum;
use kakeya_models::DFlashDrafter;
use kakeya_runtime::{CombinedProposer, DFlashProposer, NgramProposer, Proposer, SpecConfig};

/// Longest block of the n-gram proposer (1 token + 7 drafts, as the simulation in issue 16).
pub const NGRAM_BLOCK: usize = 8;

/// A proposer kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DraftKind {
    /// The DFlash drafter.
    Dflash,
    /// Prompt lookup: the tokens that followed the latest earlier match of the last 3, 2 or 1
    /// tokens (no drafter needed).
    Ngram,
    /// Prompt lookup when the last 2+ tokens match earlier text, the DFlash drafter otherwise.
    Combined,
}

impl DraftKind {
    /// Whether it drafts with the DFlash drafter.
    pub fn needs_drafter(self) -> bool {
        self != DraftKind::Ngram
    }

    /// Its name in stats.
    pub fn name(self) -> &'static str {
        match self {
            DraftKind::Dflash => "dflash",
            DraftKind::Ngram => "ngram",
            DraftKind::Combined => "combined",
        }
    }
}

/// The proposer of `kind` (`drafter` must be given for the kinds that need one).
pub fn proposer<'d>(
    kind: DraftKind,
    drafter: Option<&'d DFlashDrafter>,
) -> Result<Box<dyn Proposer + 'd>> {
    Ok(match (kind, drafter) {
        (DraftKind::Ngram, _) => Box::new(NgramProposer::default()),
        (DraftKind::Dflash, Some(d)) => Box::new(DFlashProposer::new(d)),
        (DraftKind::Combined, Some(d)) => {
            Box::new(CombinedProposer::new(Box::new(DFlashProposer::new(d))))
        }
        (k, None) => bail!(
            "--draft {} drafts with a DFlash drafter: pass --drafter DIR (or use --draft ngram)",
            k.name()
        ),
    })
}

/// `--block-size B` fixes every block at `B`; without it blocks adapt up to `default`.
pub fn schedule(block_size: Option<usize>, default: usize) -> SpecConfig {
    match block_size {
        Some(b) => SpecConfig::fixed(b),
        None => SpecConfig::adaptive(default),
    }
}
