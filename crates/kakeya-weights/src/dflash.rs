//! DFlash drafter checkpoints in z-lab's format: a folder with `config.json` (a Qwen3 config
//! plus `block_size`, `num_target_layers` and `dflash_config.{mask_token_id,
//! target_layer_ids}`) and `model.safetensors` holding `fc`, `hidden_norm`, `layers.N.*` and
//! `norm` (plain RMSNorm weights `w`, used as `x̂ · w`). The embedding and LM head are the
//! verifier's and are not stored.
//!
//! Kakeya's extension: an optional reduced draft vocabulary, `draft_vocab_size` in the config
//! and a tensor `d2t` (`[draft_vocab]`, I64) mapping each draft id to its verifier token id. The
//! drafter then scores only those rows of the verifier's LM head.
//! [DFlash: z-lab/dflash `dflash/model.py`; reduced vocabulary as in EAGLE-3]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde_json::{Value, json};

use crate::checkpoint::{HostTensor, check_shapes, read_safetensors_as};
use crate::error::{Result, WeightsError};

/// Hyper-parameters of a DFlash drafter.
#[derive(Debug, Clone, PartialEq)]
pub struct DFlashConfig {
    /// Width of the drafter's residual stream (must equal the verifier's hidden size).
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Drafter decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Vocabulary of the embedding/LM head it borrows (the verifier's).
    pub vocab_size: usize,
    /// Longest position the drafter was configured for.
    pub max_position_embeddings: usize,
    /// Tokens drafted per block, the anchor included.
    pub block_size: usize,
    /// Token id filling the not-yet-drafted block slots.
    pub mask_token_id: u32,
    /// Verifier layers whose output hidden states feed the drafter (0-based).
    pub target_layer_ids: Vec<usize>,
    /// Layers of the verifier it was built for.
    pub num_target_layers: usize,
    /// Size of the reduced draft vocabulary, when one is used.
    pub draft_vocab_size: Option<usize>,
    /// Per layer: `None` for full attention, `Some(w)` for a sliding layer whose queries see
    /// context keys fewer than `w` positions back (z-lab's Gemma 4 drafters: four sliding
    /// layers of 2048, then a full one).
    pub layer_windows: Vec<Option<usize>>,
}

/// z-lab's default choice of verifier layers: `D` layers spread evenly over `1..=T-3`,
/// `round(1 + i·(T-4)/(D-1))` with ties to even (Python's `round`); `T/2` when `D = 1`.
pub fn default_target_layers(num_target_layers: usize, num_draft_layers: usize) -> Vec<usize> {
    if num_draft_layers <= 1 {
        return vec![num_target_layers / 2];
    }
    let span = num_target_layers as f64 - 4.0;
    (0..num_draft_layers)
        .map(|i| (1.0 + i as f64 * span / (num_draft_layers - 1) as f64).round_ties_even() as usize)
        .collect()
}

/// Each drafter layer's attention window (`None`: full attention) from `layer_types` and
/// `sliding_window`; all full when there are no `layer_types`.
fn layer_windows(path: &Path, c: &Value, n_layers: usize) -> Result<Vec<Option<usize>>> {
    Ok(match c.get("layer_types").and_then(Value::as_array) {
        None => vec![None; n_layers],
        Some(types) => {
            let window = c
                .get("sliding_window")
                .and_then(Value::as_u64)
                .filter(|&w| w > 0);
            let mut out = Vec::with_capacity(types.len());
            for t in types {
                out.push(match (t.as_str(), window) {
                    (Some("full_attention"), _) => None,
                    (Some("sliding_attention"), Some(w)) => Some(w as usize),
                    (Some("sliding_attention"), None) => {
                        return Err(WeightsError::format(
                            path,
                            "layer_types has sliding layers but sliding_window is not a positive integer",
                        ));
                    }
                    (other, _) => {
                        return Err(WeightsError::format(
                            path,
                            format!("unknown drafter layer type {other:?} in layer_types"),
                        ));
                    }
                });
            }
            if out.len() != n_layers {
                return Err(WeightsError::format(
                    path,
                    format!(
                        "layer_types has {} entries but num_hidden_layers is {n_layers}",
                        out.len()
                    ),
                ));
            }
            out
        }
    })
}

impl DFlashConfig {
    /// Parses a drafter `config.json`.
    pub fn from_json(path: &Path, text: &str) -> Result<Self> {
        let c: Value = serde_json::from_str(text)
            .map_err(|e| WeightsError::format(path, format!("invalid JSON: {e}")))?;
        let missing = |field: &str| WeightsError::MissingField {
            path: path.to_path_buf(),
            field: field.to_string(),
        };
        let int = |k: &str| {
            c.get(k)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| missing(k))
        };
        let num = |k: &str| c.get(k).and_then(Value::as_f64).ok_or_else(|| missing(k));
        if c.get("attention_bias").and_then(Value::as_bool) == Some(true) {
            return Err(WeightsError::format(
                path,
                "attention_bias = true is not supported (DFlash drafters have no biases)",
            ));
        }
        let n_layers = int("num_hidden_layers")?;
        let layer_windows = layer_windows(path, &c, n_layers)?;
        if let Some(kind) = c
            .get("rope_scaling")
            .filter(|v| !v.is_null())
            .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
            .and_then(Value::as_str)
            .filter(|k| *k != "default")
        {
            return Err(WeightsError::format(
                path,
                format!("rope_scaling type `{kind}` is not supported for drafters"),
            ));
        }
        let dflash = c
            .get("dflash_config")
            .ok_or_else(|| missing("dflash_config"))?;
        let mask_token_id = dflash
            .get("mask_token_id")
            .and_then(Value::as_u64)
            .ok_or_else(|| missing("dflash_config.mask_token_id"))?
            as u32;
        let heads = int("num_attention_heads")?;
        let hidden = int("hidden_size")?;
        let num_target_layers = int("num_target_layers")?;
        let target_layer_ids = match dflash.get("target_layer_ids") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().map(|x| x as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    WeightsError::format(path, "dflash_config.target_layer_ids must be integers")
                })?,
            _ => default_target_layers(num_target_layers, n_layers),
        };
        let rope_theta = match c.get("rope_theta").and_then(Value::as_f64) {
            Some(v) => v,
            None => c
                .get("rope_parameters")
                .and_then(|p| p.get("rope_theta"))
                .and_then(Value::as_f64)
                .ok_or_else(|| missing("rope_theta"))?,
        };
        let cfg = Self {
            hidden_size: hidden,
            intermediate_size: int("intermediate_size")?,
            num_hidden_layers: n_layers,
            num_attention_heads: heads,
            num_key_value_heads: int("num_key_value_heads")?,
            head_dim: c
                .get("head_dim")
                .and_then(Value::as_u64)
                .map_or(hidden / heads.max(1), |v| v as usize),
            rms_norm_eps: num("rms_norm_eps")?,
            rope_theta,
            vocab_size: int("vocab_size")?,
            max_position_embeddings: int("max_position_embeddings")?,
            // Top level in z-lab's first exports, inside dflash_config in later ones.
            block_size: match c.get("block_size").or_else(|| dflash.get("block_size")) {
                Some(v) => v.as_u64().ok_or_else(|| missing("block_size"))? as usize,
                None => return Err(missing("block_size")),
            },
            mask_token_id,
            target_layer_ids,
            num_target_layers,
            draft_vocab_size: c
                .get("draft_vocab_size")
                .and_then(Value::as_u64)
                .map(|v| v as usize),
            layer_windows,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Internal consistency (not the fit to a verifier: see `kakeya-models`).
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |msg: String| Err(WeightsError::format(path, msg));
        if self.num_hidden_layers == 0 || self.num_attention_heads == 0 || self.head_dim == 0 {
            return bad("layers, heads and head_dim must be positive".into());
        }
        if self.num_key_value_heads == 0
            || !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        if self.block_size < 2 {
            return bad(format!("block_size {} must be at least 2", self.block_size));
        }
        if self.layer_windows.len() != self.num_hidden_layers {
            return bad(format!(
                "{} layer windows for {} layers",
                self.layer_windows.len(),
                self.num_hidden_layers
            ));
        }
        if self.target_layer_ids.is_empty() {
            return bad("dflash_config.target_layer_ids is empty".into());
        }
        if self.mask_token_id as usize >= self.vocab_size {
            return bad(format!(
                "mask_token_id {} is outside the vocabulary of {}",
                self.mask_token_id, self.vocab_size
            ));
        }
        if let Some(d) = self.draft_vocab_size
            && (d == 0 || d > self.vocab_size)
        {
            return bad(format!(
                "draft_vocab_size {d} must be in 1..={}",
                self.vocab_size
            ));
        }
        Ok(())
    }

    /// The config as z-lab's `config.json` (a Qwen3 config with the DFlash fields).
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": null,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": false,
            "attention_dropout": 0.0,
            "tie_word_embeddings": false,
            "use_sliding_window": self.layer_windows.iter().any(Option::is_some),
            "sliding_window": self.layer_windows.iter().flatten().next(),
            "layer_types": self
                .layer_windows
                .iter()
                .map(|w| if w.is_some() { "sliding_attention" } else { "full_attention" })
                .collect::<Vec<_>>(),
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": self.target_layer_ids,
            },
            "torch_dtype": "float32",
        });
        if let Some(d) = self.draft_vocab_size {
            v["draft_vocab_size"] = json!(d);
        }
        v
    }

    /// Every tensor the drafter needs, with its PyTorch shape (`d2t` excluded).
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, hd, i) = (self.hidden_size, self.head_dim, self.intermediate_size);
        let (q, kv) = (self.num_attention_heads * hd, self.num_key_value_heads * hd);
        let mut out = vec![
            (
                "fc.weight".to_string(),
                vec![h, self.target_layer_ids.len() * h],
            ),
            ("hidden_norm.weight".to_string(), vec![h]),
            ("norm.weight".to_string(), vec![h]),
        ];
        for l in 0..self.num_hidden_layers {
            let p = |s: &str| format!("layers.{l}.{s}");
            out.extend([
                (p("input_layernorm.weight"), vec![h]),
                (p("post_attention_layernorm.weight"), vec![h]),
                (p("self_attn.q_proj.weight"), vec![q, h]),
                (p("self_attn.k_proj.weight"), vec![kv, h]),
                (p("self_attn.v_proj.weight"), vec![kv, h]),
                (p("self_attn.o_proj.weight"), vec![h, q]),
                (p("self_attn.q_norm.weight"), vec![hd]),
                (p("self_attn.k_norm.weight"), vec![hd]),
                (p("mlp.gate_proj.weight"), vec![i, h]),
                (p("mlp.up_proj.weight"), vec![i, h]),
                (p("mlp.down_proj.weight"), vec![h, i]),
            ]);
        }
        out
    }
}

/// A drafter checkpoint in memory: config, f32 tensors by z-lab name (norm weights as stored,
/// plain `w`), and the optional draft→verifier token map.
#[derive(Debug, Clone)]
pub struct DraftCheckpoint {
    /// Folder it was read from.
    pub source: PathBuf,
    /// Hyper-parameters.
    pub config: DFlashConfig,
    /// Tensors by name (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...).
    pub tensors: BTreeMap<String, HostTensor>,
    /// Verifier token id of each draft id (`draft_vocab_size` entries), when reduced.
    pub d2t: Option<Vec<u32>>,
}

/// Element type a drafter's weights are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreDtype {
    /// 32-bit float.
    #[default]
    F32,
    /// IEEE half (round to nearest even).
    F16,
    /// bfloat16 (round to nearest even), as z-lab publishes its drafters.
    Bf16,
}

impl StoreDtype {
    fn dtype(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::F16 => Dtype::F16,
            Self::Bf16 => Dtype::BF16,
        }
    }

    /// Little-endian bytes of `data` in this type.
    fn encode(self, data: &[f32]) -> Vec<u8> {
        match self {
            Self::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Self::F16 => data
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            Self::Bf16 => data
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        }
    }
}

/// Drafter tensor names: z-lab stores them bare; accept a `model.` prefix too.
fn drafter_name(name: &str) -> Option<String> {
    let n = name.strip_prefix("model.").unwrap_or(name);
    let known = n == "fc.weight"
        || n == "hidden_norm.weight"
        || n == "norm.weight"
        || n.starts_with("layers.");
    known.then(|| n.to_string())
}

impl DraftCheckpoint {
    /// Loads `dir/config.json` + `dir/model.safetensors` and checks every tensor's shape.
    pub fn load(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(WeightsError::format(
                dir,
                "drafter path is not a folder (expected config.json + model.safetensors)",
            ));
        }
        let cfg_path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&cfg_path).map_err(|e| WeightsError::io(&cfg_path, e))?;
        let config = DFlashConfig::from_json(&cfg_path, &text)?;
        let st_path = dir.join("model.safetensors");
        let mut tensors = BTreeMap::new();
        read_safetensors_as(&st_path, &drafter_name, &mut tensors)?;
        let d2t = match config.draft_vocab_size {
            Some(_) => Some(read_d2t(&st_path)?),
            None => None,
        };
        let ck = Self {
            source: dir.to_path_buf(),
            config,
            tensors,
            d2t,
        };
        ck.check()?;
        Ok(ck)
    }

    /// Checks tensor presence and shapes and the token map against the config.
    pub fn check(&self) -> Result<()> {
        check_shapes(&self.source, &self.tensors, self.config.expected_tensors())?;
        match (&self.d2t, self.config.draft_vocab_size) {
            (None, None) => Ok(()),
            (Some(map), Some(n)) => {
                if map.len() != n {
                    return Err(WeightsError::format(
                        &self.source,
                        format!("d2t has {} entries, draft_vocab_size is {n}", map.len()),
                    ));
                }
                if let Some(&bad) = map.iter().find(|&&t| t as usize >= self.config.vocab_size) {
                    return Err(WeightsError::format(
                        &self.source,
                        format!(
                            "d2t maps to token {bad}, outside the vocabulary of {}",
                            self.config.vocab_size
                        ),
                    ));
                }
                Ok(())
            }
            _ => Err(WeightsError::format(
                &self.source,
                "draft_vocab_size and the d2t tensor must be given together",
            )),
        }
    }

    /// Writes the folder (`config.json`, `model.safetensors` in f32) under a temporary name and
    /// renames it into place; an existing non-empty `out` is refused.
    pub fn write_dir(&self, out: &Path) -> Result<()> {
        self.write_dir_as(out, StoreDtype::F32)
    }

    /// [`Self::write_dir`] with the weights stored as `dtype` (the loader reads all three).
    pub fn write_dir_as(&self, out: &Path, dtype: StoreDtype) -> Result<()> {
        self.check()?;
        crate::checkpoint::write_dir_atomically(out, |dir| self.write_files(dir, dtype))
    }

    fn write_files(&self, dir: &Path, dtype: StoreDtype) -> Result<()> {
        let cfg = serde_json::to_string_pretty(&self.config.to_json()).expect("config serialises");
        let cfg_path = dir.join("config.json");
        std::fs::write(&cfg_path, cfg).map_err(|e| WeightsError::io(&cfg_path, e))?;
        let mut blobs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = self
            .tensors
            .iter()
            .map(|(n, t)| {
                (
                    n.clone(),
                    dtype.dtype(),
                    t.shape.clone(),
                    dtype.encode(&t.data),
                )
            })
            .collect();
        if let Some(map) = &self.d2t {
            let raw = map.iter().flat_map(|&t| (t as i64).to_le_bytes()).collect();
            blobs.push(("d2t".into(), Dtype::I64, vec![map.len()], raw));
        }
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = blobs
            .iter()
            .map(|(n, d, s, b)| {
                let view =
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("sizes agree");
                (n.clone(), view)
            })
            .collect();
        let st_path = dir.join("model.safetensors");
        let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(meta), &st_path)
            .map_err(|e| WeightsError::format(&st_path, format!("writing safetensors: {e}")))
    }
}

/// Reads the integer `d2t` tensor (I64 or I32) of a drafter file.
fn read_d2t(path: &Path) -> Result<Vec<u32>> {
    let bytes = std::fs::read(path).map_err(|e| WeightsError::io(path, e))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| WeightsError::format(path, format!("invalid safetensors: {e}")))?;
    let view = st.tensor("d2t").map_err(|_| WeightsError::MissingTensor {
        path: path.to_path_buf(),
        tensor: "d2t".into(),
    })?;
    let raw = view.data();
    let ids: Vec<i64> = match view.dtype() {
        Dtype::I64 => raw
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect(),
        Dtype::I32 => raw
            .chunks_exact(4)
            .map(|b| i64::from(i32::from_le_bytes(b.try_into().expect("4 bytes"))))
            .collect(),
        other => {
            return Err(WeightsError::format(
                path,
                format!("tensor `d2t` has dtype {other:?}; expected I64 or I32"),
            ));
        }
    };
    ids.into_iter()
        .map(|v| {
            u32::try_from(v)
                .map_err(|_| WeightsError::format(path, format!("d2t holds a negative id {v}")))
        })
        .collect()
}

#[cfg(test)]
mod tests;
