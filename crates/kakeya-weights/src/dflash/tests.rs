use super::*;

#[test]
fn default_layers_round_half_to_even() {
    // z-lab's Qwen3-8B drafter: 36 target layers, 5 draft layers → [1, 9, 17, 25, 33].
    assert_eq!(default_target_layers(36, 5), vec![1, 9, 17, 25, 33]);
    // Gemma 3 270M (18 layers), 4 draft layers: 1 + i·14/3 = 1, 5.67, 10.33, 15.
    assert_eq!(default_target_layers(18, 4), vec![1, 6, 10, 15]);
    // A tie: T = 10, D = 5 → 1 + i·1.5 = 1, 2.5, 4, 5.5, 7 → 2.5 → 2 and 5.5 → 6.
    assert_eq!(default_target_layers(10, 5), vec![1, 2, 4, 6, 7]);
    assert_eq!(default_target_layers(18, 1), vec![9]);
}

#[test]
fn config_round_trips_and_names_missing_fields() {
    let cfg = DFlashConfig {
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        vocab_size: 97,
        max_position_embeddings: 512,
        block_size: 4,
        mask_token_id: 3,
        target_layer_ids: vec![1, 3],
        num_target_layers: 6,
        draft_vocab_size: Some(40),
        layer_windows: vec![Some(16), None],
    };
    let p = Path::new("x/config.json");
    let text = cfg.to_json().to_string();
    assert_eq!(DFlashConfig::from_json(p, &text).unwrap(), cfg);
    let mut v = cfg.to_json();
    v["dflash_config"]
        .as_object_mut()
        .unwrap()
        .remove("mask_token_id");
    let err = DFlashConfig::from_json(p, &v.to_string())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("x/config.json") && err.contains("mask_token_id"),
        "{err}"
    );
}

/// The shape of z-lab's drafter for Gemma 4 26B-A4B (`z-lab/gemma-4-26B-A4B-it-DFlash`,
/// its config as third-party ports quote it — not downloaded here): four sliding layers of
/// 2048 and a full one, block 16, six target layers; later exports move `block_size` into
/// `dflash_config` and RoPE into `rope_parameters`.
#[test]
fn z_labs_gemma4_drafter_config_is_read() {
    let text = r#"{"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": 2816, "num_hidden_layers": 5, "intermediate_size": 5632,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 262144, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "max_position_embeddings": 262144, "block_size": 16, "num_target_layers": 30,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                        "sliding_attention", "full_attention"],
        "sliding_window": 2048, "tie_word_embeddings": false,
        "dflash_config": {"target_layer_ids": [1, 6, 11, 17, 22, 27], "mask_token_id": 4}}"#;
    let p = Path::new("d/config.json");
    let c = DFlashConfig::from_json(p, text).unwrap();
    assert_eq!(
        c.layer_windows,
        vec![Some(2048), Some(2048), Some(2048), Some(2048), None]
    );
    assert_eq!((c.block_size, c.head_dim, c.mask_token_id), (16, 128, 4));
    assert_eq!(c.target_layer_ids, vec![1, 6, 11, 17, 22, 27]);
    // The later export: block size in dflash_config, RoPE under rope_parameters.
    let mut v: Value = serde_json::from_str(text).unwrap();
    let top = v.as_object_mut().unwrap();
    let block = top.remove("block_size").unwrap();
    top.remove("rope_theta");
    top.insert(
        "rope_parameters".into(),
        json!({"rope_type": "default", "rope_theta": 1e6}),
    );
    v["dflash_config"]["block_size"] = block;
    assert_eq!(DFlashConfig::from_json(p, &v.to_string()).unwrap(), c);
    // Sliding layers without a window, or a layer count that disagrees: refused.
    let bad = |f: &dyn Fn(&mut Value)| {
        let mut v: Value = serde_json::from_str(text).unwrap();
        f(&mut v);
        DFlashConfig::from_json(p, &v.to_string())
            .unwrap_err()
            .to_string()
    };
    let e = bad(&|v| {
        v.as_object_mut().unwrap().remove("sliding_window");
    });
    assert!(
        e.contains("sliding_window is not a positive integer"),
        "{e}"
    );
    let e = bad(&|v| v["num_hidden_layers"] = json!(4));
    assert!(
        e.contains("layer_types has 5 entries but num_hidden_layers is 4"),
        "{e}"
    );
    let e = bad(&|v| v["layer_types"][0] = json!("chunked_attention"));
    assert!(e.contains("unknown drafter layer type"), "{e}");
}
