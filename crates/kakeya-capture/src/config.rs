//! The typed capture config (`configs/capture/<name>.toml`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use kakeya_models::linear::QUANT_MAX_ROWS;

use crate::error::{CaptureError, Result};

/// A whole capture job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaptureConfig {
    /// Which models run.
    pub model: ModelSection,
    /// Where and how the dataset is written.
    pub output: OutputSection,
    /// The verifier's greedy continuation of each prompt.
    #[serde(default)]
    pub generation: GenerationSection,
    /// What is kept per position.
    #[serde(default)]
    pub tensors: TensorSection,
    /// Prompt sources, in order (sequence ids follow this order).
    pub sources: Vec<SourceConfig>,
}

/// Models.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Verifier: a GGUF file or an HF folder.
    pub verifier: PathBuf,
    /// `tokenizer.json` (default: beside the GGUF or inside the folder).
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// A DFlash drafter folder whose per-layer context K/V are captured too.
    #[serde(default)]
    pub drafter: Option<PathBuf>,
}

/// Stored element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// IEEE half precision (default).
    #[default]
    F16,
    /// Single precision.
    F32,
}

/// Output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputSection {
    /// Dataset folder (relative paths are relative to the working directory).
    pub dir: PathBuf,
    /// Element type of tensor columns.
    #[serde(default)]
    pub dtype: Dtype,
    /// Sequences per Parquet shard (one row group per sequence).
    #[serde(default = "default_per_shard")]
    pub sequences_per_shard: usize,
    /// zstd level.
    #[serde(default = "default_zstd")]
    pub zstd_level: i32,
}

fn default_per_shard() -> usize {
    8
}

fn default_zstd() -> i32 {
    3
}

/// Continuations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GenerationSection {
    /// Greedy tokens generated after each prompt (fewer when a stop token comes first).
    pub gen_len: usize,
    /// Prompts are cut to their first this many tokens (`<bos>` included).
    pub max_prompt_tokens: usize,
    /// Chunk length of prefill and of the capture pass.
    pub chunk: usize,
    /// Continuations decoded together (one stacked forward per step; at most 16, the block
    /// kernel's rows, so each continuation is exactly what it would be alone). Not part of
    /// the dataset's identity: a job may resume with another batch.
    pub batch: usize,
    /// Take each sequence's tokens from this earlier capture of the same prompts, verifier and
    /// generation settings (e.g. one that kept token ids only) instead of generating them
    /// again ([`crate::reuse`]): the data are the same bit for bit, so this is not part of the
    /// dataset's identity either.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub continuations: Option<PathBuf>,
}

impl Default for GenerationSection {
    fn default() -> Self {
        Self {
            gen_len: 64,
            max_prompt_tokens: 1024,
            chunk: 256,
            batch: 8,
            continuations: None,
        }
    }
}

/// Per-verifier-layer tensors that can be kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VerifierTensor {
    /// q_proj output (before q_norm and RoPE), `heads · head_dim`.
    QRaw,
    /// k_proj output (before k_norm and RoPE), `kv_heads · head_dim`.
    KRaw,
    /// v_proj output, `kv_heads · head_dim`.
    VRaw,
    /// Attention block output after o_proj, `hidden`.
    AttnOut,
}

impl VerifierTensor {
    /// Column-name suffix.
    pub fn name(self) -> &'static str {
        match self {
            Self::QRaw => "q_raw",
            Self::KRaw => "k_raw",
            Self::VRaw => "v_raw",
            Self::AttnOut => "attn_out",
        }
    }
}

/// Layers to keep: every layer or a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LayerSet {
    /// `"all"`.
    All(String),
    /// Explicit layer ids.
    List(Vec<usize>),
}

impl Default for LayerSet {
    fn default() -> Self {
        Self::All("all".into())
    }
}

/// What is captured per position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TensorSection {
    /// Per verifier layer: any of `q_raw`, `k_raw`, `v_raw`, `attn_out`.
    pub verifier: Vec<VerifierTensor>,
    /// Verifier layers those are kept for.
    pub verifier_layers: LayerSet,
    /// Verifier layers whose output hidden states are kept as `aux` (default: the drafter's
    /// target layers, or DFlash's default 4 layers for this verifier).
    pub aux_layers: Option<Vec<usize>>,
    /// Keep the drafter's per-layer context K and V (needs `model.drafter`).
    pub drafter_kv: bool,
    /// Keep only this many positions per sequence, chosen at random (seeded per sequence).
    pub sample_positions: Option<usize>,
    /// Seed of position sampling.
    pub sample_seed: u64,
}

impl Default for TensorSection {
    fn default() -> Self {
        Self {
            verifier: vec![
                VerifierTensor::QRaw,
                VerifierTensor::KRaw,
                VerifierTensor::VRaw,
                VerifierTensor::AttnOut,
            ],
            verifier_layers: LayerSet::default(),
            aux_layers: None,
            drafter_kv: false,
            sample_positions: None,
            sample_seed: 0,
        }
    }
}

/// One prompt source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum SourceConfig {
    /// JSON lines: `{"text": ...}` (raw completion) or `{"messages": [{role, content}...]}`
    /// (Gemma chat template, model turn opened).
    Jsonl {
        /// The file.
        path: PathBuf,
        /// Use at most this many lines (default: all).
        #[serde(default)]
        limit: Option<usize>,
    },
    /// Synthetic needle-in-a-haystack prompts: filler lines, one "the secret code is NNNNNN"
    /// line at a random depth, then the question.
    Needle {
        /// Prompts to make.
        count: usize,
        /// Seed (prompt `i` depends only on the seed and `i`).
        seed: u64,
        /// Filler lines, inclusive range `[min, max]`.
        lines: [usize; 2],
    },
}

impl CaptureConfig {
    /// Reads and checks a TOML config.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| CaptureError::io(path, e))?;
        let cfg: Self = toml::from_str(&text)
            .map_err(|e| CaptureError::config(path, format!("invalid config: {e}")))?;
        cfg.check(path)?;
        Ok(cfg)
    }

    /// Checks what can be checked without the models.
    pub fn check(&self, path: &Path) -> Result<()> {
        let bad = |msg: String| Err(CaptureError::config(path, msg));
        if let LayerSet::All(s) = &self.tensors.verifier_layers
            && s != "all"
        {
            return bad(format!(
                "tensors.verifier_layers must be \"all\" or a list of layer ids, got {s:?}"
            ));
        }
        if self.output.sequences_per_shard == 0 {
            return bad("output.sequences_per_shard must be at least 1".into());
        }
        if self.generation.chunk == 0 || self.generation.max_prompt_tokens < 2 {
            return bad("generation.chunk must be ≥ 1 and max_prompt_tokens ≥ 2".into());
        }
        if !(1..=QUANT_MAX_ROWS).contains(&self.generation.batch) {
            return bad(format!(
                "generation.batch must be 1..={QUANT_MAX_ROWS} (the block kernel's rows), not {}",
                self.generation.batch
            ));
        }
        if self.tensors.drafter_kv && self.model.drafter.is_none() {
            return bad("tensors.drafter_kv = true needs model.drafter".into());
        }
        if self.sources.is_empty() {
            return bad("no [[sources]]".into());
        }
        for s in &self.sources {
            if let SourceConfig::Needle { lines, count, .. } = s
                && (lines[0] == 0 || lines[0] > lines[1] || *count == 0)
            {
                return bad(format!(
                    "needle source: lines must be 1 ≤ min ≤ max and count ≥ 1, got {lines:?}, {count}"
                ));
            }
        }
        Ok(())
    }
}
