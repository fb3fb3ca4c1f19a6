//! Writes the tiny random model the server tests serve, and its drafter (`<out>/m`, `<out>/d`):
//! a model whose forwards cost almost nothing, for measuring `kakeya serve`'s own cost per
//! token (`docs/benchmarks.md`).
//!
//! `cargo run --release -p kakeya-cli --example tiny_served_model -- <out>`

use std::path::PathBuf;

use anyhow::Result;
use kakeya_models::testing::write_tiny_served_model;

fn main() -> Result<()> {
    let Some(out) = std::env::args().nth(1) else {
        anyhow::bail!("usage: tiny_served_model <out>");
    };
    let (m, d) = write_tiny_served_model(&PathBuf::from(&out))?;
    eprintln!(
        "wrote the model {} and the drafter {}",
        m.display(),
        d.display()
    );
    Ok(())
}
