//! The Gemma 3 text-model configuration, read from a GGUF file's metadata or an HF
//! `config.json`; both give the same struct.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, WeightsError};
use crate::gguf::GgufFile;

/// The attention kind of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKind {
    /// Full causal attention over the whole context (global RoPE base).
    Full,
    /// Causal attention over the last `sliding_window` positions (local RoPE base).
    Sliding,
}

/// Gemma 3 text-model hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gemma3Config {
    /// Vocabulary rows of the embedding (and tied LM head).
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA groups).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base of full-attention layers.
    pub rope_theta: f64,
    /// RoPE base of sliding layers.
    pub rope_local_base_freq: f64,
    /// Linear RoPE scaling factor of full-attention layers (1 = none).
    pub rope_scaling_factor: f64,
    /// Window of sliding layers (a query sees keys `k > q - window`).
    pub sliding_window: usize,
    /// Attention scores are scaled by `query_pre_attn_scalar^-1/2`.
    pub query_pre_attn_scalar: f64,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// Optional final logit soft-cap (`cap * tanh(logits / cap)`); none for Gemma 3.
    pub final_logit_softcapping: Option<f64>,
    /// Attention kind of each layer, in order.
    pub layer_types: Vec<AttentionKind>,
}

/// Refuses a `config.json` of another model family: its fields would otherwise be read as
/// Gemma 3's and give a wrong model (a Gemma 4 config has most of Gemma 3's keys). Configs
/// without a `model_type` (hand-written, older tools) are taken as Gemma 3.
fn check_model_type(path: &Path, root: &Value, text: &Value) -> Result<()> {
    let kind = |v: &Value| {
        v.get("model_type")
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    for t in [kind(text), kind(root)].into_iter().flatten() {
        if t.starts_with("gemma4") {
            return Err(WeightsError::format(
                path,
                format!(
                    "model_type `{t}` is Gemma 4, which Kakeya cannot run yet (only Gemma 3: \
                     `gemma3`, `gemma3_text`)"
                ),
            ));
        }
        if t != "gemma3" && t != "gemma3_text" {
            return Err(WeightsError::format(
                path,
                format!(
                    "model_type `{t}` is not supported (only Gemma 3: `gemma3`, `gemma3_text`)"
                ),
            ));
        }
    }
    Ok(())
}

/// Gemma 3's default layer pattern: every sixth layer is global.
fn default_layer_types(n: usize, pattern: usize) -> Vec<AttentionKind> {
    (0..n)
        .map(|i| {
            if (i + 1) % pattern == 0 {
                AttentionKind::Full
            } else {
                AttentionKind::Sliding
            }
        })
        .collect()
}

impl Gemma3Config {
    /// Reads the `gemma3.*` metadata of a GGUF file. GGUF does not store a few Gemma 3
    /// constants; they are filled in as llama.cpp does (local RoPE base 1e4, a global layer
    /// every 6th, `query_pre_attn_scalar = key_length`).
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let arch = f
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        if arch != "gemma3" {
            let why = if arch.starts_with("gemma4") {
                "Gemma 4, which Kakeya cannot run yet; only `gemma3` is supported"
            } else {
                "only `gemma3` is supported"
            };
            return Err(WeightsError::format(
                &f.path,
                format!("general.architecture is `{arch}`: {why}"),
            ));
        }
        let u = |k: &str| f.req_u64(&format!("gemma3.{k}")).map(|v| v as usize);
        let n_layers = u("block_count")?;
        let head_dim = u("attention.key_length")?;
        let vocab_size = match f.info("token_embd.weight") {
            Some(t) => t.torch_shape()[0],
            None => {
                return Err(WeightsError::MissingTensor {
                    path: f.path.clone(),
                    tensor: "token_embd.weight".into(),
                });
            }
        };
        let scaling = f
            .get("gemma3.rope.scaling.type")
            .and_then(|v| v.as_str())
            .unwrap_or("none");
        let rope_scaling_factor = match scaling {
            "linear" => f.req_f64("gemma3.rope.scaling.factor")?,
            _ => 1.0,
        };
        Ok(Self {
            vocab_size,
            hidden_size: u("embedding_length")?,
            intermediate_size: u("feed_forward_length")?,
            num_hidden_layers: n_layers,
            num_attention_heads: u("attention.head_count")?,
            num_key_value_heads: u("attention.head_count_kv")?,
            head_dim,
            rms_norm_eps: f.req_f64("gemma3.attention.layer_norm_rms_epsilon")?,
            rope_theta: f.req_f64("gemma3.rope.freq_base")?,
            rope_local_base_freq: 10_000.0,
            rope_scaling_factor,
            sliding_window: u("attention.sliding_window")?,
            query_pre_attn_scalar: head_dim as f64,
            max_position_embeddings: u("context_length")?,
            final_logit_softcapping: None,
            layer_types: default_layer_types(n_layers, 6),
        })
    }

    /// Parses an HF `config.json` (a `Gemma3TextConfig`, or a `Gemma3Config` whose
    /// `text_config` holds one). Accepts both the legacy `rope_theta` keys and
    /// transformers 5's `rope_parameters`.
    pub fn from_hf_json(path: &Path, text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text)
            .map_err(|e| WeightsError::format(path, format!("invalid JSON: {e}")))?;
        let c = root.get("text_config").unwrap_or(&root);
        check_model_type(path, &root, c)?;
        let missing = |field: &str| WeightsError::MissingField {
            path: path.to_path_buf(),
            field: field.to_string(),
        };
        let num = |k: &str| c.get(k).and_then(Value::as_f64).ok_or_else(|| missing(k));
        let int = |k: &str| {
            c.get(k)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| missing(k))
        };
        let n_layers = int("num_hidden_layers")?;
        let rope_params = c.get("rope_parameters");
        let rope_of = |kind: &str| rope_params.and_then(|p| p.get(kind));
        let rope_theta = match c.get("rope_theta").and_then(Value::as_f64) {
            Some(v) => v,
            None => rope_of("full_attention")
                .and_then(|p| p.get("rope_theta"))
                .and_then(Value::as_f64)
                .ok_or_else(|| missing("rope_theta"))?,
        };
        let rope_local_base_freq = c
            .get("rope_local_base_freq")
            .and_then(Value::as_f64)
            .or_else(|| {
                rope_of("sliding_attention")
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(Value::as_f64)
            })
            .unwrap_or(10_000.0);
        let scaling = c
            .get("rope_scaling")
            .filter(|v| !v.is_null())
            .or_else(|| rope_of("full_attention"));
        let rope_scaling_factor = match scaling {
            Some(s) if s.get("rope_type").and_then(Value::as_str) == Some("linear") => s
                .get("factor")
                .and_then(Value::as_f64)
                .ok_or_else(|| missing("rope_scaling.factor"))?,
            _ => 1.0,
        };
        let layer_types = match c.get("layer_types").and_then(Value::as_array) {
            Some(a) => a
                .iter()
                .map(|v| match v.as_str() {
                    Some("full_attention") => Ok(AttentionKind::Full),
                    Some("sliding_attention") => Ok(AttentionKind::Sliding),
                    other => Err(WeightsError::format(
                        path,
                        format!("unknown layer type {other:?} in layer_types"),
                    )),
                })
                .collect::<Result<Vec<_>>>()?,
            None => default_layer_types(
                n_layers,
                c.get("sliding_window_pattern")
                    .and_then(Value::as_u64)
                    .unwrap_or(6) as usize,
            ),
        };
        if layer_types.len() != n_layers {
            return Err(WeightsError::format(
                path,
                format!(
                    "layer_types has {} entries but num_hidden_layers is {n_layers}",
                    layer_types.len()
                ),
            ));
        }
        Ok(Self {
            vocab_size: int("vocab_size")?,
            hidden_size: int("hidden_size")?,
            intermediate_size: int("intermediate_size")?,
            num_hidden_layers: n_layers,
            num_attention_heads: int("num_attention_heads")?,
            num_key_value_heads: int("num_key_value_heads")?,
            head_dim: int("head_dim")?,
            rms_norm_eps: num("rms_norm_eps")?,
            rope_theta,
            rope_local_base_freq,
            rope_scaling_factor,
            sliding_window: int("sliding_window")?,
            query_pre_attn_scalar: num("query_pre_attn_scalar")?,
            max_position_embeddings: int("max_position_embeddings")?,
            final_logit_softcapping: c.get("final_logit_softcapping").and_then(Value::as_f64),
            layer_types,
        })
    }

    /// Writes the config as an HF `Gemma3TextConfig` `config.json` (legacy RoPE keys, which
    /// transformers 4.5x and 5.x both read).
    pub fn to_hf_json(&self) -> Value {
        let layer_types: Vec<&str> = self
            .layer_types
            .iter()
            .map(|k| match k {
                AttentionKind::Full => "full_attention",
                AttentionKind::Sliding => "sliding_attention",
            })
            .collect();
        let rope_scaling = if self.rope_scaling_factor == 1.0 {
            Value::Null
        } else {
            serde_json::json!({"rope_type": "linear", "factor": self.rope_scaling_factor})
        };
        serde_json::json!({
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_local_base_freq": self.rope_local_base_freq,
            "rope_scaling": rope_scaling,
            "sliding_window": self.sliding_window,
            // transformers declares it an integer (and refuses 256.0); write it as one when it is.
            "query_pre_attn_scalar": if self.query_pre_attn_scalar.fract() == 0.0 {
                serde_json::json!(self.query_pre_attn_scalar as i64)
            } else {
                serde_json::json!(self.query_pre_attn_scalar)
            },
            "max_position_embeddings": self.max_position_embeddings,
            "final_logit_softcapping": self.final_logit_softcapping,
            "attn_logit_softcapping": null,
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": layer_types,
            "tie_word_embeddings": true,
            "torch_dtype": "float32",
            "bos_token_id": 2,
            "eos_token_id": 1,
            "pad_token_id": 0,
        })
    }

    /// Checks internal consistency (head counts divide, etc.).
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |msg: String| Err(WeightsError::format(path, msg));
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
        if !self.head_dim.is_multiple_of(2) || self.head_dim == 0 {
            return bad(format!(
                "head_dim {} must be even and non-zero",
                self.head_dim
            ));
        }
        if self.sliding_window == 0 {
            return bad("sliding_window must be positive".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = r#"{"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "sliding_window": 4, "query_pre_attn_scalar": 8,
        "max_position_embeddings": 128}"#;

    #[test]
    fn hf_json_round_trips() {
        let c = Gemma3Config::from_hf_json(Path::new("config.json"), TINY).unwrap();
        assert_eq!(c.layer_types[5], AttentionKind::Full);
        assert_eq!(c.layer_types[0], AttentionKind::Sliding);
        let back = Gemma3Config::from_hf_json(Path::new("x"), &c.to_hf_json().to_string()).unwrap();
        assert_eq!(c, back);
    }

    #[test]
    fn other_model_families_are_refused_by_name() {
        // transformers' own Gemma 4 config (tests/fixtures/gemma4, written by its script).
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let p = root.join("tests/fixtures/gemma4/dense/config.json");
        let g4 = std::fs::read_to_string(&p).unwrap();
        let e = Gemma3Config::from_hf_json(&p, &g4).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains("`gemma4_text` is Gemma 4"),
            "{e}"
        );
        // Nested, as the multimodal checkpoints have it.
        let nested = format!(r#"{{"model_type": "gemma4", "text_config": {g4}}}"#);
        let e = Gemma3Config::from_hf_json(&p, &nested)
            .unwrap_err()
            .to_string();
        assert!(e.contains("Gemma 4"), "{e}");
        let llama = TINY.replace("{", r#"{"model_type": "llama", "#);
        let e = Gemma3Config::from_hf_json(Path::new("c.json"), &llama)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`llama` is not supported"), "{e}");
        // Gemma 3's own types, and none at all, are read.
        for t in ["gemma3_text", "gemma3"] {
            let ok = TINY.replace("{", &format!(r#"{{"model_type": "{t}", "#));
            assert!(
                Gemma3Config::from_hf_json(Path::new("c.json"), &ok).is_ok(),
                "{t}"
            );
        }
    }

    #[test]
    fn missing_field_names_file_and_field() {
        let text = TINY.replace("\"head_dim\": 8,", "");
        let e = Gemma3Config::from_hf_json(Path::new("dir/config.json"), &text)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "dir/config.json: missing required field `head_dim`");
    }
}
