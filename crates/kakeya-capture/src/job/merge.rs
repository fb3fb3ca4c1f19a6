//! `kakeya capture --merge`: the datasets of `--shard i/n` runs of one job, as one.

use std::path::{Path, PathBuf};

use super::*;

/// Merges datasets made by `--shard i/n` runs of one config into `out` (files copied; the
/// manifests must have equal fingerprints).
pub fn merge(out: &Path, inputs: &[PathBuf]) -> Result<Manifest> {
    let mut merged: Option<Manifest> = None;
    std::fs::create_dir_all(out).map_err(|e| CaptureError::io(out, e))?;
    for dir in inputs {
        let m = read_manifest(dir)?;
        if let Some(acc) = &merged
            && acc.fingerprint() != m.fingerprint()
        {
            return Err(CaptureError::dataset(
                dir.join("manifest.json"),
                "was made with a different config or models than the first input",
            ));
        }
        for s in &m.shards {
            let (from, to) = (dir.join(&s.file), out.join(&s.file));
            kakeya_weights::fsio::copy_file(&from, &to).map_err(|e| CaptureError::io(&to, e))?;
        }
        let acc = merged.get_or_insert_with(|| Manifest {
            shards: Vec::new(),
            ..m.clone()
        });
        for s in m.shards {
            if !acc.shards.iter().any(|x| x.index == s.index) {
                acc.shards.push(s);
            }
        }
    }
    let mut m = merged.ok_or_else(|| CaptureError::dataset(out, "nothing to merge"))?;
    m.shards.sort_by_key(|s| s.index);
    write_manifest(out, &m)?;
    Ok(m)
}
