//! HF folders: a single f32 file, and the same weights as two shards (f16 and bf16) with a
//! `model.safetensors.index.json`, load to the same canonical checkpoint.

use std::collections::HashMap;
use std::path::PathBuf;

use kakeya_models::testing::{random_checkpoint, tiny_config};
use kakeya_weights::Checkpoint;
use kakeya_weights::checkpoint::is_gemma_norm;
use safetensors::Dtype;
use safetensors::tensor::TensorView;

/// Tensors of one shard file: (name, shape, little-endian bytes).
type Shard = Vec<(String, Vec<usize>, Vec<u8>)>;

fn scratch(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("kakeya-hf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

#[test]
fn single_and_sharded_half_precision_folders_load_the_same_model() {
    let ck = random_checkpoint(&tiny_config(4), 5);
    let single = scratch("single");
    ck.write_hf_dir(&single).unwrap();
    let back = Checkpoint::load(&single).unwrap();
    assert_eq!(back.config, ck.config);
    for (name, t) in &ck.tensors {
        assert_eq!(
            &back.tensors[name], t,
            "{name} round-trips exactly through an f32 folder"
        );
    }

    // Shards: embedding and norms in f16 (file 1), everything else in bf16 (file 2).
    let sharded = scratch("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    std::fs::copy(single.join("config.json"), sharded.join("config.json")).unwrap();
    let mut weight_map = serde_json::Map::new();
    let mut files: HashMap<&str, Shard> = HashMap::new();
    for (name, t) in &ck.tensors {
        let stored: Vec<f32> = t
            .data
            .iter()
            .map(|v| if is_gemma_norm(name) { v - 1.0 } else { *v })
            .collect();
        let (file, bytes): (&str, Vec<u8>) = if name.contains("embed") || is_gemma_norm(name) {
            (
                "model-00001-of-00002.safetensors",
                stored
                    .iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                    .collect(),
            )
        } else {
            (
                "model-00002-of-00002.safetensors",
                stored
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect(),
            )
        };
        weight_map.insert(name.clone(), file.into());
        files
            .entry(file)
            .or_default()
            .push((name.clone(), t.shape.clone(), bytes));
    }
    for (file, tensors) in &files {
        let dtype = if file.contains("00001") {
            Dtype::F16
        } else {
            Dtype::BF16
        };
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, s, b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &sharded.join(file)).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();

    let half = Checkpoint::load(&sharded).unwrap();
    for (name, t) in &ck.tensors {
        let got = &half.tensors[name];
        assert_eq!(got.shape, t.shape);
        // Rounding to nearest: bf16 keeps 8 significant bits, so the error is at most 2^-8 of
        // the stored `w`; f16 keeps 11 (2^-11), and below its normal range (2^-14) its
        // subnormal spacing 2^-24 bounds the error by 2^-25.
        let f16_shard = name.contains("embed") || is_gemma_norm(name);
        let (rel, abs) = if f16_shard {
            (2f32.powi(-11), 2f32.powi(-25))
        } else {
            (2f32.powi(-8), 0.0)
        };
        for (a, b) in got.data.iter().zip(&t.data) {
            // A norm's loaded value is the stored `w` + 1 in f32: one more rounding, ≤ 2^-24 |b|.
            let (w, add) = if is_gemma_norm(name) {
                (b - 1.0, b.abs() * 2f32.powi(-24))
            } else {
                (*b, 0.0)
            };
            assert!(
                (a - b).abs() <= w.abs() * rel + abs + add,
                "{name}: {a} vs {b} (stored {})",
                if f16_shard { "f16" } else { "bf16" }
            );
        }
    }
    std::fs::remove_dir_all(&single).unwrap();
    std::fs::remove_dir_all(&sharded).unwrap();
}
