//! One in-memory checkpoint for both sources (GGUF file, HF safetensors folder), with the
//! checkpoint names and conventions normalised at this edge.
//!
//! Canonical form: HF tensor names (`model.layers.N.self_attn.q_proj.weight`, ...), PyTorch
//! shapes (`[out, in]`), f32 values, and every Gemma RMSNorm weight stored as its **multiplier**
//! `1 + w` — the GGUF convention. HF checkpoints store `w`, so the HF loader adds 1 and the HF
//! writer subtracts it; the GGUF loader keeps the stored value (llama.cpp's converter already
//! added 1).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::config::GemmaConfig;
use crate::error::{Result, WeightsError};
use crate::gguf::GgufFile;
use crate::mapped::{Mapped, available_host_memory, check_fits};
use kakeya_kernels::QuantMatrix;
use kakeya_kernels::dequant::GgmlType;

/// A dense f32 tensor on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Shape, PyTorch order.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

/// A Gemma 3 checkpoint: config + canonical tensors.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// Where it was read from.
    pub source: PathBuf,
    /// Model hyper-parameters.
    pub config: GemmaConfig,
    /// Tensors by canonical (HF) name; norms as multipliers `1 + w`.
    pub tensors: BTreeMap<String, HostTensor>,
    /// The GGUF blocks of quantised 2-D tensors, by canonical name, for CPU kernels that read
    /// them directly (same values as `tensors`; empty for HF folders).
    pub quantized: BTreeMap<String, QuantMatrix>,
}

/// GGUF → HF name remap for Gemma 3 and 4: the one table of checkpoint names.
/// Per-layer names (`blk.N.<gguf>` → `model.layers.N.<hf>`):
const LAYER_NAMES: &[(&str, &str)] = &[
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("attn_norm.weight", "input_layernorm.weight"),
    (
        "post_attention_norm.weight",
        "post_attention_layernorm.weight",
    ),
    // GGUF calls the pre-FFN norm `ffn_norm`.
    ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
    ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    // Gemma 4 (llama.cpp's `gemma4` names).
    ("layer_output_scale.weight", "layer_scalar"),
    ("inp_gate.weight", "per_layer_input_gate.weight"),
    ("proj.weight", "per_layer_projection.weight"),
    ("post_norm.weight", "post_per_layer_input_norm.weight"),
    ("ffn_gate_inp.weight", "router.proj.weight"),
    ("ffn_gate_inp.scale", "router.scale"),
    ("ffn_down_exps.scale", "router.per_expert_scale"),
    ("ffn_gate_up_exps.weight", "experts.gate_up_proj"),
    ("ffn_down_exps.weight", "experts.down_proj"),
    (
        "pre_ffw_norm_2.weight",
        "pre_feedforward_layernorm_2.weight",
    ),
    (
        "post_ffw_norm_1.weight",
        "post_feedforward_layernorm_1.weight",
    ),
    (
        "post_ffw_norm_2.weight",
        "post_feedforward_layernorm_2.weight",
    ),
];
/// Whole-model names.
const GLOBAL_NAMES: &[(&str, &str)] = &[
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    // Gemma 4's per-layer inputs.
    (
        "per_layer_token_embd.weight",
        "model.embed_tokens_per_layer.weight",
    ),
    (
        "per_layer_model_proj.weight",
        "model.per_layer_model_projection.weight",
    ),
    (
        "per_layer_proj_norm.weight",
        "model.per_layer_projection_norm.weight",
    ),
];

/// Is this canonical tensor a Gemma (1 + w) RMSNorm weight?
pub fn is_gemma_norm(name: &str) -> bool {
    name.ends_with("norm.weight") || name.ends_with("layernorm.weight")
}

/// Maps a GGUF tensor name to its canonical (HF) name.
pub fn gguf_to_hf(name: &str) -> Option<String> {
    if let Some(&(_, hf)) = GLOBAL_NAMES.iter().find(|(g, _)| *g == name) {
        return Some(hf.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let &(_, hf) = LAYER_NAMES.iter().find(|(g, _)| *g == suffix)?;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Maps an HF checkpoint name to canonical form, or `None` for tensors a text model ignores
/// (vision tower, projector). Multimodal checkpoints prefix the text model.
fn hf_canonical(name: &str) -> Option<String> {
    let name = name
        .strip_prefix("language_model.")
        .map(str::to_string)
        .or_else(|| {
            name.strip_prefix("model.language_model.")
                .map(|r| format!("model.{r}"))
        })
        .unwrap_or_else(|| name.to_string());
    name.starts_with("model.").then_some(name)
}

/// Every tensor a Gemma 3 (or Gemma 4) text model needs, with its shape.
pub fn expected_tensors(c: &GemmaConfig) -> Vec<(String, Vec<usize>)> {
    let h = c.hidden_size;
    let mut v = vec![
        (
            "model.embed_tokens.weight".to_string(),
            vec![c.vocab_size, h],
        ),
        ("model.norm.weight".to_string(), vec![h]),
    ];
    let g4 = c.gemma4.as_ref();
    let layers = c.num_hidden_layers;
    if let Some(g) = g4.filter(|g| g.per_layer_input_size > 0) {
        let lp = layers * g.per_layer_input_size;
        v.extend([
            (
                "model.embed_tokens_per_layer.weight".to_string(),
                vec![g.per_layer_vocab, lp],
            ),
            (
                "model.per_layer_model_projection.weight".to_string(),
                vec![lp, h],
            ),
            (
                "model.per_layer_projection_norm.weight".to_string(),
                vec![g.per_layer_input_size],
            ),
        ]);
    }
    for i in 0..layers {
        let p = |s: &str| format!("model.layers.{i}.{s}");
        let hd = c.head_dim_of(i);
        let (q, kv) = (c.num_attention_heads * hd, c.kv_heads_of(i) * hd);
        let width = c.mlp_width_of(i);
        // Gemma 3's order (seeded test checkpoints draw their values in it). A layer reading
        // another's K/V has no key/value weights of its own; with k_eq_v a full layer's values
        // are its raw keys.
        let own = c.kv_source(i).is_none();
        let k_eq_v = g4.is_some_and(|g| g.attention_k_eq_v)
            && c.layer_types[i] == crate::AttentionKind::Full;
        v.push((p("self_attn.q_proj.weight"), vec![q, h]));
        if own {
            v.push((p("self_attn.k_proj.weight"), vec![kv, h]));
            if !k_eq_v {
                v.push((p("self_attn.v_proj.weight"), vec![kv, h]));
            }
        }
        v.extend([
            (p("self_attn.o_proj.weight"), vec![h, q]),
            (p("self_attn.q_norm.weight"), vec![hd]),
        ]);
        if own {
            v.push((p("self_attn.k_norm.weight"), vec![hd]));
        }
        v.extend([
            (p("input_layernorm.weight"), vec![h]),
            (p("post_attention_layernorm.weight"), vec![h]),
            (p("pre_feedforward_layernorm.weight"), vec![h]),
            (p("post_feedforward_layernorm.weight"), vec![h]),
            (p("mlp.gate_proj.weight"), vec![width, h]),
            (p("mlp.up_proj.weight"), vec![width, h]),
            (p("mlp.down_proj.weight"), vec![h, width]),
        ]);
        let Some(g) = g4 else { continue };
        v.push((p("layer_scalar"), vec![1]));
        if g.per_layer_input_size > 0 {
            let ps = g.per_layer_input_size;
            v.extend([
                (p("per_layer_input_gate.weight"), vec![ps, h]),
                (p("per_layer_projection.weight"), vec![h, ps]),
                (p("post_per_layer_input_norm.weight"), vec![h]),
            ]);
        }
        if let Some(m) = &g.moe {
            v.extend([
                (p("router.proj.weight"), vec![m.experts, h]),
                (p("router.scale"), vec![h]),
                (p("router.per_expert_scale"), vec![m.experts]),
                (
                    p("experts.gate_up_proj"),
                    vec![m.experts, 2 * m.intermediate, h],
                ),
                (p("experts.down_proj"), vec![m.experts, h, m.intermediate]),
                (p("pre_feedforward_layernorm_2.weight"), vec![h]),
                (p("post_feedforward_layernorm_1.weight"), vec![h]),
                (p("post_feedforward_layernorm_2.weight"), vec![h]),
            ]);
        }
    }
    v
}

impl Checkpoint {
    /// Loads a `.gguf` file or an HF folder, by what `path` is; refuses, before converting
    /// anything, a model whose f32 weights would not fit in the host memory available now.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        Self::load_within(path, available_host_memory())
    }

    /// [`Self::load`] with `available` bytes of host memory (`None`: not checked).
    pub fn load_within(path: impl AsRef<Path>, available: Option<u64>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            Self::from_hf_dir_within(path, available)
        } else {
            Self::from_gguf_within(path, available)
        }
    }

    /// Loads and dequantises a Gemma 3 or Gemma 4 GGUF file (norms as stored: llama.cpp's
    /// converter writes Gemma 3's as `1 + w` and Gemma 4's, already multipliers, unchanged).
    pub fn from_gguf(path: &Path) -> Result<Self> {
        Self::from_gguf_within(path, available_host_memory())
    }

    fn from_gguf_within(path: &Path, available: Option<u64>) -> Result<Self> {
        let f = GgufFile::open(path)?;
        let config = GemmaConfig::from_gguf(&f)?;
        config.validate(path)?;
        // What the loop below allocates: every tensor as f32, and the quantised matrices' blocks.
        let need: u64 = f
            .tensors
            .iter()
            .filter(|t| gguf_to_hf(&t.name).is_some())
            .map(|t| {
                let quantised = !matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16)
                    && t.dims.len() == 2;
                let blocks = if quantised {
                    f.raw(t).map_or(0, <[u8]>::len)
                } else {
                    0
                };
                4 * t.elems() as u64 + blocks as u64
            })
            .sum();
        check_fits(path, need, available)?;
        let mut tensors = BTreeMap::new();
        let mut quantized = BTreeMap::new();
        for t in &f.tensors {
            let Some(name) = gguf_to_hf(&t.name) else {
                tracing::debug!(tensor = %t.name, "ignoring GGUF tensor with no Gemma 3 text role");
                continue;
            };
            let (shape, data) = f.tensor_f32(&t.name)?;
            let is_quant = !matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16);
            if is_quant && shape.len() == 2 {
                let q = QuantMatrix::new(t.ty, shape[0], shape[1], f.raw(t)?);
                quantized.extend(q.map(|q| (name.clone(), q)));
            }
            tensors.insert(name, HostTensor { shape, data });
        }
        let ck = Self {
            source: path.to_path_buf(),
            config,
            tensors,
            quantized,
        };
        ck.check_tensors()?;
        Ok(ck)
    }

    /// Loads an HF folder: `config.json` + `model.safetensors`, or shards listed in
    /// `model.safetensors.index.json`; f32, f16 or bf16.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        Self::from_hf_dir_within(dir, available_host_memory())
    }

    fn from_hf_dir_within(dir: &Path, available: Option<u64>) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text =
            std::fs::read_to_string(&cfg_path).map_err(|e| WeightsError::io(&cfg_path, e))?;
        let config = GemmaConfig::from_hf_json(&cfg_path, &text)?;
        config.validate(&cfg_path)?;
        let mut tensors = BTreeMap::new();
        // Gemma 3 stores norms as `w` for a `1 + w` multiplier; Gemma 4 stores the multiplier.
        let plus_one = config.gemma4.is_none();
        let files = safetensors_files(dir)?;
        let mut need = 0;
        for file in &files {
            need += f32_bytes_of(file, &hf_canonical)?;
        }
        check_fits(dir, need, available)?;
        for file in files {
            read_safetensors(&file, plus_one, &mut tensors)?;
        }
        let ck = Self {
            source: dir.to_path_buf(),
            config,
            tensors,
            quantized: BTreeMap::new(),
        };
        ck.check_tensors()?;
        Ok(ck)
    }

    /// Checks that every tensor the config implies is present with the right shape.
    pub fn check_tensors(&self) -> Result<()> {
        check_shapes(&self.source, &self.tensors, expected_tensors(&self.config))
    }

    /// Writes the checkpoint as an HF folder (`config.json` + `model.safetensors`, f32, norms
    /// as `w`). The folder is built under a temporary name and renamed when complete; an
    /// existing non-empty `out` is refused.
    pub fn write_hf_dir(&self, out: &Path) -> Result<()> {
        write_dir_atomically(out, |dir| self.write_hf_files(dir))
    }

    fn write_hf_files(&self, dir: &Path) -> Result<()> {
        if self.config.gemma4.is_some() {
            return Err(WeightsError::format(
                &self.source,
                "writing a Gemma 4 checkpoint as an HF folder is not supported",
            ));
        }
        let cfg =
            serde_json::to_string_pretty(&self.config.to_hf_json()).expect("config serialises");
        let cfg_path = dir.join("config.json");
        std::fs::write(&cfg_path, cfg).map_err(|e| WeightsError::io(&cfg_path, e))?;
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = self
            .tensors
            .iter()
            .map(|(name, t)| {
                let minus = if is_gemma_norm(name) { 1.0 } else { 0.0 };
                let raw = t
                    .data
                    .iter()
                    .flat_map(|v| (v - minus).to_le_bytes())
                    .collect();
                (name.clone(), t.shape.clone(), raw)
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
            .iter()
            .map(|(n, s, b)| {
                let view = safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b)
                    .expect("sizes agree");
                (n.clone(), view)
            })
            .collect();
        let st_path = dir.join("model.safetensors");
        let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(meta), &st_path)
            .map_err(|e| WeightsError::format(&st_path, format!("writing safetensors: {e}")))
    }
}

/// Checks that every `(name, shape)` in `expected` is in `tensors` with that shape; errors
/// name `source` and the tensor.
pub(crate) fn check_shapes(
    source: &Path,
    tensors: &BTreeMap<String, HostTensor>,
    expected: Vec<(String, Vec<usize>)>,
) -> Result<()> {
    for (name, shape) in expected {
        let t = tensors
            .get(&name)
            .ok_or_else(|| WeightsError::MissingTensor {
                path: source.to_path_buf(),
                tensor: name.clone(),
            })?;
        if t.shape != shape {
            return Err(WeightsError::Shape {
                path: source.to_path_buf(),
                tensor: name,
                got: t.shape.clone(),
                expected: shape,
            });
        }
    }
    Ok(())
}

/// Builds a folder with `fill` under a temporary sibling name, then renames it to `out`. An
/// existing non-empty `out` is refused; on failure the temporary folder is removed.
pub fn write_dir_atomically(out: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    if out.exists()
        && std::fs::read_dir(out)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        return Err(WeightsError::format(
            out,
            "output folder exists and is not empty",
        ));
    }
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let tmp = out.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let result = std::fs::create_dir_all(&tmp)
        .map_err(|e| WeightsError::io(&tmp, e))
        .and_then(|()| fill(&tmp))
        .and_then(|()| {
            if out.exists() {
                std::fs::remove_dir(out).map_err(|e| WeightsError::io(out, e))?;
            }
            std::fs::rename(&tmp, out).map_err(|e| WeightsError::io(out, e))
        });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// The safetensors files of an HF folder.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).map_err(|e| {
        WeightsError::format(
            dir,
            format!("no model.safetensors and no readable model.safetensors.index.json ({e})"),
        )
    })?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| WeightsError::format(&index, format!("invalid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| WeightsError::MissingField {
            path: index.clone(),
            field: "weight_map".into(),
        })?;
    let mut files: Vec<PathBuf> = map
        .values()
        .filter_map(|f| f.as_str())
        .map(|f| dir.join(f))
        .collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// Reads one safetensors file into `out` (canonical names, f32, norms as multipliers: `1 + w`
/// where `plus_one`, Gemma 3's convention).
fn read_safetensors(
    path: &Path,
    plus_one: bool,
    out: &mut BTreeMap<String, HostTensor>,
) -> Result<()> {
    let mut read = BTreeMap::new();
    read_safetensors_as(path, &hf_canonical, &mut read)?;
    for (name, mut t) in read {
        if plus_one && is_gemma_norm(&name) {
            t.data.iter_mut().for_each(|v| *v += 1.0);
        }
        out.insert(name, t);
    }
    Ok(())
}

/// Bytes the tensors of one safetensors file that `rename` keeps take as f32.
fn f32_bytes_of(path: &Path, rename: &dyn Fn(&str) -> Option<String>) -> Result<u64> {
    let bytes = Mapped::open(path)?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| WeightsError::format(path, format!("invalid safetensors: {e}")))?;
    Ok(st
        .tensors()
        .iter()
        .filter(|(name, _)| rename(name).is_some())
        .map(|(_, v)| 4 * v.shape().iter().product::<usize>() as u64)
        .sum())
}

/// Writes f32 tensors to one safetensors file (not atomically: write into a folder that
/// [`write_dir_atomically`] renames into place).
pub fn write_safetensors_f32(path: &Path, tensors: &BTreeMap<String, HostTensor>) -> Result<()> {
    let bytes: Vec<(&String, &HostTensor, Vec<u8>)> = tensors
        .iter()
        .map(|(n, t)| (n, t, t.data.iter().flat_map(|v| v.to_le_bytes()).collect()))
        .collect();
    let mut views = Vec::with_capacity(bytes.len());
    for (n, t, b) in &bytes {
        let view = safetensors::tensor::TensorView::new(Dtype::F32, t.shape.clone(), b)
            .map_err(|e| WeightsError::format(path, format!("tensor `{n}`: {e}")))?;
        views.push(((*n).clone(), view));
    }
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| WeightsError::format(path, format!("writing safetensors: {e}")))
}

/// Reads the floating-point tensors of one safetensors file whose names `rename` maps to
/// `Some(name)` into `out`, as f32 under the new name (values as stored).
pub fn read_safetensors_as(
    path: &Path,
    rename: &dyn Fn(&str) -> Option<String>,
    out: &mut BTreeMap<String, HostTensor>,
) -> Result<()> {
    let bytes = Mapped::open(path)?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| WeightsError::format(path, format!("invalid safetensors: {e}")))?;
    for (name, view) in st.tensors() {
        let Some(canon) = rename(&name) else {
            continue;
        };
        let raw = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => raw
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => raw
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(WeightsError::format(
                    path,
                    format!(
                        "tensor `{name}` has dtype {other:?}; only F32, F16, BF16 are supported"
                    ),
                ));
            }
        };
        out.insert(
            canon,
            HostTensor {
                shape: view.shape().to_vec(),
                data,
            },
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests;
