//! `kakeya convert`: GGUF → Hugging Face folder.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use kakeya_weights::Checkpoint;

/// Arguments of `kakeya convert`.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Input GGUF file.
    #[arg(long)]
    pub model: PathBuf,
    /// Output folder (must not exist or be empty).
    #[arg(long)]
    pub out: PathBuf,
    /// A `tokenizer.json` to copy into the folder (default: the one beside the GGUF, if any).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

/// Runs the conversion.
pub fn run(a: ConvertArgs) -> Result<()> {
    let ck = Checkpoint::from_gguf(&a.model)
        .with_context(|| format!("reading {}", a.model.display()))?;
    ck.write_hf_dir(&a.out)?;
    let tok = a
        .tokenizer
        .unwrap_or_else(|| a.model.with_file_name("tokenizer.json"));
    if tok.is_file() {
        let dest = a.out.join("tokenizer.json");
        std::fs::copy(&tok, &dest)
            .with_context(|| format!("copying {} to {}", tok.display(), dest.display()))?;
    }
    eprintln!("wrote {}", a.out.display());
    Ok(())
}
