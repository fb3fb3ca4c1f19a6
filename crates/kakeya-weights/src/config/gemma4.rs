//! What a Gemma 4 text config adds to Gemma 3's fields (`docs/gemma4.md` §1): per-layer-kind
//! attention geometry, proportional RoPE on full layers, values from `k_proj`, KV sharing,
//! per-layer inputs, the MoE branch. Parsed from transformers' `Gemma4TextConfig` JSON (alone,
//! or as the `text_config` of a multimodal `gemma4` config); its rules are transformers 5.24's.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::AttentionKind;
use crate::error::{Result, WeightsError};

/// The MoE branch of every layer (26B-A4B): a router choosing `top_k` of `experts` expert
/// MLPs of width `intermediate`, summed with the dense MLP.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Experts per layer.
    pub experts: usize,
    /// Experts each token uses.
    pub top_k: usize,
    /// Inner width of one expert.
    pub intermediate: usize,
}

/// Gemma 4's additions to the Gemma 3 configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gemma4Extras {
    /// Head width of full-attention layers (sliding layers use `head_dim`).
    pub global_head_dim: usize,
    /// Key/value heads of full-attention layers.
    pub global_kv_heads: usize,
    /// Share of a full layer's rotary frequencies that are non-zero ("proportional" RoPE:
    /// frequencies `i < ⌊p·d/2⌋` of the usual `d`-wide table, the rest 0).
    pub global_partial_rotary: f64,
    /// Full layers take their values from the raw `k_proj` output (no `v_proj`).
    pub attention_k_eq_v: bool,
    /// The last this many layers compute only queries and read the K/V of the last earlier
    /// layer of their kind.
    pub num_kv_shared_layers: usize,
    /// KV-shared layers have a twice-as-wide MLP.
    pub double_wide_mlp: bool,
    /// Width of the per-layer input embeddings (0: none).
    pub per_layer_input_size: usize,
    /// Rows of the per-layer input embedding table (0 without per-layer inputs).
    pub per_layer_vocab: usize,
    /// The MoE branch, when the checkpoint has one.
    pub moe: Option<MoeConfig>,
}

/// The Gemma 4 parts of a text config `c` with `layer_types` already read (the last layer
/// forced to full attention, as transformers does), or a clear error for what Kakeya does not
/// support.
pub(super) fn parse(path: &Path, c: &Value, layer_types: &[AttentionKind]) -> Result<Gemma4Extras> {
    let bad = |msg: String| WeightsError::format(path, msg);
    check_supported(c).map_err(bad)?;
    let k_eq_v = flag(c, "attention_k_eq_v");
    let (global_head_dim, global_kv_heads) = full_geometry(c, layer_types, k_eq_v).map_err(bad)?;
    for (what, v) in [
        ("global_head_dim", global_head_dim),
        ("global key/value heads", global_kv_heads),
    ] {
        if v == 0 {
            return Err(bad(format!("{what} must be positive")));
        }
    }
    let ple = int(c, "hidden_size_per_layer_input").unwrap_or(256);
    Ok(Gemma4Extras {
        global_head_dim,
        global_kv_heads,
        global_partial_rotary: global_partial_rotary(c).map_err(bad)?,
        attention_k_eq_v: k_eq_v,
        num_kv_shared_layers: shared_layers(c, layer_types).map_err(bad)?,
        double_wide_mlp: flag(c, "use_double_wide_mlp"),
        per_layer_input_size: ple,
        // Meaningless without per-layer inputs: 0 then, as from a GGUF file.
        per_layer_vocab: if ple > 0 {
            int(c, "vocab_size_per_layer_input").unwrap_or(262_144)
        } else {
            0
        },
        moe: moe(c).map_err(bad)?,
    })
}

fn int(c: &Value, k: &str) -> Option<usize> {
    c.get(k).and_then(Value::as_u64).map(|v| v as usize)
}

/// A boolean key (absent: false).
fn flag(c: &Value, k: &str) -> bool {
    c.get(k).and_then(Value::as_bool).unwrap_or(false)
}

/// Refuses what a causal text model of Kakeya's cannot run: attention biases, bidirectional
/// attention, activations other than the tanh GELU.
fn check_supported(c: &Value) -> std::result::Result<(), String> {
    if flag(c, "attention_bias") {
        return Err(
            "attention_bias = true is not supported (Gemma 4 checkpoints have none)".into(),
        );
    }
    match c.get("use_bidirectional_attention").and_then(Value::as_str) {
        None | Some("vision") => {} // "vision" changes image tokens' masks only
        Some(other) => {
            return Err(format!(
                "use_bidirectional_attention = \"{other}\" is not supported (a causal text model only)"
            ));
        }
    }
    match c.get("hidden_activation").and_then(Value::as_str) {
        Some(act) if act != "gelu_pytorch_tanh" => Err(format!(
            "hidden_activation `{act}` is not supported (only gelu_pytorch_tanh)"
        )),
        _ => Ok(()),
    }
}

/// A full layer's head size and key/value heads. `per_layer_config` (written by transformers
/// 5.24 and later, keys are layer indices such as "05") wins over the `global_head_dim` /
/// `num_global_key_value_heads` keys it is made from. Kakeya runs one geometry per layer
/// kind: overrides on sliding layers, or full layers that differ, are refused.
fn full_geometry(
    c: &Value,
    layer_types: &[AttentionKind],
    k_eq_v: bool,
) -> std::result::Result<(usize, usize), String> {
    let head_dim = int(c, "head_dim").unwrap_or(256);
    let kv_heads = int(c, "num_key_value_heads").unwrap_or(4);
    let Some(per) = c.get("per_layer_config").filter(|v| !v.is_null()) else {
        let global_kv = match int(c, "num_global_key_value_heads") {
            Some(n) if k_eq_v => n,
            _ => kv_heads,
        };
        return Ok((int(c, "global_head_dim").unwrap_or(512), global_kv));
    };
    let Some(per) = per.as_object() else {
        return Err("per_layer_config is not an object".into());
    };
    let differ = || "per_layer_config gives full layers different geometries: not supported";
    let mut full_geometry = None;
    for (key, entry) in per {
        let Some(i) = key.parse::<usize>().ok().filter(|&i| i < layer_types.len()) else {
            return Err(format!("per_layer_config key `{key}` is not a layer index"));
        };
        let get = |k: &str, default: usize| int(entry, k).unwrap_or(default);
        let geometry = (
            get("head_dim", head_dim),
            get("num_key_value_heads", kv_heads),
        );
        if layer_types[i] != AttentionKind::Full {
            return Err(format!(
                "per_layer_config overrides sliding layer {i}: not supported"
            ));
        }
        if full_geometry.is_some_and(|g| g != geometry) {
            return Err(differ().into());
        }
        full_geometry = Some(geometry);
    }
    let plain = (head_dim, kv_heads);
    let fulls = layer_types
        .iter()
        .filter(|&&k| k == AttentionKind::Full)
        .count();
    match full_geometry {
        // A full layer without an entry keeps the plain geometry.
        Some(g) if g != plain && per.len() < fulls => Err(differ().into()),
        Some(g) => Ok(g),
        None => Ok(plain),
    }
}

/// The full layers' partial rotary factor (a proportional RoPE's), after checking both layer
/// kinds' `rope_parameters`.
fn global_partial_rotary(c: &Value) -> std::result::Result<f64, String> {
    let rope = |kind: &str| c.get("rope_parameters").and_then(|p| p.get(kind));
    let mut partial = 1.0;
    for kind in ["sliding_attention", "full_attention"] {
        let Some(p) = rope(kind) else {
            return Err(format!("rope_parameters.{kind} is missing"));
        };
        if p.get("rope_theta").and_then(Value::as_f64).is_none() {
            return Err(format!("rope_parameters.{kind}.rope_theta is missing"));
        }
        let ty = p
            .get("rope_type")
            .and_then(Value::as_str)
            .unwrap_or("default");
        match (kind, ty) {
            (_, "default") => {}
            ("full_attention", "proportional") => {
                partial = p
                    .get("partial_rotary_factor")
                    .and_then(Value::as_f64)
                    .unwrap_or(1.0);
                if p.get("factor").and_then(Value::as_f64).unwrap_or(1.0) != 1.0 {
                    return Err("a proportional RoPE `factor` other than 1 is not supported".into());
                }
            }
            _ => {
                return Err(format!(
                    "rope_parameters.{kind}.rope_type `{ty}` is not supported"
                ));
            }
        }
    }
    if !(0.0..=1.0).contains(&partial) {
        return Err(format!("partial_rotary_factor {partial} is not in [0, 1]"));
    }
    Ok(partial)
}

/// `num_kv_shared_layers`, checked: every kind among the shared (last) layers needs an
/// earlier layer of that kind to read.
fn shared_layers(c: &Value, layer_types: &[AttentionKind]) -> std::result::Result<usize, String> {
    let n = layer_types.len();
    let shared = int(c, "num_kv_shared_layers").unwrap_or(0);
    if shared >= n {
        return Err(format!(
            "num_kv_shared_layers {shared} leaves no layer to share from ({n} layers)"
        ));
    }
    for (i, &kind) in layer_types.iter().enumerate().skip(n - shared) {
        if !layer_types[..n - shared].contains(&kind) {
            return Err(format!(
                "layer {i} shares K/V, but no layer before {} is of its kind ({kind:?})",
                n - shared
            ));
        }
    }
    Ok(shared)
}

/// The MoE branch of `enable_moe_block`, checked.
fn moe(c: &Value) -> std::result::Result<Option<MoeConfig>, String> {
    if !flag(c, "enable_moe_block") {
        return Ok(None);
    }
    let (Some(experts), Some(top_k), Some(intermediate)) = (
        int(c, "num_experts"),
        int(c, "top_k_experts"),
        int(c, "moe_intermediate_size"),
    ) else {
        return Err(
            "enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size".into(),
        );
    };
    if top_k == 0 || top_k > experts {
        return Err(format!("top_k_experts {top_k} must be in 1..={experts}"));
    }
    Ok(Some(MoeConfig {
        experts,
        top_k,
        intermediate,
    }))
}
