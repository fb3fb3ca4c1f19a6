//! The configuration from a GGUF file's metadata: `gemma3` and `gemma4`, with the keys and
//! conventions of llama.cpp's converter (`convert_hf_to_gguf.py`, `conversion/gemma.py`).
//!
//! GGUF leaves a few facts implicit; they are filled in as llama.cpp's own loader does. For
//! Gemma 4 some are read from the tensors themselves: a full layer without `attn_v` takes its
//! values from its keys (`attention_k_eq_v`), and the full layers' "proportional" RoPE is the
//! `rope_freqs` tensor (frequency factor 1 for a rotated pair, ~1e30 for an unrotated one).

use crate::config::{
    AttentionKind, Gemma4Extras, GemmaConfig, MoeConfig, check_layers, default_layer_types,
};
use crate::error::{Result, WeightsError};
use crate::gguf::{GgufFile, GgufValue};

/// A frequency factor at least this large stops a pair from rotating (the converter writes
/// 1e30: the angle `pos · θ / factor` is 0 to f32 precision for any position).
const UNROTATED_FACTOR: f32 = 1e20;

impl GemmaConfig {
    /// Reads a GGUF file's `gemma3.*` or `gemma4.*` metadata. Gemma 3: GGUF does not store a
    /// few constants; they are filled in as llama.cpp does (local RoPE base 1e4, a global
    /// layer every 6th, `query_pre_attn_scalar = key_length`).
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let arch = f
            .get("general.architecture")
            .and_then(|v| v.as_str())
            .unwrap_or("");
        match arch {
            "gemma3" => gemma3(f),
            "gemma4" => gemma4(f),
            _ => {
                let why = if arch.starts_with("gemma4") {
                    " (a Gemma 4 assistant/drafter file, not a text model)"
                } else {
                    ""
                };
                Err(WeightsError::format(
                    &f.path,
                    format!(
                        "general.architecture is `{arch}`{why}: only `gemma3` and `gemma4` are \
                         supported"
                    ),
                ))
            }
        }
    }
}

/// Rows of the embedding: the vocabulary size.
fn vocab_size(f: &GgufFile) -> Result<usize> {
    match f.info("token_embd.weight") {
        Some(t) if t.dims.len() == 2 => Ok(t.torch_shape()[0]),
        Some(t) => Err(WeightsError::format(
            &f.path,
            format!(
                "token_embd.weight has {} dimensions, expected 2",
                t.dims.len()
            ),
        )),
        None => Err(WeightsError::MissingTensor {
            path: f.path.clone(),
            tensor: "token_embd.weight".into(),
        }),
    }
}

fn gemma3(f: &GgufFile) -> Result<GemmaConfig> {
    let u = |k: &str| f.req_u64(&format!("gemma3.{k}")).map(|v| v as usize);
    let n_layers = check_layers(&f.path, u("block_count")?)?;
    let head_dim = u("attention.key_length")?;
    let scaling = f
        .get("gemma3.rope.scaling.type")
        .and_then(|v| v.as_str())
        .unwrap_or("none");
    let rope_scaling_factor = match scaling {
        "linear" => f.req_f64("gemma3.rope.scaling.factor")?,
        _ => 1.0,
    };
    Ok(GemmaConfig {
        vocab_size: vocab_size(f)?,
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
        gemma4: None,
    })
}

/// A per-layer metadata value: one number for every layer, or an array with one per layer.
fn per_layer(f: &GgufFile, key: &str, n: usize) -> Result<Vec<usize>> {
    let bad = |msg: String| WeightsError::format(&f.path, format!("{key}: {msg}"));
    match f.get(key) {
        None => Err(WeightsError::MissingField {
            path: f.path.clone(),
            field: key.to_string(),
        }),
        Some(GgufValue::Array(items)) => {
            if items.len() != n {
                return Err(bad(format!("{} entries for {n} layers", items.len())));
            }
            items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|v| v as usize)
                        .ok_or_else(|| bad("an entry is not a non-negative integer".into()))
                })
                .collect()
        }
        Some(v) => v
            .as_u64()
            .map(|v| vec![v as usize; n])
            .ok_or_else(|| bad("not a non-negative integer".into())),
    }
}

/// The one value `values[i]` takes over the layers `i` that `pick` selects (Kakeya runs one
/// geometry per layer kind), or `None` when it selects none.
fn uniform(
    f: &GgufFile,
    key: &str,
    values: &[usize],
    pick: impl Fn(usize) -> bool,
) -> Result<Option<usize>> {
    let mut it = values.iter().enumerate().filter(|&(i, _)| pick(i));
    let Some((_, &first)) = it.next() else {
        return Ok(None);
    };
    match it.find(|&(_, &v)| v != first) {
        Some((i, &v)) => Err(WeightsError::format(
            &f.path,
            format!("{key}: layer {i} has {v}, other layers of its kind {first}: not supported"),
        )),
        None => Ok(Some(first)),
    }
}

fn gemma4(f: &GgufFile) -> Result<GemmaConfig> {
    let path = &f.path;
    let bad = |msg: String| Err(WeightsError::format(path, msg));
    let u = |k: &str| f.req_u64(&key(k)).map(|v| v as usize);
    let n = check_layers(path, u("block_count")?)?;
    let layer_types = layer_kinds(f, n)?;
    let types = &layer_types;
    let is = |kind: AttentionKind| move |i: usize| types[i] == kind;
    let shared = opt_u(f, "attention.shared_kv_layers").unwrap_or(0);
    if shared >= n {
        return bad(format!(
            "gemma4.attention.shared_kv_layers {shared} leaves no layer to share from ({n} layers)"
        ));
    }
    let first_shared = n - shared;

    // Attention geometry: full layers use key_length, sliding ones key_length_swa.
    let (global_head_dim, head_dim) = (u("attention.key_length")?, u("attention.key_length_swa")?);
    for (k, want) in [
        ("attention.value_length", global_head_dim),
        ("attention.value_length_swa", head_dim),
    ] {
        if let Some(v) = opt_u(f, k)
            && v != want
        {
            return bad(format!(
                "gemma4.{k} {v} differs from the key length {want}: not supported"
            ));
        }
    }
    let heads = per_layer(f, &key("attention.head_count"), n)?;
    let num_attention_heads = uniform(f, "attention.head_count", &heads, |_| true)?.unwrap_or(0);
    let kv = per_layer(f, &key("attention.head_count_kv"), n)?;
    let kv_heads = uniform(
        f,
        "attention.head_count_kv",
        &kv,
        is(AttentionKind::Sliding),
    )?;
    let global_kv = uniform(f, "attention.head_count_kv", &kv, is(AttentionKind::Full))?;
    let global_kv_heads = global_kv.unwrap_or(0);
    let num_key_value_heads = kv_heads.unwrap_or(global_kv_heads);

    let (intermediate_size, double_wide_mlp) = mlp_widths(f, n, first_shared)?;

    let global_partial_rotary = rope_checks(f, global_head_dim, head_dim)?;

    // Values from keys: a full layer with its own K/V but no `attn_v` (llama.cpp infers it so).
    let first_own_full = (0..first_shared).find(|&i| layer_types[i] == AttentionKind::Full);
    let attention_k_eq_v =
        first_own_full.is_some_and(|i| f.info(&format!("blk.{i}.attn_v.weight")).is_none());

    let per_layer_input_size = opt_u(f, "embedding_length_per_layer_input").unwrap_or(0);
    let per_layer_vocab = match f.info("per_layer_token_embd.weight") {
        Some(t) if per_layer_input_size > 0 && t.dims.len() == 2 => t.torch_shape()[0],
        _ => 0,
    };
    let moe = moe(f)?;
    let extras = Gemma4Extras {
        global_head_dim,
        global_kv_heads,
        global_partial_rotary,
        attention_k_eq_v,
        num_kv_shared_layers: shared,
        double_wide_mlp,
        per_layer_input_size,
        per_layer_vocab,
        moe,
    };
    for (what, v) in [
        ("attention.head_count", num_attention_heads),
        ("full layers' attention.head_count_kv", global_kv_heads),
        ("attention.key_length", global_head_dim),
    ] {
        if v == 0 {
            return bad(format!("gemma4.{what} must be positive"));
        }
    }
    Ok(GemmaConfig {
        vocab_size: vocab_size(f)?,
        hidden_size: u("embedding_length")?,
        intermediate_size,
        num_hidden_layers: n,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: f.req_f64(&key("attention.layer_norm_rms_epsilon"))?,
        rope_theta: f.req_f64(&key("rope.freq_base"))?,
        rope_local_base_freq: f
            .get(&key("rope.freq_base_swa"))
            .and_then(GgufValue::as_f64)
            .unwrap_or(10_000.0),
        rope_scaling_factor: 1.0,
        sliding_window: u("attention.sliding_window")?,
        // Gemma 4 scales attention scores by 1 (its q/k norms do the scaling).
        query_pre_attn_scalar: 1.0,
        max_position_embeddings: u("context_length")?,
        final_logit_softcapping: f
            .get(&key("final_logit_softcapping"))
            .and_then(GgufValue::as_f64),
        layer_types,
        gemma4: Some(extras),
    })
}

/// Gemma 4's metadata key `k`: `gemma4.{k}`.
fn key(k: &str) -> String {
    format!("gemma4.{k}")
}

/// Key `gemma4.{k}` as an integer, if present.
fn opt_u(f: &GgufFile, k: &str) -> Option<usize> {
    f.get(&key(k))
        .and_then(GgufValue::as_u64)
        .map(|v| v as usize)
}

/// Each layer's attention kind from `attention.sliding_window_pattern` (the last layer made
/// global whatever it says, as transformers does).
fn layer_kinds(f: &GgufFile, n: usize) -> Result<Vec<AttentionKind>> {
    let bad = |msg: String| Err(WeightsError::format(&f.path, msg));
    let pattern = match f.get(&key("attention.sliding_window_pattern")) {
        Some(GgufValue::Array(a)) if a.len() == n => a,
        _ => {
            return bad(format!(
                "gemma4.attention.sliding_window_pattern must be an array of {n} booleans"
            ));
        }
    };
    let mut layer_types = Vec::with_capacity(n);
    for v in pattern {
        layer_types.push(match v {
            GgufValue::Bool(true) => AttentionKind::Sliding,
            GgufValue::Bool(false) => AttentionKind::Full,
            _ => return bad("gemma4.attention.sliding_window_pattern holds a non-boolean".into()),
        });
    }
    layer_types[n - 1] = AttentionKind::Full;
    Ok(layer_types)
}

/// The MLP width of the layers with their own K/V, and whether the shared layers' is twice
/// it (`use_double_wide_mlp`).
fn mlp_widths(f: &GgufFile, n: usize, first_shared: usize) -> Result<(usize, bool)> {
    let ff = per_layer(f, &key("feed_forward_length"), n)?;
    let intermediate_size = uniform(f, "feed_forward_length", &ff, |i| i < first_shared)?
        .expect("at least one layer has its own K/V");
    let shared_width = uniform(f, "feed_forward_length", &ff, |i| i >= first_shared)?;
    let double_wide_mlp = match shared_width {
        None => false,
        Some(w) if w == intermediate_size => false,
        Some(w) if w == 2 * intermediate_size => true,
        Some(w) => {
            return Err(WeightsError::format(
                &f.path,
                format!(
                    "gemma4.feed_forward_length: the shared layers' {w} is neither the other \
                     layers' {intermediate_size} nor twice it"
                ),
            ));
        }
    };
    Ok((intermediate_size, double_wide_mlp))
}

/// Checks the RoPE keys (sliding layers rotate the whole head; full layers the pairs
/// `rope_freqs` marks) and returns the full layers' partial rotary factor.
fn rope_checks(f: &GgufFile, global_head_dim: usize, head_dim: usize) -> Result<f64> {
    let bad = |msg: String| Err(WeightsError::format(&f.path, msg));
    if let Some(t) = f.get(&key("rope.scaling.type")).and_then(GgufValue::as_str)
        && t != "none"
    {
        return bad(format!("gemma4.rope.scaling.type `{t}` is not supported"));
    }
    for (k, want) in [
        ("rope.dimension_count", global_head_dim),
        ("rope.dimension_count_swa", head_dim),
    ] {
        if let Some(v) = opt_u(f, k)
            && v != want
        {
            return bad(format!(
                "gemma4.{k} {v}: only whole-head rotary tables are supported (head dim {want})"
            ));
        }
    }
    partial_rotary(f, global_head_dim)
}

/// The MoE branch (`expert_count` > 0), checked.
fn moe(f: &GgufFile) -> Result<Option<MoeConfig>> {
    let experts = opt_u(f, "expert_count").unwrap_or(0);
    if experts == 0 {
        return Ok(None);
    }
    let u = |k: &str| f.req_u64(&key(k)).map(|v| v as usize);
    let top_k = u("expert_used_count")?;
    if top_k == 0 || top_k > experts {
        return Err(WeightsError::format(
            &f.path,
            format!("gemma4.expert_used_count {top_k} must be in 1..={experts}"),
        ));
    }
    Ok(Some(MoeConfig {
        experts,
        top_k,
        intermediate: u("expert_feed_forward_length")?,
    }))
}

/// The share of a full layer's rotary pairs that rotate, from `rope_freqs.weight` (absent:
/// all of them). The converter marks the unrotated tail with huge frequency factors; any
/// other factor (a real frequency scaling) is refused.
fn partial_rotary(f: &GgufFile, head_dim: usize) -> Result<f64> {
    let Some(info) = f.info("rope_freqs.weight") else {
        return Ok(1.0);
    };
    let half = head_dim / 2;
    let bad = |msg: String| {
        Err(WeightsError::format(
            &f.path,
            format!("rope_freqs.weight: {msg}"),
        ))
    };
    if info.elems() != half {
        return bad(format!(
            "{} factors for a head of {head_dim} (expected {half})",
            info.elems()
        ));
    }
    let (_, factors) = f.tensor_f32("rope_freqs.weight")?;
    let rotated = factors.iter().take_while(|&&x| x == 1.0).count();
    if factors[rotated..]
        .iter()
        .any(|&x| x.is_nan() || x < UNROTATED_FACTOR)
    {
        return bad(
            "frequency factors other than 1 (rotated) followed by ~1e30 (not rotated) are \
             not supported"
                .into(),
        );
    }
    let share = rotated as f64 / half as f64;
    // Rope::proportional rotates ⌊share · d/2⌋ pairs; make sure that is `rotated`.
    if (share * half as f64).floor() as usize != rotated {
        return bad(format!(
            "{rotated} rotated pairs of {half} is not representable"
        ));
    }
    Ok(share)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's conversion of the tiny dense Gemma 4 (tests/fixtures/gemma4).
    fn dense() -> GgufFile {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        GgufFile::open(root.join("tests/fixtures/gemma4/dense/model-f32.gguf")).unwrap()
    }

    fn refused(f: &GgufFile) -> String {
        GemmaConfig::from_gguf(f).unwrap_err().to_string()
    }

    #[test]
    fn gemma4_metadata_gives_the_geometry() {
        let c = GemmaConfig::from_gguf(&dense()).unwrap();
        let g = c.gemma4.as_ref().unwrap();
        assert_eq!((c.head_dim, g.global_head_dim), (16, 32));
        assert_eq!((c.num_key_value_heads, g.global_kv_heads), (2, 1));
        assert_eq!(g.global_partial_rotary, 0.25);
        assert!(g.attention_k_eq_v && g.double_wide_mlp);
        assert_eq!((g.num_kv_shared_layers, g.per_layer_input_size), (2, 8));
        assert_eq!(c.query_pre_attn_scalar, 1.0);
        assert_eq!(c.layer_types[2], AttentionKind::Full);
    }

    #[test]
    fn inconsistent_gemma4_metadata_is_refused_with_the_key() {
        let set = |k: &str, v: GgufValue| {
            let mut f = dense();
            f.metadata.insert(format!("gemma4.{k}"), v);
            f
        };
        let ints = |v: &[u64]| GgufValue::Array(v.iter().map(|&x| GgufValue::UInt(x)).collect());
        let cases = [
            // Two full layers with different KV-head counts.
            (
                set("attention.head_count_kv", ints(&[2, 2, 1, 2, 2, 4])),
                "layer 5 has 4",
            ),
            // An array that does not cover the layers.
            (
                set("attention.head_count_kv", ints(&[2, 2])),
                "2 entries for 6 layers",
            ),
            // Shared layers 3x as wide.
            (
                set("feed_forward_length", ints(&[96, 96, 96, 96, 288, 288])),
                "nor twice",
            ),
            (
                set("attention.sliding_window_pattern", ints(&[1, 0])),
                "array of 6 booleans",
            ),
            (
                set("attention.shared_kv_layers", GgufValue::UInt(6)),
                "no layer to share",
            ),
            (
                set("attention.value_length", GgufValue::UInt(16)),
                "differs from the key",
            ),
            (
                set("rope.dimension_count_swa", GgufValue::UInt(8)),
                "whole-head rotary",
            ),
            (
                set("rope.scaling.type", GgufValue::String("yarn".into())),
                "`yarn`",
            ),
            (set("expert_count", GgufValue::UInt(4)), "expert_used_count"),
        ];
        for (f, want) in &cases {
            let e = refused(f);
            assert!(e.contains(want), "{want}: {e}");
            assert!(e.contains("model-f32.gguf"), "names the file: {e}");
        }
        let mut f = dense();
        f.metadata.insert(
            "general.architecture".into(),
            GgufValue::String("gemma4-assistant".into()),
        );
        let e = refused(&f);
        assert!(e.contains("drafter file, not a text model"), "{e}");
    }
}
