//! The Gemma 3 text-model configuration, read from a GGUF file's metadata or an HF
//! `config.json`; both give the same struct.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, WeightsError};

mod gemma4;
mod gguf;
pub use gemma4::{Gemma4Extras, MoeConfig};

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
pub struct GemmaConfig {
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
    /// What a Gemma 4 text model adds (`None` for Gemma 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemma4: Option<Gemma4Extras>,
}

/// Whether a `config.json` is Gemma 4's (`gemma4` / `gemma4_text`); refuses other model
/// families, whose fields would otherwise be read as Gemma 3's and give a wrong model. Configs
/// without a `model_type` (hand-written, older tools) are taken as Gemma 3.
fn is_gemma4(path: &Path, root: &Value, text: &Value) -> Result<bool> {
    let kind = |v: &Value| {
        v.get("model_type")
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let mut g4 = false;
    for t in [kind(text), kind(root)].into_iter().flatten() {
        match t.as_str() {
            "gemma3" | "gemma3_text" => {}
            "gemma4" | "gemma4_text" => g4 = true,
            _ => {
                return Err(WeightsError::format(
                    path,
                    format!(
                        "model_type `{t}` is not supported (Gemma 3: `gemma3`, `gemma3_text`; \
                         Gemma 4: `gemma4`, `gemma4_text`)"
                    ),
                ));
            }
        }
    }
    Ok(g4)
}

/// Most decoder layers a config may declare: far above any Gemma (62), low enough that a
/// corrupt count cannot size per-layer tables beyond memory before the tensors are checked.
const MAX_LAYERS: usize = 1024;

pub(crate) fn check_layers(path: &Path, n: usize) -> Result<usize> {
    if n == 0 || n > MAX_LAYERS {
        return Err(WeightsError::format(
            path,
            format!("{n} decoder layers: expected 1..={MAX_LAYERS}"),
        ));
    }
    Ok(n)
}

/// Gemma 3's default layer pattern: every sixth layer is global.
pub(crate) fn default_layer_types(n: usize, pattern: usize) -> Vec<AttentionKind> {
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

impl GemmaConfig {
    /// Parses an HF `config.json`: a `Gemma3TextConfig` or a `Gemma4TextConfig` (Gemma 4's
    /// additions go to [`Self::gemma4`]), alone or as the `text_config` of a multimodal
    /// config. Accepts both the legacy `rope_theta` keys and transformers 5's
    /// `rope_parameters`; refuses other model families by name.
    pub fn from_hf_json(path: &Path, text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text)
            .map_err(|e| WeightsError::format(path, format!("invalid JSON: {e}")))?;
        let c = root.get("text_config").unwrap_or(&root);
        let g4 = is_gemma4(path, &root, c)?;
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
        let n_layers = check_layers(path, int("num_hidden_layers")?)?;
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
        let mut layer_types = layer_types;
        if g4 && let Some(last) = layer_types.last_mut() {
            // transformers makes Gemma 4's last layer global whatever the config says.
            *last = AttentionKind::Full;
        }
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
            // Gemma 4 scales attention scores by 1 (its q/k norms do the scaling).
            query_pre_attn_scalar: if g4 {
                1.0
            } else {
                num("query_pre_attn_scalar")?
            },
            max_position_embeddings: int("max_position_embeddings")?,
            final_logit_softcapping: c.get("final_logit_softcapping").and_then(Value::as_f64),
            gemma4: if g4 {
                Some(gemma4::parse(path, c, &layer_types)?)
            } else {
                None
            },
            layer_types,
        })
    }

    /// Head width of layer `i`.
    pub fn head_dim_of(&self, i: usize) -> usize {
        match (&self.gemma4, self.layer_types[i]) {
            (Some(g), AttentionKind::Full) => g.global_head_dim,
            _ => self.head_dim,
        }
    }

    /// Key/value heads of layer `i`.
    pub fn kv_heads_of(&self, i: usize) -> usize {
        match (&self.gemma4, self.layer_types[i]) {
            (Some(g), AttentionKind::Full) => g.global_kv_heads,
            _ => self.num_key_value_heads,
        }
    }

    /// Width of layer `i`'s K (and V) rows: key/value heads × head width.
    pub fn kv_width_of(&self, i: usize) -> usize {
        self.kv_heads_of(i) * self.head_dim_of(i)
    }

    /// For a layer that shares K/V (Gemma 4's last `num_kv_shared_layers`): the layer whose
    /// K/V it reads, the last earlier non-sharing layer of its kind; `None` for layers with
    /// their own.
    pub fn kv_source(&self, i: usize) -> Option<usize> {
        let g = self.gemma4.as_ref()?;
        let first = self.num_hidden_layers - g.num_kv_shared_layers;
        if i < first {
            return None;
        }
        (0..first)
            .rev()
            .find(|&j| self.layer_types[j] == self.layer_types[i])
    }

    /// The K/V row widths of the layers with K/V of their own, `0..n − num_kv_shared_layers`
    /// in order (Gemma 4's sharing layers come last): what f_θ predicts and capture records.
    pub fn own_kv_widths(&self) -> Vec<usize> {
        (0..self.num_hidden_layers)
            .take_while(|&i| self.kv_source(i).is_none())
            .map(|i| self.kv_width_of(i))
            .collect()
    }

    /// Dense MLP width of layer `i`.
    pub fn mlp_width_of(&self, i: usize) -> usize {
        match &self.gemma4 {
            Some(g) if g.double_wide_mlp && self.kv_source(i).is_some() => {
                2 * self.intermediate_size
            }
            _ => self.intermediate_size,
        }
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
        let c = GemmaConfig::from_hf_json(Path::new("config.json"), TINY).unwrap();
        assert_eq!(c.layer_types[5], AttentionKind::Full);
        assert_eq!(c.layer_types[0], AttentionKind::Sliding);
        let back = GemmaConfig::from_hf_json(Path::new("x"), &c.to_hf_json().to_string()).unwrap();
        assert_eq!(c, back);
    }

    /// transformers' own Gemma 4 text config `name` (tests/fixtures/gemma4, written by its
    /// script) and its path.
    fn gemma4_fixture(name: &str) -> (std::path::PathBuf, String) {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let p = root.join(format!("tests/fixtures/gemma4/{name}/config.json"));
        let text = std::fs::read_to_string(&p).unwrap();
        (p, text)
    }

    #[test]
    fn other_model_families_are_refused_by_name() {
        // (Gemma 4: `gemma4_geometry_follows_transformers_rules`.)
        let llama = TINY.replace("{", r#"{"model_type": "llama", "#);
        let e = GemmaConfig::from_hf_json(Path::new("c.json"), &llama)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`llama` is not supported"), "{e}");
        // Gemma 3's own types, and none at all, are read.
        for t in ["gemma3_text", "gemma3"] {
            let ok = TINY.replace("{", &format!(r#"{{"model_type": "{t}", "#));
            assert!(
                GemmaConfig::from_hf_json(Path::new("c.json"), &ok).is_ok(),
                "{t}"
            );
        }
    }

    #[test]
    fn gemma4_geometry_follows_transformers_rules() {
        // dense: layers 2 and 5 full (head dim 32, 1 KV head through k_eq_v), 4 and 5 share.
        let (p, text) = gemma4_fixture("dense");
        let c = GemmaConfig::from_hf_json(&p, &text).unwrap();
        let g = c.gemma4.clone().unwrap();
        assert_eq!((g.global_head_dim, g.global_kv_heads), (32, 1));
        assert_eq!(g.global_partial_rotary, 0.25);
        assert!(g.attention_k_eq_v && g.double_wide_mlp && g.moe.is_none());
        assert_eq!((g.per_layer_input_size, g.per_layer_vocab), (8, 128));
        assert_eq!(c.query_pre_attn_scalar, 1.0);
        let geometry: Vec<(usize, usize)> = (0..6)
            .map(|i| (c.head_dim_of(i), c.kv_heads_of(i)))
            .collect();
        assert_eq!(
            geometry,
            [(16, 2), (16, 2), (32, 1), (16, 2), (16, 2), (32, 1)]
        );
        // The last earlier layer of the same kind, not `i - first_shared`.
        let sources: Vec<Option<usize>> = (0..6).map(|i| c.kv_source(i)).collect();
        assert_eq!(sources, [None, None, None, None, Some(3), Some(2)]);
        let widths: Vec<usize> = (0..6).map(|i| c.mlp_width_of(i)).collect();
        assert_eq!(widths, [96, 96, 96, 96, 192, 192]);
        // Nested in a multimodal config, the same.
        let nested = format!(r#"{{"model_type": "gemma4", "text_config": {text}}}"#);
        assert_eq!(GemmaConfig::from_hf_json(&p, &nested).unwrap(), c);
        // Without k_eq_v, full layers keep the sliding layers' KV-head count.
        let (p, text) = gemma4_fixture("dense-kv");
        let c = GemmaConfig::from_hf_json(&p, &text).unwrap();
        assert_eq!((c.head_dim_of(5), c.kv_heads_of(5)), (32, 2));
        // The MoE model.
        let (p, text) = gemma4_fixture("moe");
        let c = GemmaConfig::from_hf_json(&p, &text).unwrap();
        let g = c.gemma4.unwrap();
        assert_eq!(
            g.moe,
            Some(MoeConfig {
                experts: 4,
                top_k: 2,
                intermediate: 32
            })
        );
        assert_eq!((g.num_kv_shared_layers, g.per_layer_input_size), (0, 0));
        // transformers forces the last layer global; older keys give the full-layer geometry.
        let legacy = TINY.replace(
            "{",
            r#"{"model_type": "gemma4_text", "global_head_dim": 24, "attention_k_eq_v": true,
                "num_global_key_value_heads": 1, "layer_types": ["sliding_attention",
                "sliding_attention", "sliding_attention", "sliding_attention",
                "sliding_attention", "sliding_attention"], "rope_parameters": {
                "sliding_attention": {"rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "rope_theta": 1e6}}, "#,
        );
        let c = GemmaConfig::from_hf_json(Path::new("c.json"), &legacy).unwrap();
        assert_eq!(c.layer_types[5], AttentionKind::Full);
        assert_eq!(
            (c.head_dim_of(5), c.kv_heads_of(5), c.head_dim_of(0)),
            (24, 1, 8)
        );
    }

    #[test]
    fn unsupported_gemma4_configs_are_refused_with_the_reason() {
        let (p, text) = gemma4_fixture("dense");
        let mut v: Value = serde_json::from_str(&text).unwrap();
        let cases: [(&str, Value, &str); 6] = [
            ("attention_bias", Value::Bool(true), "attention_bias"),
            (
                "use_bidirectional_attention",
                Value::from("all"),
                "use_bidirectional_attention",
            ),
            ("num_kv_shared_layers", Value::from(6), "leaves no layer"),
            (
                "hidden_activation",
                Value::from("silu"),
                "hidden_activation",
            ),
            ("enable_moe_block", Value::Bool(true), "needs num_experts"),
            (
                "rope_parameters",
                serde_json::json!({"full_attention": {"rope_theta": 1.0}}),
                "rope_parameters.sliding_attention is missing",
            ),
        ];
        for (key, value, want) in cases {
            let old = v[key].clone();
            v[key] = value;
            let e = GemmaConfig::from_hf_json(&p, &v.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.contains("config.json") && e.contains(want), "{key}: {e}");
            v[key] = old;
        }
        // One geometry per layer kind: per-layer overrides that differ are refused.
        let (p2, t2) = gemma4_fixture("dense");
        let mut w: Value = serde_json::from_str(&t2).unwrap();
        for (key, value, want) in [
            (
                "5",
                serde_json::json!({"head_dim": 64}),
                "different geometries",
            ),
            (
                "1",
                serde_json::json!({"head_dim": 32}),
                "overrides sliding layer 1",
            ),
            (
                "x",
                serde_json::json!({"head_dim": 32}),
                "key `x` is not a layer index",
            ),
        ] {
            let old = w["per_layer_config"].clone();
            w["per_layer_config"][key] = value;
            let e = GemmaConfig::from_hf_json(&p2, &w.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{key}: {e}");
            w["per_layer_config"] = old;
        }
        w["per_layer_config"].as_object_mut().unwrap().remove("5");
        let e = GemmaConfig::from_hf_json(&p2, &w.to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("different geometries"), "{e}");
        // Shared layers of a kind no earlier layer has.
        v["per_layer_config"] = Value::Null;
        v["layer_types"] = serde_json::json!([
            "sliding_attention",
            "sliding_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "full_attention"
        ]);
        let e = GemmaConfig::from_hf_json(&p, &v.to_string())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no layer before 4 is of its kind"), "{e}");
    }

    #[test]
    fn an_absurd_layer_count_is_refused_before_per_layer_tables() {
        // Found by examples/fuzz_loaders.rs: a corrupt count sized per-layer tables.
        for n in ["0", "1000000000"] {
            let text = TINY.replace(
                "\"num_hidden_layers\": 6",
                &format!("\"num_hidden_layers\": {n}"),
            );
            let e = GemmaConfig::from_hf_json(Path::new("c.json"), &text)
                .unwrap_err()
                .to_string();
            assert!(e.contains("decoder layers: expected 1..=1024"), "{e}");
        }
    }

    #[test]
    fn missing_field_names_file_and_field() {
        let text = TINY.replace("\"head_dim\": 8,", "");
        let e = GemmaConfig::from_hf_json(Path::new("dir/config.json"), &text)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "dir/config.json: missing required field `head_dim`");
    }
}
