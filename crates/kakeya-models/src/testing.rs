//! Tiny random-weight checkpoints for tests (deterministic, no RNG dependency).

use std::collections::BTreeMap;

use kakeya_kernels::QuantMatrix;
use kakeya_kernels::dequant::{GgmlType, dequantize};
use kakeya_weights::checkpoint::{expected_tensors, is_gemma_norm};
use kakeya_weights::ftheta::{FTHETA_FORMAT, FTHETA_VERSION, FThetaInputs, ModelRef};
use kakeya_weights::{
    AttentionKind, Checkpoint, DFlashConfig, DraftCheckpoint, FThetaConfig, GemmaConfig, HostTensor,
};

/// The device tests run on: the CPU, or with the `wgpu` (`cuda`) feature and
/// `KAKEYA_TEST_DEVICE=wgpu` (`cuda`) that device (scripts/test_wgpu.sh runs the trainer tests
/// on Mesa's lavapipe; scripts/device/ runs the real-model golden test on a lent NVIDIA GPU).
pub fn test_device() -> burn::tensor::Device {
    let wanted = std::env::var("KAKEYA_TEST_DEVICE").unwrap_or_default();
    #[cfg(feature = "wgpu")]
    if wanted == "wgpu" {
        return burn::tensor::Device::wgpu(Default::default());
    }
    #[cfg(feature = "cuda")]
    if wanted == "cuda" {
        return burn::tensor::Device::cuda(0);
    }
    assert!(
        wanted.is_empty() || wanted == "cpu",
        "KAKEYA_TEST_DEVICE={wanted}: this test binary was built without that device's feature"
    );
    burn::tensor::Device::flex()
}

/// A small Gemma 3 config: 6 layers (layer 5 global), window `window`.
pub fn tiny_config(window: usize) -> GemmaConfig {
    GemmaConfig {
        vocab_size: 97,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 6,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        rope_local_base_freq: 10_000.0,
        rope_scaling_factor: 1.0,
        sliding_window: window,
        query_pre_attn_scalar: 16.0,
        max_position_embeddings: 512,
        final_logit_softcapping: None,
        layer_types: (0..6)
            .map(|i| {
                if i == 5 {
                    AttentionKind::Full
                } else {
                    AttentionKind::Sliding
                }
            })
            .collect(),
        gemma4: None,
    }
}

/// Uniform values in `[-scale, scale)` from a splitmix64 stream (`seed` advances).
pub fn values(n: usize, seed: &mut u64, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = *seed;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A random checkpoint for `config` (norm multipliers near 1, weights ~ U(±0.2)).
pub fn random_checkpoint(config: &GemmaConfig, seed: u64) -> Checkpoint {
    let mut s = seed;
    let mut tensors = BTreeMap::new();
    for (name, shape) in expected_tensors(config) {
        let n = shape.iter().product();
        let mut data = values(n, &mut s, if is_gemma_norm(&name) { 0.1 } else { 0.2 });
        if is_gemma_norm(&name) {
            data.iter_mut().for_each(|v| *v += 1.0);
        }
        tensors.insert(name, HostTensor { shape, data });
    }
    Checkpoint {
        source: "random".into(),
        config: config.clone(),
        tensors,
        quantized: BTreeMap::new(),
    }
}

/// [`random_checkpoint`] with every linear map (projections and the tied embedding/head)
/// also held as Q8_0 blocks, the dense values being the blocks' exact dequantisation: on the
/// CPU the model then runs decode steps and small blocks through the batch-invariant block
/// kernel, as the real GGUF model does.
pub fn random_quantized_checkpoint(config: &GemmaConfig, seed: u64) -> Checkpoint {
    let mut ck = random_checkpoint(config, seed);
    for (name, t) in &mut ck.tensors {
        if t.shape.len() != 2 || !(name.ends_with("_proj.weight") || name.contains("embed_tokens"))
        {
            continue;
        }
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let bytes = q8_0_blocks(&t.data);
        t.data = dequantize(GgmlType::Q8_0, &bytes, rows * cols);
        let q = QuantMatrix::new(GgmlType::Q8_0, rows, cols, &bytes)
            .expect("tiny widths are multiples of 32");
        ck.quantized.insert(name.clone(), q);
    }
    ck
}

/// A `[rows, cols]` linear map (`cols` a multiple of 32) of seeded values ~ U(±`scale`) held
/// as Q8_0 blocks on the CPU: the block kernel and the certified argmax apply to it, and
/// [`crate::linear::Linear::dense_weight`] rebuilds their exact dequantisation.
pub fn random_q8_0_linear(
    rows: usize,
    cols: usize,
    scale: f32,
    seed: u64,
) -> crate::linear::Linear {
    let mut s = seed;
    let bytes = q8_0_blocks(&values(rows * cols, &mut s, scale));
    let q = QuantMatrix::new(GgmlType::Q8_0, rows, cols, &bytes).expect("whole Q8_0 blocks");
    crate::linear::Linear::quant(q)
}

/// GGML Q8_0 blocks of `values` (32 per block: an f16 scale, then 32 int8).
fn q8_0_blocks(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / 32 * 34);
    for block in values.chunks(32) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = half::f16::from_f32(amax / 127.0);
        let inv = if d.to_f32() > 0.0 {
            1.0 / d.to_f32()
        } else {
            0.0
        };
        out.extend_from_slice(&d.to_bits().to_le_bytes());
        out.extend(
            block
                .iter()
                .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8),
        );
    }
    out
}

/// A drafter config fitting `verifier`: `layers` layers with the verifier's head layout,
/// `block_size`, default target layers, mask token 4.
pub fn drafter_config(verifier: &GemmaConfig, layers: usize, block_size: usize) -> DFlashConfig {
    DFlashConfig {
        hidden_size: verifier.hidden_size,
        intermediate_size: verifier.intermediate_size,
        num_hidden_layers: layers,
        num_attention_heads: verifier.num_attention_heads,
        num_key_value_heads: verifier.num_key_value_heads,
        head_dim: verifier.head_dim,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        vocab_size: verifier.vocab_size,
        max_position_embeddings: verifier.max_position_embeddings,
        block_size,
        mask_token_id: 4,
        target_layer_ids: kakeya_weights::dflash::default_target_layers(
            verifier.num_hidden_layers,
            layers,
        ),
        num_target_layers: verifier.num_hidden_layers,
        draft_vocab_size: None,
        layer_windows: vec![None; layers],
    }
}

/// A random drafter for `config` (norm weights near 1, weights ~ U(±0.2)); with
/// `config.draft_vocab_size = Some(n)`, the map sends draft id `i` to token `(7 i) % vocab`
/// made unique by taking the first `n` distinct values.
pub fn random_drafter(config: &DFlashConfig, seed: u64) -> DraftCheckpoint {
    let mut s = seed;
    let mut tensors = BTreeMap::new();
    for (name, shape) in config.expected_tensors() {
        let n = shape.iter().product();
        let is_norm = name.ends_with("norm.weight");
        let mut data = values(n, &mut s, if is_norm { 0.1 } else { 0.2 });
        if is_norm {
            data.iter_mut().for_each(|v| *v += 1.0);
        }
        tensors.insert(name, HostTensor { shape, data });
    }
    let d2t = config.draft_vocab_size.map(|n| {
        let mut seen = vec![false; config.vocab_size];
        let mut map = Vec::with_capacity(n);
        let mut i = 0usize;
        while map.len() < n {
            let t = (7 * i + 3) % config.vocab_size;
            if !seen[t] {
                seen[t] = true;
                map.push(t as u32);
            }
            i += 1;
        }
        map.sort_unstable();
        map
    });
    DraftCheckpoint {
        source: "random-drafter".into(),
        config: config.clone(),
        tensors,
        d2t,
    }
}

/// A word-level `tokenizer.json` with `n` tokens (`<pad>`, `<eos>`, `<bos>`, `<unk>`, `w4`,
/// `w5`, ...) split on whitespace: text `"w4 w5"` encodes to ids 4, 5.
pub fn word_level_tokenizer_json(n: usize) -> String {
    let mut vocab = Vec::with_capacity(n);
    for (i, name) in ["<pad>", "<eos>", "<bos>", "<unk>"].iter().enumerate() {
        vocab.push(format!("\"{name}\": {i}"));
    }
    for i in 4..n {
        vocab.push(format!("\"w{i}\": {i}"));
    }
    format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
"normalizer": null, "pre_tokenizer": {{"type": "Whitespace"}}, "post_processor": null,
"decoder": null, "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "<unk>"}}}}"#,
        vocab.join(", ")
    )
}

/// The tiny model the server tests serve, with its drafter, written into `dir`: `dir/m` (the
/// [`tiny_config`] model with window 16, weights of seed 3, the [`chat_tokenizer_json`]
/// tokenizer of 97 tokens) and `dir/d` (a random one-layer drafter for it, blocks of 4). Also
/// the model `kakeya serve`'s own cost per token is measured with (`examples/tiny_served_model`
/// of `kakeya-cli`): its forwards cost almost nothing.
pub fn write_tiny_served_model(
    dir: &std::path::Path,
) -> kakeya_weights::Result<(std::path::PathBuf, std::path::PathBuf)> {
    let (m, d) = (dir.join("m"), dir.join("d"));
    random_checkpoint(&tiny_config(16), 3).write_hf_dir(&m)?;
    let tokenizer = m.join("tokenizer.json");
    std::fs::write(&tokenizer, chat_tokenizer_json(97))
        .map_err(|e| kakeya_weights::WeightsError::io(&tokenizer, e))?;
    random_drafter(&drafter_config(&tiny_config(16), 1, 4), 5).write_dir(&d)?;
    Ok((m, d))
}

/// A `tokenizer.json` for chat tests on a tiny model: `n` tokens — `<pad>`, `<eos>`, `<bos>`,
/// `<unk>`, `w4`, the special `<start_of_turn>` (5) and `<end_of_turn>` (6), `user` (7),
/// `model` (8), then `w9`, `w10`, ... — split on whitespace, so Gemma's chat template
/// `"<start_of_turn>user\nw9 w10<end_of_turn>\n"` encodes to 5, 7, 9, 10, 6.
pub fn chat_tokenizer_json(n: usize) -> String {
    let names: Vec<String> = (0..n)
        .map(|i| match i {
            0 => "<pad>".into(),
            1 => "<eos>".into(),
            2 => "<bos>".into(),
            3 => "<unk>".into(),
            5 => "<start_of_turn>".into(),
            6 => "<end_of_turn>".into(),
            7 => "user".into(),
            8 => "model".into(),
            _ => format!("w{i}"),
        })
        .collect();
    let vocab: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, t)| format!("\"{t}\": {i}"))
        .collect();
    let added: Vec<String> = [0, 1, 2, 3, 5, 6]
        .iter()
        .map(|&i| added_token(i, &names[i]))
        .collect();
    format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [{}],
"normalizer": null, "pre_tokenizer": {{"type": "Whitespace"}}, "post_processor": null,
"decoder": null, "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "<unk>"}}}}"#,
        added.join(", "),
        vocab.join(", ")
    )
}

/// A byte-fallback BPE `tokenizer.json` of `n` (≥ 40) tokens, like Gemma's for characters it
/// has no token for: `<pad>`, `<eos>`, `<bos>`, `<unk>`, then the byte tokens of `€` (ids 4–6,
/// `<0xE2> <0x82> <0xAC>`), `é` (7–8) and `😀` (9–12), the letters `a`–`z` (13–38), space
/// (39), then more lead and continuation bytes of 2-byte characters. Decoding joins the bytes
/// back (`ByteFallback`, `Fuse`); an incomplete or invalid sequence decodes to U+FFFD.
pub fn byte_fallback_tokenizer_json(n: usize) -> String {
    let mut names: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"]
        .iter()
        .map(|t| t.to_string())
        .collect();
    for b in "€é😀".bytes() {
        names.push(format!("<0x{b:02X}>"));
    }
    names.extend(('a'..='z').map(String::from));
    names.push(" ".into());
    assert!(
        n >= names.len(),
        "a byte-fallback test tokenizer needs at least {} tokens",
        names.len()
    );
    // Fillers: more byte tokens — lead bytes of 2-byte characters (0xC4..) and continuation
    // bytes (0x81..) — so that random output often forms (and often breaks) characters.
    let mut leads = (0xC4u8..=0xDF).map(|b| format!("<0x{b:02X}>"));
    let mut conts = (0x81u8..=0xBF)
        .filter(|b| !"€é😀".bytes().any(|x| x == *b))
        .map(|b| format!("<0x{b:02X}>"));
    for i in names.len()..n {
        let next = if i % 3 == 0 {
            leads.next()
        } else {
            conts.next()
        };
        names.push(next.unwrap_or_else(|| format!("w{i}")));
    }
    let vocab: Vec<String> = names
        .iter()
        .enumerate()
        .map(|(i, t)| format!("\"{t}\": {i}"))
        .collect();
    let added: Vec<String> = (0..4).map(|i| added_token(i, &names[i])).collect();
    format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [{}],
"normalizer": null, "pre_tokenizer": null, "post_processor": null,
"decoder": {{"type": "Sequence", "decoders": [{{"type": "ByteFallback"}}, {{"type": "Fuse"}}]}},
"model": {{"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
"end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": true, "ignore_merges": false,
"vocab": {{{}}}, "merges": []}}}}"#,
        added.join(", "),
        vocab.join(", ")
    )
}

/// One special entry of a `tokenizer.json`'s `added_tokens`.
fn added_token(id: usize, content: &str) -> String {
    format!(
        r#"{{"id": {id}, "content": "{content}", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}}"#
    )
}

/// A fresh temporary folder `kakeya-{name}-{pid}` for a test, removed when dropped.
pub struct Scratch(pub std::path::PathBuf);

impl Scratch {
    /// Creates it (emptied if a previous run left it).
    pub fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("kakeya-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("temporary folder");
        Self(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An f_θ config for placeholder models (`v` / `d`, hashes `a` / `b`), with biases, recorded
/// loss `mse`: drafter layers `0..drafter_layers` of width `drafter_kv_dim` → `rank` codes →
/// `verifier_layers` rows of width `verifier_kv_dim`.
pub fn f_theta_config(
    drafter_layers: usize,
    drafter_kv_dim: usize,
    inputs: FThetaInputs,
    rank: usize,
    verifier_layers: usize,
    verifier_kv_dim: usize,
) -> FThetaConfig {
    let model = |path: &str, sha256: &str| ModelRef {
        path: path.into(),
        sha256: sha256.into(),
    };
    FThetaConfig {
        format: FTHETA_FORMAT.into(),
        version: FTHETA_VERSION,
        verifier: model("v", "a"),
        drafter: model("d", "b"),
        drafter_layers: (0..drafter_layers).collect(),
        drafter_kv_dim,
        inputs,
        rank,
        verifier_layers,
        verifier_kv_dim,
        verifier_kv_dims: Vec::new(),
        bias: true,
        loss: "mse".into(),
    }
}

/// A random f_θ checkpoint for `config` (weights ~ U(±0.2), biases ~ U(±0.05)).
pub fn random_f_theta(config: &FThetaConfig, seed: u64) -> kakeya_weights::FThetaCheckpoint {
    let mut s = seed;
    let tensors = config
        .expected_tensors()
        .into_iter()
        .map(|(name, shape)| {
            let n = shape.iter().product();
            let scale = if name.ends_with(".bias") { 0.05 } else { 0.2 };
            (
                name,
                HostTensor {
                    shape,
                    data: values(n, &mut s, scale),
                },
            )
        })
        .collect();
    kakeya_weights::FThetaCheckpoint {
        config: config.clone(),
        tensors,
    }
}
