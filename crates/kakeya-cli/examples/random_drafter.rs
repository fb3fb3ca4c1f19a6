//! Writes a random-weight DFlash drafter folder that fits a verifier (for engine tests and
//! overhead measurements; its drafts are almost never accepted).
//!
//! `cargo run --release -p kakeya-cli --example random_drafter -- <verifier.gguf|dir> <out> [layers] [block] [draft_vocab]`

use std::path::PathBuf;

use anyhow::{Context, Result};
use kakeya_models::testing::{drafter_config, random_drafter};
use kakeya_weights::Checkpoint;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, out, rest @ ..] = &args[..] else {
        anyhow::bail!("usage: random_drafter <verifier> <out> [layers] [block] [draft_vocab]");
    };
    let num = |i: usize, default: usize| -> Result<usize> {
        rest.get(i)
            .map_or(Ok(default), |s| s.parse().context("not a number"))
    };
    let ck = Checkpoint::load(PathBuf::from(model))?;
    let mut c = drafter_config(&ck.config, num(0, 1)?, num(1, 16)?);
    let vocab = num(2, 0)?;
    if vocab > 0 {
        c.draft_vocab_size = Some(vocab);
    }
    random_drafter(&c, 1).write_dir(&PathBuf::from(out))?;
    eprintln!("wrote {out}: {c:?}");
    Ok(())
}
