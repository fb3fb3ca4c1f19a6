use super::*;

#[test]
fn a_model_that_does_not_fit_is_refused_before_converting() {
    // The tiny Gemma 4 as an HF folder and as llama.cpp's GGUF: ~250k parameters, ~1 MB.
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gemma4/dense");
    for path in [dir.clone(), dir.join("model-f32.gguf")] {
        let e = Checkpoint::load_within(&path, Some(500_000))
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not fit in host memory"), "{e}");
        assert!(
            e.contains(&path.display().to_string()),
            "names the model: {e}"
        );
        let ck = Checkpoint::load_within(&path, Some(2_000_000)).unwrap();
        assert_eq!(ck.config.num_hidden_layers, 6);
    }
}

#[test]
fn remap_covers_layers_and_globals() {
    assert_eq!(
        gguf_to_hf("blk.17.ffn_norm.weight").unwrap(),
        "model.layers.17.pre_feedforward_layernorm.weight"
    );
    assert_eq!(
        gguf_to_hf("token_embd.weight").unwrap(),
        "model.embed_tokens.weight"
    );
    assert_eq!(gguf_to_hf("blk.x.attn_q.weight"), None);
    assert_eq!(
        hf_canonical("language_model.model.norm.weight").unwrap(),
        "model.norm.weight"
    );
    assert_eq!(
        hf_canonical("model.language_model.layers.0.mlp.up_proj.weight").unwrap(),
        "model.layers.0.mlp.up_proj.weight"
    );
    assert_eq!(hf_canonical("vision_tower.x"), None);
}

#[test]
fn safetensors_header_past_the_end_is_an_error() {
    let dir = std::env::temp_dir().join(format!("kakeya-st-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    let header = br#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header);
    b.extend_from_slice(&[0u8; 8]); // only 8 of the 16 bytes
    std::fs::write(&path, &b).unwrap();
    let e = read_safetensors(&path, true, &mut BTreeMap::new())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("invalid safetensors"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
