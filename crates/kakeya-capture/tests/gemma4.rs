//! Capture on Gemma 4 (transformers' tiny dense model, tests/fixtures/gemma4/dense): attention
//! tensors of a sliding and a full layer (different widths), hidden states and the drafter's
//! K/V read back equal to one forward of the sequence; "all" layers skips the KV-sharing
//! layers, and naming one is refused.

use std::path::Path;

use burn::tensor::Tensor;
use kakeya_capture::schema::ModelInfo;
use kakeya_capture::{CaptureConfig, Dataset, Models, Query, RunOptions};
use kakeya_models::testing::{Scratch, drafter_config, random_drafter, word_level_tokenizer_json};
use kakeya_models::{DFlashDrafter, ForwardRequest, GemmaModel, Logits};
use kakeya_runtime::KvCache;
use kakeya_weights::{Checkpoint, Tokenizer};

fn info() -> ModelInfo {
    ModelInfo {
        path: "tiny".into(),
        sha256: "0".repeat(64),
    }
}

fn config(out: &Path, prompts: &Path, layers: &str) -> CaptureConfig {
    let text = format!(
        r#"
[model]
verifier = "unused"
drafter = "unused"
[output]
dir = "{}"
dtype = "f32"
sequences_per_shard = 2
[generation]
gen_len = 6
max_prompt_tokens = 64
chunk = 5
[tensors]
verifier = ["q_raw", "k_raw", "v_raw", "attn_out"]
verifier_layers = {layers}
aux_layers = [1, 3]
drafter_kv = true
[[sources]]
kind = "jsonl"
path = "{}"
"#,
        out.display(),
        prompts.display()
    );
    toml::from_str(&text).unwrap()
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_into_vec::<f32>().unwrap()
}

#[test]
fn gemma4_capture_reads_back_what_the_model_computes() {
    let s = Scratch::new("cap-g4");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let ck = Checkpoint::load(root.join("tests/fixtures/gemma4/dense")).unwrap();
    // On the test device (scripts/test_wgpu.sh: wgpu).
    let v = GemmaModel::from_checkpoint(ck, &kakeya_models::testing::test_device()).unwrap();
    let vocab = v.config.vocab_size;
    std::fs::write(s.0.join("tokenizer.json"), word_level_tokenizer_json(vocab)).unwrap();
    let tok = Tokenizer::load(&s.0.join("tokenizer.json"), vocab).unwrap();
    let d = DFlashDrafter::from_checkpoint(random_drafter(&drafter_config(&v.config, 2, 4), 2), &v)
        .unwrap();
    let models = Models {
        verifier: &v,
        tokenizer: &tok,
        drafter: Some(&d),
        verifier_info: info(),
        tokenizer_info: info(),
        drafter_info: Some(info()),
    };
    let prompts = s.0.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"text\": \"w4 w5 w6 w7 w8 w9 w10 w11 w12\"}\n{\"text\": \"w30 w31 w32\"}\n",
    )
    .unwrap();
    let run = |cfg: &CaptureConfig| {
        kakeya_capture::run(
            cfg,
            Path::new("cfg.toml"),
            &models,
            RunOptions {
                shard: (0, 1),
                resume: false,
            },
            &mut |_| {},
        )
    };

    // Layers 0 (sliding: 4 query heads × 16, 2 KV heads) and 2 (full: 4 × 32, 1 KV head).
    let out = s.0.join("ds");
    run(&config(&out, &prompts, "[0, 2]")).unwrap();
    let ds = Dataset::open(&out).unwrap();
    let cols = &ds.manifest().columns;
    let dim = |name: &str| cols.iter().find(|c| c.name == name).unwrap().dim;
    assert_eq!((dim("v00_q_raw"), dim("v00_k_raw")), (64, 32));
    assert_eq!(
        (dim("v02_q_raw"), dim("v02_k_raw"), dim("v02_v_raw")),
        (128, 32, 32)
    );
    let names: Vec<String> = cols.iter().map(|c| c.name.clone()).collect();
    let got: Vec<_> = ds
        .read(&Query {
            columns: names,
            ..Query::default()
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(got.len(), 2);
    for b in &got {
        // One forward of the whole sequence (at most 16 rows: every row is computed as a
        // decode step would compute it, so chunking does not change a bit).
        assert!(b.token.len() <= 16);
        let mut caches = KvCache::for_specs(&v.cache_specs(), 0, kakeya_runtime::KvDtype::F32);
        let mut req = ForwardRequest::new(&b.token, 0, Logits::None);
        let aux = [1, 3];
        req.hidden_after = &aux;
        req.capture_attention = true;
        let o = v.forward(&req, &mut caches).unwrap();
        let mut want = Vec::new();
        for l in [0, 2] {
            let c = &o.attention[l];
            want.extend([&c.q_raw, &c.k_raw, &c.v_raw, &c.out].map(|t| host(t.clone())));
        }
        want.extend(o.hidden.iter().map(|h| host(h.clone())));
        // Verifier and hidden-state columns come first; the drafter's K/V after them.
        assert_eq!(b.columns.len(), want.len() + 2 * d.num_layers());
        for ((name, _, g), w) in b.columns.iter().zip(&want) {
            assert_eq!(g.len(), w.len(), "{name}");
            let differ = g.iter().zip(w).filter(|(x, y)| x != y).count();
            assert_eq!(differ, 0, "seq {} {name}: {differ} values differ", b.seq);
        }
    }

    // "all": the layers with their own K/V (0–3), not the sharing 4 and 5.
    let all = s.0.join("ds-all");
    run(&config(&all, &prompts, "\"all\"")).unwrap();
    let m = Dataset::open(&all).unwrap();
    assert_eq!(m.manifest().verifier_layers, vec![0, 1, 2, 3]);
    // Naming a sharing layer is refused before anything is written.
    let refused = s.0.join("ds-refused");
    let e = run(&config(&refused, &prompts, "[0, 4]"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer 4 reads layer 3's K/V"), "{e}");
    assert!(!refused.exists());
}
