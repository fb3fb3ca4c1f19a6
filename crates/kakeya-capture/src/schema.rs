//! The dataset layout: column names, the Arrow schema, and `manifest.json`.
//!
//! One row per (sequence, position). Fixed columns `seq` (u32), `pos` (u32), `token` (u32),
//! `in_prompt` (bool); then one `FixedSizeList<f16|f32>` column per captured vector:
//! - `v{LL}_{q_raw|k_raw|v_raw|attn_out}` — verifier layer `LL` (two digits);
//! - `aux_{LL}` — the verifier's hidden state after layer `LL`;
//! - `d{LL}_{k|v}` — drafter layer `LL`'s context key (after k_norm, before RoPE) and value.
//!
//! Each shard holds whole sequences, one row group per sequence, so a trainer reads a sequence
//! (or a sequence range) with a column projection and skips every other row group unread.

use std::path::PathBuf;
use std::sync::Arc;

use arrow::datatypes::{DataType, Field, Schema};
use serde::{Deserialize, Serialize};

use crate::config::{CaptureConfig, Dtype, VerifierTensor};

/// Version of this layout; readers refuse other versions.
pub const SCHEMA_VERSION: u32 = 1;

/// One vector column.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnInfo {
    /// Column name.
    pub name: String,
    /// `verifier`, `aux` or `drafter`.
    pub group: String,
    /// Layer id (verifier layer for `verifier`/`aux`, drafter layer for `drafter`).
    pub layer: usize,
    /// `q_raw`, `k_raw`, `v_raw`, `attn_out`, `hidden`, `k` or `v`.
    pub tensor: String,
    /// Elements per row.
    pub dim: usize,
}

/// Name of a verifier-layer column.
pub fn verifier_column(layer: usize, t: VerifierTensor) -> String {
    format!("v{layer:02}_{}", t.name())
}

/// Name of an aux hidden-state column.
pub fn aux_column(layer: usize) -> String {
    format!("aux_{layer:02}")
}

/// Name of a drafter context K (`k = true`) or V column.
pub fn drafter_column(layer: usize, k: bool) -> String {
    format!("d{layer:02}_{}", if k { "k" } else { "v" })
}

/// A model a dataset was made with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Path as given in the config.
    pub path: PathBuf,
    /// SHA-256 of the file (GGUF) or of the folder's files in name order.
    pub sha256: String,
}

/// One finished shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    /// Shard index.
    pub index: usize,
    /// File name inside the dataset folder.
    pub file: String,
    /// Global sequence ids in the shard, one row group each, in order.
    pub sequences: Vec<usize>,
    /// Rows (positions) written.
    pub rows: usize,
    /// File size.
    pub bytes: u64,
    /// SHA-256 of the file.
    pub sha256: String,
}

/// One sequence's origin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceInfo {
    /// Source index in the config.
    pub source: usize,
    /// Item within the source.
    pub item: usize,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Writer.
    pub created_by: String,
    /// Verifier.
    pub verifier: ModelInfo,
    /// Tokenizer.
    pub tokenizer: ModelInfo,
    /// Drafter, when its K/V were captured.
    pub drafter: Option<ModelInfo>,
    /// Verifier dims: hidden, heads, kv heads, head dim, layers.
    pub dims: serde_json::Value,
    /// Verifier layers with per-layer columns, in order.
    pub verifier_layers: Vec<usize>,
    /// Verifier layers with aux columns, in order.
    pub aux_layers: Vec<usize>,
    /// Drafter layers with K/V columns.
    pub drafter_layers: Vec<usize>,
    /// Element type of vector columns.
    pub dtype: Dtype,
    /// Every vector column.
    pub columns: Vec<ColumnInfo>,
    /// The config the dataset was made from (sources, seeds, generation length...).
    pub config: CaptureConfig,
    /// Total sequences the job makes.
    pub sequences: usize,
    /// Total shards the job makes.
    pub shards_total: usize,
    /// Origin of each sequence.
    pub sequence_sources: Vec<SequenceInfo>,
    /// Finished shards (complete files only), by index.
    pub shards: Vec<ShardInfo>,
}

impl Manifest {
    /// The Arrow schema of every shard.
    pub fn arrow_schema(&self) -> Arc<Schema> {
        let elem = match self.dtype {
            Dtype::F16 => DataType::Float16,
            Dtype::F32 => DataType::Float32,
        };
        let mut fields = vec![
            Field::new("seq", DataType::UInt32, false),
            Field::new("pos", DataType::UInt32, false),
            Field::new("token", DataType::UInt32, false),
            Field::new("in_prompt", DataType::Boolean, false),
        ];
        for c in &self.columns {
            let item = Arc::new(Field::new("item", elem.clone(), false));
            fields.push(Field::new(
                &c.name,
                DataType::FixedSizeList(item, c.dim as i32),
                false,
            ));
        }
        Arc::new(Schema::new(fields))
    }

    /// What identifies the job's content: everything but the finished-shard list and the
    /// shard split. Two manifests with equal fingerprints describe the same dataset.
    pub fn fingerprint(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("manifest serialises");
        if let Some(o) = v.as_object_mut() {
            o.remove("shards");
            // How many continuations decode together does not change the data,
            if let Some(g) = o
                .get_mut("config")
                .and_then(|c| c.get_mut("generation"))
                .and_then(|g| g.as_object_mut())
            {
                g.remove("batch");
                // Nor whether the continuations were generated or read from an earlier capture.
                g.remove("continuations");
            }
        }
        v
    }

    /// Shard file name.
    pub fn shard_file(index: usize) -> String {
        format!("shard-{index:05}.parquet")
    }
}
