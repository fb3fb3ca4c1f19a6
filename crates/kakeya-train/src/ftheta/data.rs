//! f_θ training data, streamed from a capture dataset one sequence at a time: the drafter's
//! per-layer context K/V (the input) and, per verifier layer, raw K/V (and raw Q + the
//! attention output for the attention losses).

use std::path::PathBuf;

use kakeya_capture::config::VerifierTensor;
use kakeya_capture::schema::{drafter_column, verifier_column};
use kakeya_capture::{Dataset, Query};

use crate::error::{Result, TrainError};

/// What the dataset holds and where each needed column is.
#[derive(Debug, Clone)]
pub struct DataInfo {
    /// The dataset folder.
    pub dir: PathBuf,
    /// Drafter layers (input order).
    pub drafter_layers: Vec<usize>,
    /// Per drafter layer KV width.
    pub drafter_kv_dim: usize,
    /// Verifier layers.
    pub layers: usize,
    /// Each verifier layer's raw K (and V) width.
    pub kv_dims: Vec<usize>,
    /// Whether Q_raw and the attention output are read.
    pub attention: bool,
    /// Training sequence ids.
    pub train: Vec<usize>,
    /// Held-out sequence ids.
    pub heldout: Vec<usize>,
    /// Verifier and drafter content hashes and paths, from the manifest.
    pub verifier: (PathBuf, String),
    /// See `verifier`.
    pub drafter: (PathBuf, String),
}

/// One sequence in host memory (row-major f32).
#[derive(Debug, Clone)]
pub struct SeqData {
    /// Sequence id.
    pub seq: usize,
    /// Positions.
    pub len: usize,
    /// Drafter K of every drafter layer, `[len, drafter_layers · drafter_kv_dim]`.
    pub dk: Vec<f32>,
    /// Drafter V, same layout.
    pub dv: Vec<f32>,
    /// Per verifier layer.
    pub layers: Vec<LayerData>,
    /// Non-finite values met (f16 overflow), saturated to ±65504.
    pub saturated: usize,
}

/// One verifier layer of a sequence.
#[derive(Debug, Clone, Default)]
pub struct LayerData {
    /// Raw queries, `[len, heads · head_dim]` (empty without attention).
    pub q: Vec<f32>,
    /// Raw keys, `[len, kv_dim]` (the layer's own width).
    pub k: Vec<f32>,
    /// Raw values, `[len, kv_dim]`.
    pub v: Vec<f32>,
    /// Attention output, `[len, hidden]` (empty without attention).
    pub o: Vec<f32>,
}

const F16_MAX: f32 = 65504.0;

/// Row `r` of the result is row `r` of every part, in order (parts may differ in width).
///
/// # Shapes
/// - `parts`: part `i` `[rows, width_i]` → `[rows, Σ width_i]` (row-major)
pub(crate) fn side_by_side<P: AsRef<[f32]>>(parts: &[P], rows: usize) -> Vec<f32> {
    let widths: Vec<usize> = parts
        .iter()
        .map(|p| p.as_ref().len() / rows.max(1))
        .collect();
    let mut out = Vec::with_capacity(rows * widths.iter().sum::<usize>());
    for r in 0..rows {
        for (p, &w) in parts.iter().zip(&widths) {
            out.extend_from_slice(&p.as_ref()[r * w..(r + 1) * w]);
        }
    }
    out
}

fn short(s: &str) -> &str {
    &s[..s.len().min(12)]
}

/// Checks that the manifest `m` lists every column the loss reads: the drafter's K/V, each
/// verifier layer's raw K/V, and with `attention` its raw queries and attention outputs.
fn check_columns(
    dir: &std::path::Path,
    m: &kakeya_capture::Manifest,
    layers: usize,
    attention: bool,
) -> Result<()> {
    let mut need: Vec<String> = Vec::new();
    for &l in &m.drafter_layers {
        need.push(drafter_column(l, true));
        need.push(drafter_column(l, false));
    }
    for l in 0..layers {
        need.push(verifier_column(l, VerifierTensor::KRaw));
        need.push(verifier_column(l, VerifierTensor::VRaw));
        if attention {
            need.push(verifier_column(l, VerifierTensor::QRaw));
            need.push(verifier_column(l, VerifierTensor::AttnOut));
        }
    }
    let missing: Vec<&String> = need
        .iter()
        .filter(|n| !m.columns.iter().any(|c| &c.name == *n))
        .collect();
    if !missing.is_empty() {
        let shown: Vec<&String> = missing.iter().copied().take(6).collect();
        return Err(TrainError::invalid(
            dir,
            format!(
                "the dataset lacks {} column(s) the loss needs ({shown:?}{}); recapture with tensors.verifier = [{}], verifier_layers = \"all\"",
                missing.len(),
                if missing.len() > shown.len() {
                    ", …"
                } else {
                    ""
                },
                if attention {
                    "\"q_raw\", \"k_raw\", \"v_raw\", \"attn_out\""
                } else {
                    "\"k_raw\", \"v_raw\""
                }
            ),
        ));
    }
    Ok(())
}

/// Checks, before anything is trained, that the dataset was captured with this verifier and
/// drafter and holds every column the loss needs; then splits its sequences.
pub fn check(
    ds: &Dataset,
    verifier_sha: &str,
    drafter_sha: &str,
    layers: usize,
    attention: bool,
    heldout_every: usize,
) -> Result<DataInfo> {
    let dir = ds.dir().to_path_buf();
    let m = ds.manifest();
    if m.verifier.sha256 != verifier_sha {
        return Err(TrainError::invalid(
            &dir,
            format!(
                "captured with verifier {} (sha256 {}…), not the configured verifier (sha256 {}…); recapture with this verifier",
                m.verifier.path.display(),
                short(&m.verifier.sha256),
                short(verifier_sha)
            ),
        ));
    }
    let Some(d) = &m.drafter else {
        return Err(TrainError::invalid(
            &dir,
            "the dataset has no drafter K/V (f_θ's input); recapture with model.drafter set and tensors.drafter_kv = true",
        ));
    };
    if d.sha256 != drafter_sha {
        return Err(TrainError::invalid(
            &dir,
            format!(
                "captured with drafter {} (sha256 {}…), not the configured drafter (sha256 {}…); recapture with this drafter",
                d.path.display(),
                short(&d.sha256),
                short(drafter_sha)
            ),
        ));
    }
    if m.drafter_layers.is_empty() {
        return Err(TrainError::invalid(
            &dir,
            "the dataset has no drafter K/V columns; recapture with tensors.drafter_kv = true",
        ));
    }
    check_columns(&dir, m, layers, attention)?;
    let dim = |name: &str| {
        m.columns
            .iter()
            .find(|c| c.name == name)
            .map_or(0, |c| c.dim)
    };
    let drafter_kv_dim = dim(&drafter_column(m.drafter_layers[0], true));
    let kv_dims = (0..layers)
        .map(|l| dim(&verifier_column(l, VerifierTensor::KRaw)))
        .collect();
    let mut done: Vec<usize> = m
        .shards
        .iter()
        .flat_map(|s| s.sequences.iter().copied())
        .collect();
    done.sort_unstable();
    let (heldout, train): (Vec<usize>, Vec<usize>) = done
        .into_iter()
        .partition(|&i| kakeya_capture::held_out(i, heldout_every));
    if train.is_empty() || heldout.is_empty() {
        return Err(TrainError::invalid(
            &dir,
            format!(
                "{} training and {} held-out sequences (every {heldout_every}th is held out): need at least one of each",
                train.len(),
                heldout.len()
            ),
        ));
    }
    Ok(DataInfo {
        dir,
        drafter_layers: m.drafter_layers.clone(),
        drafter_kv_dim,
        layers,
        kv_dims,
        attention,
        train,
        heldout,
        verifier: (m.verifier.path.clone(), m.verifier.sha256.clone()),
        drafter: (d.path.clone(), d.sha256.clone()),
    })
}

impl DataInfo {
    fn columns(&self) -> Vec<String> {
        let mut c = Vec::new();
        for &l in &self.drafter_layers {
            c.push(drafter_column(l, true));
        }
        for &l in &self.drafter_layers {
            c.push(drafter_column(l, false));
        }
        for l in 0..self.layers {
            c.push(verifier_column(l, VerifierTensor::KRaw));
            c.push(verifier_column(l, VerifierTensor::VRaw));
            if self.attention {
                c.push(verifier_column(l, VerifierTensor::QRaw));
                c.push(verifier_column(l, VerifierTensor::AttnOut));
            }
        }
        c
    }

    /// Reads one sequence (only the needed columns, only its row group).
    pub fn read(&self, ds: &Dataset, seq: usize) -> Result<SeqData> {
        let q = Query {
            sequences: Some(seq..seq + 1),
            positions: None,
            columns: self.columns(),
        };
        let batch = ds.read(&q)?.next().ok_or_else(|| {
            TrainError::invalid(&self.dir, format!("sequence {seq} is missing"))
        })??;
        let len = batch.pos.len();
        let mut cols = batch.columns.into_iter().map(|(_, _, v)| v);
        let mut saturated = 0;
        let mut next = |cols: &mut dyn Iterator<Item = Vec<f32>>| -> Vec<f32> {
            let mut v = cols.next().expect("one vector per asked column");
            for x in &mut v {
                if !x.is_finite() {
                    saturated += 1;
                    *x = if x.is_nan() {
                        0.0
                    } else {
                        x.signum() * F16_MAX
                    };
                }
            }
            v
        };
        let nd = self.drafter_layers.len();
        let dks: Vec<Vec<f32>> = (0..nd).map(|_| next(&mut cols)).collect();
        let dvs: Vec<Vec<f32>> = (0..nd).map(|_| next(&mut cols)).collect();
        let dk = side_by_side(&dks, len);
        let dv = side_by_side(&dvs, len);
        let mut layers = Vec::with_capacity(self.layers);
        for _ in 0..self.layers {
            let k = next(&mut cols);
            let v = next(&mut cols);
            let (q, o) = if self.attention {
                (next(&mut cols), next(&mut cols))
            } else {
                (Vec::new(), Vec::new())
            };
            layers.push(LayerData { q, k, v, o });
        }
        Ok(SeqData {
            seq,
            len,
            dk,
            dv,
            layers,
            saturated,
        })
    }
}
