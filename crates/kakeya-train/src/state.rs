//! Training state on disk: parameters with their Adam moments (f32 safetensors, `param/`,
//! `m/`, `v/` prefixes) and a JSON record, swapped in as one folder; and atomic file writes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::Tensor;
use kakeya_weights::HostTensor;
use kakeya_weights::checkpoint::{
    read_safetensors_as, write_dir_atomically, write_safetensors_f32,
};

use crate::error::{Result, TrainError};
use crate::optim::Moments;

/// Weights file of a state folder.
pub const WEIGHTS_FILE: &str = "weights.safetensors";
/// JSON record of a state folder.
pub const STATE_FILE: &str = "state.json";

fn host(t: &Tensor<2>) -> HostTensor {
    let [r, c] = t.dims();
    HostTensor {
        shape: vec![r, c],
        data: t
            .clone()
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32 data"),
    }
}

/// Writes `dir/state` as a whole: `(name, parameter, moments)` entries and the JSON record.
pub fn save(dir: &Path, entries: &[(&str, &Tensor<2>, &Moments)], json: &str) -> Result<()> {
    let mut tensors = BTreeMap::new();
    for (name, p, mom) in entries {
        for (kind, t) in [("param", *p), ("m", &mom.m), ("v", &mom.v)] {
            tensors.insert(format!("{kind}/{name}"), host(t));
        }
    }
    replace_dir(&dir.join("state"), |tmp| {
        write_safetensors_f32(&tmp.join(WEIGHTS_FILE), &tensors)?;
        let p = tmp.join(STATE_FILE);
        std::fs::write(&p, json).map_err(|e| TrainError::io(&p, e))
    })
}

/// Reads a state folder: its tensors by prefixed name, the JSON record, and both files' paths.
pub fn load(dir: &Path) -> Result<(BTreeMap<String, HostTensor>, String, PathBuf, PathBuf)> {
    let sp = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&sp).map_err(|e| TrainError::io(&sp, e))?;
    let wp = dir.join(WEIGHTS_FILE);
    let mut read = BTreeMap::new();
    read_safetensors_as(&wp, &|n| Some(n.to_string()), &mut read)?;
    Ok((read, text, sp, wp))
}

/// Builds `out` anew with `fill` in a temporary sibling, then swaps it in (the previous
/// content is kept as `<out>.old` until the swap is done).
pub fn replace_dir(out: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let new = out.with_file_name(format!("{name}.new"));
    let old = out.with_file_name(format!("{name}.old"));
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| TrainError::io(parent, e))?;
    }
    if new.exists() {
        std::fs::remove_dir_all(&new).map_err(|e| TrainError::io(&new, e))?;
    }
    let mut err = None;
    write_dir_atomically(&new, |dir| {
        fill(dir).map_err(|e| {
            let msg = e.to_string();
            err = Some(e);
            kakeya_weights::WeightsError::format(dir, msg)
        })
    })
    .map_err(|e| err.take().unwrap_or(TrainError::Weights(e)))?;
    if out.exists() {
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(|e| TrainError::io(&old, e))?;
        }
        std::fs::rename(out, &old).map_err(|e| TrainError::io(out, e))?;
    }
    std::fs::rename(&new, out).map_err(|e| TrainError::io(out, e))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| TrainError::io(&old, e))?;
    }
    Ok(())
}

/// Writes `path` atomically ([`kakeya_weights::fsio::write_file`]).
pub fn write_file_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    kakeya_weights::fsio::write_file(path, bytes).map_err(|e| TrainError::io(path, e))
}
