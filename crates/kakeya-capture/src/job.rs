//! A capture job: resolve the config against the models, then write shards (temp name →
//! footer → rename), updating `manifest.json` after each finished shard. A killed job resumes
//! at the first unfinished shard; `shard i/n` runs the shards with `index % n == i`.

use std::fs::File;
use std::io::{BufWriter, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use arrow::array::{
    ArrayRef, BooleanArray, FixedSizeListArray, Float16Array, Float32Array, UInt32Array,
};
use arrow::datatypes::{DataType, Field};
use arrow::record_batch::RecordBatch;
use half::f16;
use kakeya_models::{DFlashDrafter, GemmaModel};
use kakeya_weights::Tokenizer;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use sha2::{Digest, Sha256};

use crate::capture::{Selection, SequenceCapture, capture_tokens, continuations, sample_positions};
use crate::config::{CaptureConfig, Dtype, LayerSet};
use crate::error::{CaptureError, Result};
use crate::prompts::{Prompt, load_sources};
use crate::reuse::Continuations;
use crate::schema::{
    ColumnInfo, Manifest, ModelInfo, SCHEMA_VERSION, SequenceInfo, ShardInfo, aux_column,
    drafter_column, verifier_column,
};

mod merge;

pub use merge::merge;

/// How this process takes part in the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunOptions {
    /// `(i, n)`: run shards with `index % n == i`.
    pub shard: (usize, usize),
    /// Continue an existing dataset (skip finished shards).
    pub resume: bool,
}

/// Progress events for a front end (the library itself only logs).
#[derive(Debug, Clone, PartialEq)]
pub enum Progress {
    /// Work to do: sequences this process will capture.
    Start {
        /// Sequences to capture.
        sequences: usize,
    },
    /// One sequence captured and written.
    Sequence {
        /// Positions written (rows).
        rows: usize,
        /// Tokens the sequence has.
        tokens: usize,
    },
    /// A shard finished (renamed into place, listed in the manifest).
    Shard {
        /// Index.
        index: usize,
        /// File size.
        bytes: u64,
    },
}

/// Figures of a finished run.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Sequences captured by this run.
    pub sequences: usize,
    /// Rows (positions) written by this run.
    pub rows: usize,
    /// Bytes of shards written by this run.
    pub bytes: u64,
    /// Shards written by this run.
    pub shards: usize,
    /// Shards skipped as already finished.
    pub skipped_shards: usize,
    /// Wall seconds.
    pub secs: f64,
}

/// The models a job runs.
pub struct Models<'a> {
    /// Verifier.
    pub verifier: &'a GemmaModel,
    /// Its tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// The drafter, when its K/V are captured.
    pub drafter: Option<&'a DFlashDrafter>,
    /// Identity of the verifier file(s).
    pub verifier_info: ModelInfo,
    /// Identity of the tokenizer file.
    pub tokenizer_info: ModelInfo,
    /// Identity of the drafter folder.
    pub drafter_info: Option<ModelInfo>,
}

/// SHA-256 of a file, or of a folder's regular files in name order (names included).
pub fn sha256_path(path: &Path) -> Result<String> {
    let mut h = Sha256::new();
    let mut files = Vec::new();
    if path.is_dir() {
        let rd = std::fs::read_dir(path).map_err(|e| CaptureError::io(path, e))?;
        for e in rd {
            let p = e.map_err(|e| CaptureError::io(path, e))?.path();
            if p.is_file() {
                files.push(p);
            }
        }
        files.sort();
    } else {
        files.push(path.to_path_buf());
    }
    let mut buf = vec![0u8; 1 << 20];
    for f in files {
        if path.is_dir() {
            h.update(
                f.file_name()
                    .map(|n| n.as_encoded_bytes())
                    .unwrap_or_default(),
            );
        }
        let mut file = File::open(&f).map_err(|e| CaptureError::io(&f, e))?;
        loop {
            let n = file.read(&mut buf).map_err(|e| CaptureError::io(&f, e))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(format!("{:x}", h.finalize()))
}

/// Resolves layers and columns against the models; errors name the config file.
pub fn resolve(
    cfg: &CaptureConfig,
    cfg_path: &Path,
    m: &Models<'_>,
) -> Result<(Selection, Vec<ColumnInfo>)> {
    let c = &m.verifier.config;
    let n = c.num_hidden_layers;
    let bad = |msg: String| Err(CaptureError::config(cfg_path, msg));
    // Gemma 4's KV-sharing layers compute no K/V of their own: "all" skips them.
    let own_kv = |l: usize| c.kv_source(l).is_none();
    let verifier_layers: Vec<usize> = match &cfg.tensors.verifier_layers {
        LayerSet::All(_) => (0..n).filter(|&l| own_kv(l)).collect(),
        LayerSet::List(l) => l.clone(),
    };
    let aux_layers = match (&cfg.tensors.aux_layers, m.drafter) {
        (Some(a), _) => a.clone(),
        (None, Some(d)) => d.config.target_layer_ids.clone(),
        (None, None) => kakeya_weights::dflash::default_target_layers(n, 4),
    };
    for (what, layers) in [
        ("verifier_layers", &verifier_layers),
        ("aux_layers", &aux_layers),
    ] {
        if let Some(&l) = layers.iter().find(|&&l| l >= n) {
            return bad(format!(
                "tensors.{what}: layer {l} does not exist (the verifier has {n} layers)"
            ));
        }
    }
    if !cfg.tensors.verifier.is_empty()
        && let Some(&l) = verifier_layers.iter().find(|&&l| !own_kv(l))
    {
        return bad(format!(
            "tensors.verifier_layers: layer {l} reads layer {}'s K/V (Gemma 4 KV sharing) and \
             has no attention tensors of its own to capture",
            c.kv_source(l).unwrap_or(l)
        ));
    }
    let drafter_layers: Vec<usize> = match (cfg.tensors.drafter_kv, m.drafter) {
        (true, Some(d)) => (0..d.config.num_hidden_layers).collect(),
        (true, None) => return bad("tensors.drafter_kv = true needs model.drafter".into()),
        (false, _) => Vec::new(),
    };
    let mut tensors = cfg.tensors.verifier.clone();
    tensors.dedup();
    let sel = Selection {
        // No per-layer tensors asked for: no per-layer columns at all.
        verifier_layers: if tensors.is_empty() {
            Vec::new()
        } else {
            verifier_layers
        },
        verifier_tensors: tensors,
        aux_layers,
        drafter_layers,
    };
    let mut cols = Vec::new();
    for &l in &sel.verifier_layers {
        for &t in &sel.verifier_tensors {
            let dim = match t {
                // Per layer: Gemma 4's full layers have their own head width and KV heads.
                crate::config::VerifierTensor::QRaw => c.num_attention_heads * c.head_dim_of(l),
                crate::config::VerifierTensor::KRaw | crate::config::VerifierTensor::VRaw => {
                    c.kv_width_of(l)
                }
                crate::config::VerifierTensor::AttnOut => c.hidden_size,
            };
            cols.push(ColumnInfo {
                name: verifier_column(l, t),
                group: "verifier".into(),
                layer: l,
                tensor: t.name().into(),
                dim,
            });
        }
    }
    for &l in &sel.aux_layers {
        cols.push(ColumnInfo {
            name: aux_column(l),
            group: "aux".into(),
            layer: l,
            tensor: "hidden".into(),
            dim: c.hidden_size,
        });
    }
    if let Some(d) = m.drafter.filter(|_| !sel.drafter_layers.is_empty()) {
        let kv = d.config.num_key_value_heads * d.config.head_dim;
        for &l in &sel.drafter_layers {
            for k in [true, false] {
                cols.push(ColumnInfo {
                    name: drafter_column(l, k),
                    group: "drafter".into(),
                    layer: l,
                    tensor: if k { "k" } else { "v" }.into(),
                    dim: kv,
                });
            }
        }
    }
    Ok((sel, cols))
}

fn write_json_atomic(path: &Path, v: &impl serde::Serialize) -> Result<()> {
    let body = serde_json::to_string_pretty(v).expect("serialisable");
    kakeya_weights::fsio::write_file(path, body.as_bytes()).map_err(|e| CaptureError::io(path, e))
}

/// Reads `dir/manifest.json`.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let p = dir.join("manifest.json");
    let text = std::fs::read_to_string(&p).map_err(|e| CaptureError::io(&p, e))?;
    let m: Manifest = serde_json::from_str(&text)
        .map_err(|e| CaptureError::dataset(&p, format!("invalid manifest: {e}")))?;
    if m.schema_version != SCHEMA_VERSION {
        return Err(CaptureError::dataset(
            &p,
            format!(
                "schema version {} (this kakeya reads {SCHEMA_VERSION})",
                m.schema_version
            ),
        ));
    }
    Ok(m)
}

/// Writes `dir/manifest.json` atomically.
pub fn write_manifest(dir: &Path, m: &Manifest) -> Result<()> {
    write_json_atomic(&dir.join("manifest.json"), m)
}

fn vector_array(m: &crate::capture::HostMatrix, rows: &[usize], dtype: Dtype) -> ArrayRef {
    let sel = m.select(rows);
    let (values, elem): (ArrayRef, DataType) = match dtype {
        Dtype::F16 => (
            Arc::new(Float16Array::from(
                sel.data
                    .iter()
                    .map(|&x| f16::from_f32(x))
                    .collect::<Vec<_>>(),
            )),
            DataType::Float16,
        ),
        Dtype::F32 => (Arc::new(Float32Array::from(sel.data)), DataType::Float32),
    };
    Arc::new(FixedSizeListArray::new(
        Arc::new(Field::new("item", elem, false)),
        m.dim as i32,
        values,
        None,
    ))
}

/// One sequence as a record batch (the rows at `positions`).
fn sequence_batch(
    manifest: &Manifest,
    seq: usize,
    cap: &SequenceCapture,
    positions: &[usize],
) -> Result<RecordBatch> {
    let mut cols: Vec<ArrayRef> = vec![
        Arc::new(UInt32Array::from(vec![seq as u32; positions.len()])),
        Arc::new(UInt32Array::from(
            positions.iter().map(|&p| p as u32).collect::<Vec<_>>(),
        )),
        Arc::new(UInt32Array::from(
            positions.iter().map(|&p| cap.tokens[p]).collect::<Vec<_>>(),
        )),
        Arc::new(BooleanArray::from(
            positions
                .iter()
                .map(|&p| p < cap.prompt_len)
                .collect::<Vec<_>>(),
        )),
    ];
    for m in &cap.columns {
        cols.push(vector_array(m, positions, manifest.dtype));
    }
    RecordBatch::try_new(manifest.arrow_schema(), cols).map_err(|e| {
        CaptureError::dataset(PathBuf::from("<batch>"), format!("building a batch: {e}"))
    })
}

/// Writes one shard to a temporary name, then renames it. Returns its info.
#[allow(clippy::too_many_arguments)]
fn write_shard(
    dir: &Path,
    index: usize,
    seqs: &[usize],
    prompts: &[Prompt],
    reused: Option<&Continuations>,
    cfg: &CaptureConfig,
    sel: &Selection,
    m: &Models<'_>,
    manifest: &Manifest,
    on: &mut dyn FnMut(Progress),
) -> Result<ShardInfo> {
    let file = Manifest::shard_file(index);
    let path = dir.join(&file);
    let tmp = kakeya_weights::fsio::temp_sibling(&path);
    let fill = |f: &mut File| -> Result<usize> {
        let props = WriterProperties::builder()
            .set_compression(Compression::ZSTD(
                ZstdLevel::try_new(cfg.output.zstd_level)
                    .map_err(|e| CaptureError::config(&path, format!("zstd level: {e}")))?,
            ))
            .set_dictionary_enabled(false)
            .set_created_by(format!("kakeya {}", env!("CARGO_PKG_VERSION")))
            .set_max_row_group_row_count(None)
            .set_max_row_group_bytes(None)
            .build();
        let mut w = ArrowWriter::try_new(BufWriter::new(f), manifest.arrow_schema(), Some(props))
            .map_err(|e| CaptureError::parquet(&tmp, e))?;
        let mut rows = 0;
        let sequences = match reused {
            Some(r) => r.get(seqs)?,
            None => {
                let texts: Vec<&str> = seqs.iter().map(|&s| prompts[s].text.as_str()).collect();
                continuations(m.verifier, m.tokenizer, &texts, cfg)?
            }
        };
        for (&s, seq) in seqs.iter().zip(sequences) {
            let cap = capture_tokens(m.verifier, m.drafter, seq, cfg, sel)?;
            let n = cap.tokens.len();
            let positions = match cfg.tensors.sample_positions {
                Some(k) => sample_positions(n, k, cfg.tensors.sample_seed, s),
                None => (0..n).collect(),
            };
            let batch = sequence_batch(manifest, s, &cap, &positions)?;
            w.write(&batch)
                .map_err(|e| CaptureError::parquet(&tmp, e))?;
            // One row group per sequence.
            w.flush().map_err(|e| CaptureError::parquet(&tmp, e))?;
            rows += positions.len();
            on(Progress::Sequence {
                rows: positions.len(),
                tokens: n,
            });
        }
        let inner = w.into_inner().map_err(|e| CaptureError::parquet(&tmp, e))?;
        inner
            .into_inner()
            .map_err(|e| CaptureError::io(&tmp, e.into_error()))?;
        Ok(rows)
    };
    let rows = kakeya_weights::fsio::write_file_with(&path, fill, |p, e| CaptureError::io(p, e))?;
    let bytes = std::fs::metadata(&path)
        .map_err(|e| CaptureError::io(&path, e))?
        .len();
    Ok(ShardInfo {
        index,
        file,
        sequences: seqs.to_vec(),
        rows,
        bytes,
        sha256: sha256_path(&path)?,
    })
}

/// The manifest of a job before any shard: models, layers, columns, config and sequences.
fn new_manifest(
    cfg: &CaptureConfig,
    m: &Models<'_>,
    sel: &Selection,
    columns: Vec<ColumnInfo>,
    prompts: &[Prompt],
) -> Manifest {
    let per = cfg.output.sequences_per_shard;
    let c = &m.verifier.config;
    Manifest {
        schema_version: SCHEMA_VERSION,
        created_by: format!("kakeya {}", env!("CARGO_PKG_VERSION")),
        verifier: m.verifier_info.clone(),
        tokenizer: m.tokenizer_info.clone(),
        drafter: m
            .drafter_info
            .clone()
            .filter(|_| !sel.drafter_layers.is_empty()),
        dims: serde_json::json!({
            "hidden": c.hidden_size, "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "layers": c.num_hidden_layers, "vocab": c.vocab_size,
        }),
        verifier_layers: sel.verifier_layers.clone(),
        aux_layers: sel.aux_layers.clone(),
        drafter_layers: sel.drafter_layers.clone(),
        dtype: cfg.output.dtype,
        columns,
        config: {
            let mut c = cfg.clone();
            // Where the dataset lives is not part of what it is.
            c.output.dir = PathBuf::new();
            c
        },
        sequences: prompts.len(),
        shards_total: prompts.len().div_ceil(per),
        sequence_sources: prompts
            .iter()
            .map(|p| SequenceInfo {
                source: p.source,
                item: p.item,
            })
            .collect(),
        shards: Vec::new(),
    }
}

/// Makes the dataset folder, or — with `resume` — checks that the manifest there is of the
/// same job and keeps its finished shards whose files are intact (into `fresh`); removes a
/// killed run's temporary files.
fn prepare_dir(dir: &Path, resume: bool, fresh: &mut Manifest) -> Result<()> {
    let manifest_path = dir.join("manifest.json");
    if manifest_path.exists() {
        if !resume {
            return Err(CaptureError::dataset(
                dir,
                "a dataset already exists here; pass --resume to continue it or choose another output.dir",
            ));
        }
        let old = read_manifest(dir)?;
        if old.fingerprint() != fresh.fingerprint() {
            return Err(CaptureError::dataset(
                &manifest_path,
                "was made with a different config or models; --resume needs the same ones",
            ));
        }
        // Keep only finished shards whose files are still there, intact.
        for s in old.shards {
            let p = dir.join(&s.file);
            if p.is_file() && sha256_path(&p)? == s.sha256 {
                fresh.shards.push(s);
            }
        }
    } else {
        std::fs::create_dir_all(dir).map_err(|e| CaptureError::io(dir, e))?;
    }
    // Leftovers of a killed run are never valid shards.
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with(".shard-") && name.contains(".tmp-") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(())
}

/// Runs (or resumes) a capture job; `on` receives progress events.
pub fn run(
    cfg: &CaptureConfig,
    cfg_path: &Path,
    m: &Models<'_>,
    opts: RunOptions,
    on: &mut dyn FnMut(Progress),
) -> Result<Summary> {
    let t0 = Instant::now();
    let (i, n) = opts.shard;
    if n == 0 || i >= n {
        return Err(CaptureError::config(
            cfg_path,
            format!("--shard {i}/{n}: need 0 ≤ i < n"),
        ));
    }
    let (sel, columns) = resolve(cfg, cfg_path, m)?;
    let prompts = load_sources(&cfg.sources)?;
    if prompts.is_empty() {
        return Err(CaptureError::config(
            cfg_path,
            "the sources hold no prompts",
        ));
    }
    let reused = match &cfg.generation.continuations {
        Some(d) => Some(Continuations::open(
            d,
            cfg,
            &m.verifier_info,
            &m.tokenizer_info,
            prompts.len(),
        )?),
        None => None,
    };
    let per = cfg.output.sequences_per_shard;
    let shards_total = prompts.len().div_ceil(per);
    let mut fresh = new_manifest(cfg, m, &sel, columns, &prompts);
    let dir = &cfg.output.dir;
    prepare_dir(dir, opts.resume, &mut fresh)?;
    write_manifest(dir, &fresh)?;
    let todo: Vec<usize> = (0..shards_total)
        .filter(|s| s % n == i)
        .filter(|s| !fresh.shards.iter().any(|d| d.index == *s))
        .collect();
    let mine = (0..shards_total).filter(|s| s % n == i).count();
    let sequences: usize = todo
        .iter()
        .map(|&s| ((s + 1) * per).min(prompts.len()) - s * per)
        .sum();
    on(Progress::Start { sequences });
    let mut summary = Summary {
        skipped_shards: mine - todo.len(),
        ..Summary::default()
    };
    for s in todo {
        let seqs: Vec<usize> = (s * per..((s + 1) * per).min(prompts.len())).collect();
        let info = write_shard(
            dir,
            s,
            &seqs,
            &prompts,
            reused.as_ref(),
            cfg,
            &sel,
            m,
            &fresh,
            on,
        )?;
        tracing::info!(
            shard = s,
            rows = info.rows,
            bytes = info.bytes,
            "shard written"
        );
        summary.sequences += seqs.len();
        summary.rows += info.rows;
        summary.bytes += info.bytes;
        summary.shards += 1;
        on(Progress::Shard {
            index: s,
            bytes: info.bytes,
        });
        fresh.shards.push(info);
        fresh.shards.sort_by_key(|x| x.index);
        write_manifest(dir, &fresh)?;
    }
    summary.secs = t0.elapsed().as_secs_f64();
    Ok(summary)
}
