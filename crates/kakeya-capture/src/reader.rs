//! Streaming reads of a capture dataset: one sequence at a time, only the asked columns, only
//! the row groups of the asked sequences.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use arrow::array::{
    Array, BooleanArray, FixedSizeListArray, Float16Array, Float32Array, UInt32Array,
};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use crate::error::{CaptureError, Result};
use crate::job::read_manifest;
use crate::schema::Manifest;

/// Whether sequence `seq` is one of the held-out ones when every `every`-th is (ids
/// `every − 1`, `2·every − 1`, …; `every = 0`: none). The trainers and `kakeya ngram build`
/// hold out the same sequences by this one rule.
pub fn held_out(seq: usize, every: usize) -> bool {
    every > 0 && seq % every == every - 1
}

/// What to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Query {
    /// Global sequence ids to read (default: all finished).
    pub sequences: Option<Range<usize>>,
    /// Positions to keep within each sequence (default: all stored).
    pub positions: Option<Range<usize>>,
    /// Vector columns to read, by name (see [`crate::schema`]).
    pub columns: Vec<String>,
}

/// One sequence's rows.
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceBatch {
    /// Global sequence id.
    pub seq: usize,
    /// Position of each row.
    pub pos: Vec<u32>,
    /// Token id of each row.
    pub token: Vec<u32>,
    /// Whether each row is in the prompt.
    pub in_prompt: Vec<bool>,
    /// The asked columns, in query order: `(name, dim, row-major f32 values)`.
    pub columns: Vec<(String, usize, Vec<f32>)>,
}

/// An opened dataset.
#[derive(Debug, Clone)]
pub struct Dataset {
    dir: PathBuf,
    manifest: Manifest,
}

impl Dataset {
    /// Opens `dir` (reads `manifest.json`).
    pub fn open(dir: &Path) -> Result<Self> {
        Ok(Self {
            dir: dir.to_path_buf(),
            manifest: read_manifest(dir)?,
        })
    }

    /// The dataset folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The dataset's manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Errors, naming the dataset and every missing column, unless all `names` are stored.
    pub fn require_columns(&self, names: &[String]) -> Result<()> {
        let missing: Vec<&String> = names
            .iter()
            .filter(|n| !self.manifest.columns.iter().any(|c| &c.name == *n))
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(CaptureError::dataset(
                &self.dir,
                format!("the dataset has no column(s) {missing:?}; recapture with them kept"),
            ))
        }
    }

    /// Streams the asked sequences, in sequence order.
    pub fn read(&self, q: &Query) -> Result<impl Iterator<Item = Result<SequenceBatch>> + '_> {
        self.require_columns(&q.columns)?;
        let mut plan = Vec::new();
        for s in &self.manifest.shards {
            for (rg, &seq) in s.sequences.iter().enumerate() {
                if q.sequences.as_ref().is_none_or(|r| r.contains(&seq)) {
                    plan.push((self.dir.join(&s.file), rg, seq));
                }
            }
        }
        plan.sort_by_key(|p| p.2);
        let q = q.clone();
        Ok(plan
            .into_iter()
            .map(move |(path, rg, seq)| self.read_group(&path, rg, seq, &q)))
    }

    fn read_group(&self, path: &Path, rg: usize, seq: usize, q: &Query) -> Result<SequenceBatch> {
        let err = |e: &dyn std::fmt::Display| CaptureError::parquet(path, e);
        let file = File::open(path).map_err(|e| CaptureError::io(path, e))?;
        let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| err(&e))?;
        let schema = builder.schema().clone();
        let mut roots = vec![0, 1, 2, 3];
        for name in &q.columns {
            roots.push(schema.index_of(name).map_err(|e| err(&e))?);
        }
        let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
        let rows = builder.metadata().row_group(rg).num_rows() as usize;
        let reader = builder
            .with_row_groups(vec![rg])
            .with_projection(mask)
            .with_batch_size(rows.max(1))
            .build()
            .map_err(|e| err(&e))?;
        let mut out = SequenceBatch {
            seq,
            pos: Vec::new(),
            token: Vec::new(),
            in_prompt: Vec::new(),
            columns: q
                .columns
                .iter()
                .map(|n| (n.clone(), 0, Vec::new()))
                .collect(),
        };
        for batch in reader {
            let batch = batch.map_err(|e| err(&e))?;
            let u32s = |name: &str| -> Result<Vec<u32>> {
                let col = batch
                    .column_by_name(name)
                    .ok_or_else(|| err(&format!("no column {name}")))?;
                let a = col
                    .as_any()
                    .downcast_ref::<UInt32Array>()
                    .ok_or_else(|| err(&format!("column {name} is not u32")))?;
                Ok(a.values().to_vec())
            };
            let pos = u32s("pos")?;
            let keep: Vec<usize> = (0..pos.len())
                .filter(|&i| {
                    q.positions
                        .as_ref()
                        .is_none_or(|r| r.contains(&(pos[i] as usize)))
                })
                .collect();
            let token = u32s("token")?;
            let flags = batch
                .column_by_name("in_prompt")
                .and_then(|c| c.as_any().downcast_ref::<BooleanArray>().cloned())
                .ok_or_else(|| err(&"column in_prompt is not bool"))?;
            for &i in &keep {
                out.pos.push(pos[i]);
                out.token.push(token[i]);
                out.in_prompt.push(flags.value(i));
            }
            for (name, dim, values) in &mut out.columns {
                let col = batch
                    .column_by_name(name)
                    .ok_or_else(|| err(&format!("no column {name}")))?;
                let list = col
                    .as_any()
                    .downcast_ref::<FixedSizeListArray>()
                    .ok_or_else(|| err(&format!("column {name} is not a fixed-size list")))?;
                let d = list.value_length() as usize;
                *dim = d;
                let flat = list.values();
                let all: Vec<f32> = if let Some(h) = flat.as_any().downcast_ref::<Float16Array>() {
                    h.values().iter().map(|x| x.to_f32()).collect()
                } else if let Some(f) = flat.as_any().downcast_ref::<Float32Array>() {
                    f.values().to_vec()
                } else {
                    return Err(err(&format!("column {name} holds neither f16 nor f32")));
                };
                let base = list.offset() * d;
                for &i in &keep {
                    values.extend_from_slice(&all[base + i * d..base + (i + 1) * d]);
                }
            }
        }
        Ok(out)
    }
}
