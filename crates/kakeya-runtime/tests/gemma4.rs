//! Gemma 4 text models against transformers: tiny random checkpoints written by
//! `tests/fixtures/gemma4/make_gemma4.py` (transformers' Gemma4ForCausalLM, eager, f32) with
//! its logits at every prompt position and its 16-token greedy continuation.

mod common;

use burn::tensor::{Device, Tensor};
use kakeya_models::LayerCache;
use kakeya_models::{ForwardRequest, GemmaModel, Logits};
use kakeya_runtime::{KvCache, KvDtype, KvMode, KvPolicy, KvSetup, Session};
use kakeya_weights::Checkpoint;
use serde_json::Value;

/// Largest absolute logit difference allowed against transformers (f32 both sides).
const TOL: f32 = 1e-4;

fn fixtures() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gemma4")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("gemma4.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Where a fixture is read from: its HF folder, or the GGUF llama.cpp's converter made of it
/// (`make_gemma4_gguf.py`).
#[derive(Clone, Copy, Debug)]
enum Source {
    Hf,
    Gguf,
}

fn checkpoint(name: &str, src: Source) -> Checkpoint {
    let dir = fixtures().join(name);
    match src {
        Source::Hf => Checkpoint::load(&dir),
        Source::Gguf => Checkpoint::load(dir.join("model-f32.gguf")),
    }
    .unwrap()
}

fn load(name: &str) -> GemmaModel {
    load_from(name, Source::Hf)
}

fn load_from(name: &str, src: Source) -> GemmaModel {
    GemmaModel::from_checkpoint(checkpoint(name, src), &Device::flex()).unwrap()
}

fn rows(t: Tensor<2>) -> Vec<Vec<f32>> {
    let [n, v] = t.dims();
    let flat = t.into_data().try_into_vec::<f32>().unwrap();
    (0..n).map(|i| flat[i * v..(i + 1) * v].to_vec()).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Logits at every position match transformers'; the greedy continuation (prefill, then one
/// cached step per token) is transformers'; and each cached step's logits equal one full
/// forward's over the same tokens.
fn matches_transformers(name: &str) {
    matches_transformers_from(name, Source::Hf);
}

fn matches_transformers_from(name: &str, src: Source) {
    let name_src = format!("{name} ({src:?})");
    let name = name_src.as_str();
    let r = reference();
    let prompt = ids(&r["prompt"]);
    let want = &r["configs"][name.split(' ').next().unwrap()];
    let m = load_from(name.split(' ').next().unwrap(), src);
    let mut caches = KvCache::for_specs(&m.cache_specs(), 0, KvDtype::F32);
    let got = rows(
        m.forward(&ForwardRequest::new(&prompt, 0, Logits::All), &mut caches)
            .unwrap()
            .logits
            .unwrap(),
    );
    // The layers that read another's K/V hold none.
    for (i, c) in caches.iter().enumerate() {
        let shares = m.config.kv_source(i).is_some();
        assert_eq!(c.nbytes() == 0, shares, "{name}: layer {i}'s cache");
    }
    assert_eq!(got.len(), prompt.len(), "{name}: one row per position");
    assert_eq!(got[0].len(), m.config.vocab_size);
    for (i, (g, w)) in got
        .iter()
        .zip(want["logits"].as_array().unwrap())
        .enumerate()
    {
        let w: Vec<f32> = w
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let d = max_diff(g, &w);
        assert!(d <= TOL, "{name}: position {i}: max |Δlogit| {d} > {TOL}");
    }
    // f32 K/V throughout: this compares with transformers' f32 numbers.
    let f32_kv = KvPolicy {
        dtype: KvDtype::F32,
        ..KvPolicy::new(KvMode::Full)
    };
    let mut s = Session::with_kv(&m, KvSetup::new(f32_kv)).unwrap();
    let mut row = s.run(&prompt, 5).unwrap();
    let mut seq = prompt.clone();
    let mut generated = Vec::new();
    for _ in 0..want["greedy"].as_array().unwrap().len() {
        let next = kakeya_kernels::argmax::first_max(&row).unwrap() as u32;
        generated.push(next);
        seq.push(next);
        let full = {
            let mut c = KvCache::for_specs(&m.cache_specs(), 0, KvDtype::F32);
            rows(
                m.forward(&ForwardRequest::new(&seq, 0, Logits::Last), &mut c)
                    .unwrap()
                    .logits
                    .unwrap(),
            )
        };
        row = s.run(&[next], 1).unwrap();
        let d = max_diff(&row, &full[0]);
        assert!(
            d <= TOL,
            "{name}: cached step at {}: max |Δ| {d} against a full forward",
            seq.len()
        );
    }
    assert_eq!(
        generated,
        ids(&want["greedy"]),
        "{name}: greedy continuation"
    );
}

#[test]
fn dense_gemma4_matches_transformers() {
    matches_transformers("dense");
}

#[test]
fn moe_gemma4_matches_transformers() {
    matches_transformers("moe");
}

#[test]
fn dense_gemma4_without_k_eq_v_matches_transformers() {
    matches_transformers("dense-kv");
}

/// A tiny DFlash drafter (random weights) on a Gemma 4 verifier: speculative decoding over
/// several prompts and block sizes gives exactly plain greedy decoding's tokens — with KV
/// sharing, k_eq_v, per-layer inputs and a sliding window of 4 that the rings wrap.
/// llama.cpp's converter output reads back as the same model: every config field and tensor
/// equals the HF folder's (its norms are Gemma 4's plain multipliers, its per-layer arrays,
/// `rope_freqs` and missing `attn_v` give the same geometry), and the logits match
/// transformers'.
#[test]
fn gemma4_gguf_from_llama_cpp_is_the_same_model() {
    for name in ["dense", "dense-kv", "moe"] {
        let (hf, mut gguf) = (checkpoint(name, Source::Hf), checkpoint(name, Source::Gguf));
        // GGUF stores the epsilon as an f32.
        let eps = |c: &Checkpoint| c.config.rms_norm_eps as f32;
        assert_eq!(eps(&gguf), eps(&hf), "{name}: epsilon");
        gguf.config.rms_norm_eps = hf.config.rms_norm_eps;
        assert_eq!(gguf.config, hf.config, "{name}: config");
        let names = |c: &Checkpoint| c.tensors.keys().cloned().collect::<Vec<_>>();
        assert_eq!(names(&gguf), names(&hf), "{name}: tensor names");
        for (t, want) in &hf.tensors {
            assert_eq!(&gguf.tensors[t], want, "{name}: {t}");
        }
        matches_transformers_from(name, Source::Gguf);
    }
}

#[test]
fn speculation_on_gemma4_equals_greedy_decoding() {
    use kakeya_models::DFlashDrafter;
    use kakeya_models::testing::{drafter_config, random_drafter};
    use kakeya_runtime::{
        DFlashProposer, GenerationConfig, KvSetup, SpecConfig, Verifier, generate,
        speculative_generate,
    };
    let v = load("dense");
    let cfg = GenerationConfig::greedy(30, 0);
    for block in [4, 8] {
        let d = DFlashDrafter::from_checkpoint(
            random_drafter(&drafter_config(&v.config, 2, block), 3 + block as u64),
            &v,
        )
        .unwrap();
        for i in 0..6u32 {
            let p: Vec<u32> = (0..3 + 2 * i)
                .map(|j| (j * 37 + i * 11 + 5) % 128)
                .collect();
            let want = generate(&mut Session::new(&v, 0), &p, &cfg, &mut |_| {})
                .unwrap()
                .tokens;
            let mut ver = Verifier::new(&v, KvSetup::full(0).drafter(&d), block).unwrap();
            let got = speculative_generate(
                &mut ver,
                &mut DFlashProposer::new(&d),
                &p,
                &cfg,
                SpecConfig::fixed(block),
                &mut |_| {},
            )
            .unwrap();
            assert_eq!(got.tokens, want, "block {block}, prompt {i}");
            assert!(got.spec.unwrap().blocks > 0);
        }
    }
}

/// Lossless speculation rests on this: a verify block's rows are bit for bit the logits of
/// single decode steps (the dense f32 weights through the row-order kernel, attention one row
/// at a time over exactly its keys).
#[test]
fn a_blocks_rows_equal_single_steps_bit_for_bit() {
    for name in ["dense", "dense-kv", "moe"] {
        for src in [Source::Hf, Source::Gguf] {
            common::assert_blocks_equal_steps(&load_from(name, src), &format!("{name} ({src:?})"));
        }
    }
}

/// Chat on a Gemma 4 model is refused with the reason (its turns are its tokenizer's own
/// template, not the Gemma 3 one built in), not rendered wrongly; Gemma 3 passes.
#[test]
fn chat_on_gemma4_is_refused_not_formatted_with_gemma3s_template() {
    use kakeya_runtime::chat::{ChatError, check_template};
    let e = check_template(&load("dense").config).unwrap_err();
    assert_eq!(e, ChatError::OtherTemplate);
    assert!(
        e.to_string().contains("send the prompt already formatted"),
        "{e}"
    );
    let g3 = kakeya_models::testing::tiny_config(4);
    assert!(check_template(&g3).is_ok());
}

/// Bad Gemma 4 input fails with an error that names the problem, never a panic: a missing
/// Gemma 4-only tensor, a full layer's projection of a sliding layer's shape, and a drafter
/// made for another verifier (the tiny Gemma 3: another width and vocabulary).
#[test]
fn missing_or_misshapen_tensors_and_a_foreign_drafter_are_refused() {
    let mut ck = checkpoint("dense", Source::Hf);
    ck.tensors.remove("model.layers.3.layer_scalar").unwrap();
    let e = GemmaModel::from_checkpoint(ck, &Device::flex())
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.layers.3.layer_scalar"), "{e}");

    // Layer 2 is full (1 KV head × 32); give its k_proj a sliding layer's 2 × 16 rows of
    // another input width.
    let mut ck = checkpoint("dense", Source::Hf);
    let t = ck
        .tensors
        .get_mut("model.layers.2.self_attn.k_proj.weight")
        .unwrap();
    t.shape = vec![t.shape[0], t.shape[1] / 2];
    t.data.truncate(t.shape[0] * t.shape[1]);
    let e = GemmaModel::from_checkpoint(ck, &Device::flex())
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.layers.2.self_attn.k_proj.weight"), "{e}");

    let v = load("dense");
    let foreign =
        kakeya_models::testing::drafter_config(&kakeya_models::testing::tiny_config(8), 2, 4);
    let e = kakeya_models::DFlashDrafter::from_checkpoint(
        kakeya_models::testing::random_drafter(&foreign, 3),
        &v,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("hidden_size"), "{e}");
}
