//! On the real Gemma 3 270M: the captured K_raw of a sequence, pushed through k_norm and RoPE at
//! its positions, equals the keys the runtime caches for that sequence (every layer: all
//! positions for global layers, the ring's window for sliding ones).
//!
//! Needs the fetched model (`python3 scripts/fetch_default_model.py`): `#[ignore]`d, run by the
//! README's test command.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_capture::config::Dtype;
use kakeya_capture::schema::ModelInfo;
use kakeya_capture::{CaptureConfig, Dataset, Models, Query, RunOptions};
use kakeya_models::GemmaModel;
use kakeya_runtime::{KvDtype, KvPolicy, KvSetup, Session};
use kakeya_weights::{Checkpoint, Tokenizer};

/// f32 capture vs the runtime: the capture pass runs in chunks of 256, the session in one
/// prefill of 512 (different matmul shapes), so values agree to f32 summation noise.
const TOL: f32 = 1e-3;

#[test]
#[ignore = "needs the fetched Gemma 3 270M (scripts/fetch_default_model.py)"]
fn captured_raw_keys_become_the_runtime_keys() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let gguf = root.join("models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf");
    let ck = Checkpoint::load(&gguf).expect("fetched model");
    let tok = Tokenizer::load(
        &root.join("models/gemma-3-270m/tokenizer.json"),
        ck.config.vocab_size,
    )
    .unwrap();
    let v = GemmaModel::from_checkpoint(ck, &Device::flex()).unwrap();
    let dir = std::env::temp_dir().join(format!("kakeya-real-keys-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let prompts = dir.join("p.jsonl");
    // ~560 tokens: past the 512-token sliding window.
    let text: String = (0..40)
        .map(|i| format!("Line {i}: the river flows past the mill and the old bridge.\n"))
        .collect();
    std::fs::write(
        &prompts,
        serde_json::json!({"text": text}).to_string() + "\n",
    )
    .unwrap();
    let cfg: CaptureConfig = toml::from_str(&format!(
        "[model]\nverifier = \"x\"\n[output]\ndir = \"{}\"\ndtype = \"f32\"\n[generation]\ngen_len = 8\nmax_prompt_tokens = 1024\nchunk = 256\n[tensors]\nverifier = [\"k_raw\"]\n[[sources]]\nkind = \"jsonl\"\npath = \"{}\"\n",
        dir.join("ds").display(),
        prompts.display()
    ))
    .unwrap();
    assert_eq!(cfg.output.dtype, Dtype::F32);
    let info = ModelInfo {
        path: gguf.clone(),
        sha256: String::new(),
    };
    let models = Models {
        verifier: &v,
        tokenizer: &tok,
        drafter: None,
        verifier_info: info.clone(),
        tokenizer_info: info,
        drafter_info: None,
    };
    kakeya_capture::run(
        &cfg,
        Path::new("cfg"),
        &models,
        RunOptions {
            shard: (0, 1),
            resume: false,
        },
        &mut |_| {},
    )
    .unwrap();
    let ds = Dataset::open(&dir.join("ds")).unwrap();
    let names: Vec<String> = (0..v.layers.len())
        .map(|l| format!("v{l:02}_k_raw"))
        .collect();
    let b = ds
        .read(&Query {
            columns: names,
            ..Query::default()
        })
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    let n = b.token.len();
    assert!(n > 520, "sequence of {n} tokens crosses the window");
    // The capture's f32 keys against f32 caches (the default 16-bit caches round them).
    let policy = KvPolicy {
        dtype: KvDtype::F32,
        ..KvPolicy::default()
    };
    let mut s = Session::with_kv(&v, KvSetup::new(policy)).unwrap();
    s.run(&b.token, 512).unwrap();
    let device = Device::flex();
    let mut worst = 0.0f32;
    for (l, layer) in v.layers.iter().enumerate() {
        let held = s.kv().native(l).unwrap().held().unwrap();
        let (_, dim, raw) = &b.columns[l];
        let k_raw = Tensor::<2>::from_data(TensorData::new(raw.clone(), [n, *dim]), &device);
        let keys = layer
            .attn
            .keys_from_raw(k_raw, &(0..n).collect::<Vec<_>>(), &device);
        let [h, _, d] = keys.dims();
        let first = held.positions[0];
        let want = held.k.into_data().try_into_vec::<f32>().unwrap();
        let got = keys
            .slice([0..h, first..n, 0..d])
            .into_data()
            .try_into_vec::<f32>()
            .unwrap();
        assert_eq!(got.len(), want.len(), "layer {l}");
        let diff = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(diff <= TOL, "layer {l}: max |Δ| {diff}");
        worst = worst.max(diff);
    }
    eprintln!("max |captured→keys − cached keys| over 18 layers: {worst:.2e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
