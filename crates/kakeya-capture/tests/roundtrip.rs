//! Capture round trip on a tiny random verifier + drafter: what the reader returns equals what
//! the models produce (f32 exactly, f16 within half-precision rounding); position sampling and
//! column projection; continuations decoded together give the same dataset (and a job resumes
//! across batch sizes); bad configs are refused before anything is written.

use std::path::Path;

use burn::tensor::{Device, Tensor};
use kakeya_capture::config::{Dtype, LayerSet, VerifierTensor};
use kakeya_capture::schema::ModelInfo;
use kakeya_capture::{CaptureConfig, Dataset, Models, Query, RunOptions};
use kakeya_models::testing::Scratch;
use kakeya_models::testing::{
    drafter_config, random_checkpoint, random_drafter, random_quantized_checkpoint, test_device,
    tiny_config, word_level_tokenizer_json,
};
use kakeya_models::{DFlashDrafter, DraftRequest, ForwardRequest, GemmaModel, Logits};
use kakeya_runtime::KvCache;
use kakeya_weights::Tokenizer;

/// The word-level tokenizer of 97 tokens (<pad>, <eos>, <bos>, <unk>, w4, w5, ...), written
/// into the scratch folder and loaded.
fn tokenizer(dir: &Path) -> Tokenizer {
    std::fs::write(dir.join("tokenizer.json"), word_level_tokenizer_json(97)).unwrap();
    Tokenizer::load(&dir.join("tokenizer.json"), 97).unwrap()
}

/// A 2-layer random drafter (block 4) for `v`.
fn drafter(v: &GemmaModel) -> DFlashDrafter {
    DFlashDrafter::from_checkpoint(random_drafter(&drafter_config(&v.config, 2, 4), 2), v).unwrap()
}

fn config(dir: &Path, prompts: &Path, dtype: Dtype) -> CaptureConfig {
    let text = format!(
        r#"
[model]
verifier = "unused"
drafter = "unused"
[output]
dir = "{}"
dtype = "{}"
sequences_per_shard = 2
[generation]
gen_len = 6
max_prompt_tokens = 64
chunk = 5
[tensors]
verifier = ["q_raw", "k_raw", "v_raw", "attn_out"]
verifier_layers = [0, 5]
aux_layers = [1, 3]
drafter_kv = true
[[sources]]
kind = "jsonl"
path = "{}"
"#,
        dir.display(),
        if dtype == Dtype::F16 { "f16" } else { "f32" },
        prompts.display()
    );
    toml::from_str(&text).unwrap()
}

fn info() -> ModelInfo {
    ModelInfo {
        path: "tiny".into(),
        sha256: "0".repeat(64),
    }
}

/// The job's models with placeholder identities.
fn models<'a>(
    verifier: &'a GemmaModel,
    tokenizer: &'a Tokenizer,
    drafter: Option<&'a DFlashDrafter>,
) -> Models<'a> {
    Models {
        verifier,
        tokenizer,
        drafter,
        verifier_info: info(),
        tokenizer_info: info(),
        drafter_info: drafter.map(|_| info()),
    }
}

/// Every sequence of the dataset at `out` with every column: `(seq, tokens, in_prompt,
/// columns)`, in sequence order.
#[allow(clippy::type_complexity)]
fn read_all(out: &Path) -> Vec<(usize, Vec<u32>, Vec<bool>, Vec<(String, usize, Vec<f32>)>)> {
    let ds = Dataset::open(out).unwrap();
    let names: Vec<String> = ds
        .manifest()
        .columns
        .iter()
        .map(|c| c.name.clone())
        .collect();
    let mut rows: Vec<_> = ds
        .read(&Query {
            columns: names,
            ..Query::default()
        })
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    rows.sort_by_key(|b| b.seq);
    rows.into_iter()
        .map(|b| (b.seq, b.token, b.in_prompt, b.columns))
        .collect()
}

/// `n` JSON-lines prompts of 2, 3, … words, written to `path`.
fn write_prompts(path: &Path, n: usize) {
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let words: Vec<String> = (0..2 + i)
                .map(|j| format!("w{}", 4 + (i * 7 + j) % 90))
                .collect();
            format!("{{\"text\": \"{}\"}}", words.join(" "))
        })
        .collect();
    std::fs::write(path, lines.join("\n")).unwrap();
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_into_vec::<f32>().unwrap()
}

#[test]
fn values_read_back_equal_what_the_models_produce() {
    let s = Scratch::new("cap-rt");
    // The verifier (and so the capture) on the test device (scripts/test_wgpu.sh: wgpu).
    let v =
        GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(4), 8), &test_device()).unwrap();
    let d = drafter(&v);
    let tok = tokenizer(&s.0);
    let prompts = s.0.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"text\": \"w4 w5 w6 w7 w8 w9 w10 w11 w12\"}\n\n{\"text\": \"w20 w21\"}\n{\"text\": \"w30 w31 w32\"}\n",
    )
    .unwrap();
    let models = models(&v, &tok, Some(&d));
    for dtype in [Dtype::F32, Dtype::F16] {
        let out = s.0.join(format!("ds-{dtype:?}"));
        let cfg = config(&out, &prompts, dtype);
        let sum = kakeya_capture::run(
            &cfg,
            Path::new("cfg.toml"),
            &models,
            RunOptions {
                shard: (0, 1),
                resume: false,
            },
            &mut |_| {},
        )
        .unwrap();
        assert_eq!((sum.sequences, sum.shards), (3, 2));
        let ds = Dataset::open(&out).unwrap();
        let names: Vec<String> = ds
            .manifest()
            .columns
            .iter()
            .map(|c| c.name.clone())
            .collect();
        assert_eq!(names.len(), 2 * 4 + 2 + 2 * 2);
        let got: Vec<_> = ds
            .read(&Query {
                columns: names.clone(),
                ..Query::default()
            })
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(got.len(), 3);
        for b in &got {
            // Recompute the sequence in one pass and compare every column.
            let toks = &b.token;
            let mut caches = KvCache::for_specs(&v.cache_specs(), 0, kakeya_runtime::KvDtype::F32);
            let mut req = ForwardRequest::new(toks, 0, Logits::None);
            let aux_layers = [1, 3];
            req.hidden_after = &aux_layers;
            req.capture_attention = true;
            let o = v.forward(&req, &mut caches).unwrap();
            let mut want: Vec<Vec<f32>> = Vec::new();
            for l in [0, 5] {
                let c = &o.attention[l];
                for t in [&c.q_raw, &c.k_raw, &c.v_raw, &c.out] {
                    want.push(host(t.clone()));
                }
            }
            for h in &o.hidden {
                want.push(host(h.clone()));
            }
            let ctx: Vec<Tensor<2>> = d
                .config
                .target_layer_ids
                .iter()
                .map(|&l| {
                    let mut c2 =
                        KvCache::for_specs(&v.cache_specs(), 0, kakeya_runtime::KvDtype::F32);
                    let mut r = ForwardRequest::new(toks, 0, Logits::None);
                    let la = [l];
                    r.hidden_after = &la;
                    v.forward(&r, &mut c2).unwrap().hidden.remove(0)
                })
                .collect();
            let mut dc = kakeya_runtime::CompactStore::new(d.context_width(), None, v.device());
            let dout = d
                .forward(
                    &DraftRequest {
                        context: Some(Tensor::cat(ctx, 1)),
                        block: &toks[toks.len() - 1..],
                        capture_context: true,
                    },
                    &mut dc,
                )
                .unwrap();
            // The store rows hold the drafter's layers side by side; the capture one column each.
            let (k, vv) = dout.context_kv.unwrap();
            let n = k.dims()[0];
            let kvw = d.context_width() / d.num_layers();
            for l in 0..d.num_layers() {
                want.push(host(k.clone().slice([0..n, l * kvw..(l + 1) * kvw])));
                want.push(host(vv.clone().slice([0..n, l * kvw..(l + 1) * kvw])));
            }
            assert_eq!(want.len(), b.columns.len());
            for ((name, _, got), want) in b.columns.iter().zip(&want) {
                assert_eq!(got.len(), want.len(), "{name}");
                for (g, w) in got.iter().zip(want) {
                    // The capture ran in chunks of 5, the reference in one pass: f32 sums differ
                    // by ~1e-7. On top, f16 storage rounds to 2^-11 relative.
                    let f32_tol = 1e-5 * w.abs().max(1.0);
                    let tol = match dtype {
                        Dtype::F32 => f32_tol,
                        Dtype::F16 => w.abs() * 4.9e-4 + f32_tol,
                    };
                    assert!(
                        (g - w).abs() <= tol,
                        "{dtype:?} seq {} {name}: {g} vs {w}",
                        b.seq
                    );
                }
            }
            assert!(b.in_prompt.iter().filter(|&&p| p).count() >= 2);
            assert_eq!(b.pos, (0..b.pos.len() as u32).collect::<Vec<_>>());
        }
    }
}

#[test]
fn sampled_positions_and_projection() {
    let s = Scratch::new("cap-sample");
    // The verifier (and so the capture) on the test device (scripts/test_wgpu.sh: wgpu).
    let v =
        GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(4), 8), &test_device()).unwrap();
    let tok = tokenizer(&s.0);
    let prompts = s.0.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"text\": \"w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14\"}\n",
    )
    .unwrap();
    let mut cfg = config(&s.0.join("ds"), &prompts, Dtype::F32);
    cfg.model.drafter = None;
    cfg.tensors.drafter_kv = false;
    cfg.tensors.verifier = vec![VerifierTensor::KRaw];
    cfg.tensors.verifier_layers = LayerSet::All("all".into());
    cfg.tensors.sample_positions = Some(5);
    let models = models(&v, &tok, None);
    kakeya_capture::run(
        &cfg,
        Path::new("c.toml"),
        &models,
        RunOptions {
            shard: (0, 1),
            resume: false,
        },
        &mut |_| {},
    )
    .unwrap();
    let ds = Dataset::open(&s.0.join("ds")).unwrap();
    let b = ds
        .read(&Query {
            columns: vec!["v03_k_raw".into()],
            positions: Some(0..12),
            ..Query::default()
        })
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    assert!(b.pos.len() <= 5 && !b.pos.is_empty(), "{:?}", b.pos);
    // Aux states only (the drafter trainer's set): no per-layer columns.
    cfg.tensors.verifier = vec![];
    cfg.output.dir = s.0.join("aux-only");
    kakeya_capture::run(
        &cfg,
        Path::new("c.toml"),
        &models,
        RunOptions {
            shard: (0, 1),
            resume: false,
        },
        &mut |_| {},
    )
    .unwrap();
    let aux = Dataset::open(&s.0.join("aux-only")).unwrap();
    let names: Vec<&str> = aux
        .manifest()
        .columns
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(names, ["aux_01", "aux_03"]);
    assert!(b.pos.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(b.columns[0].1, 2 * 16);
    assert_eq!(b.columns[0].2.len(), b.pos.len() * 32);
    let err = ds
        .read(&Query {
            columns: vec!["v03_q_raw".into()],
            ..Query::default()
        })
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("v03_q_raw") && err.contains("recapture"),
        "{err}"
    );
}

#[test]
fn unknown_tensor_or_layer_is_refused() {
    let s = Scratch::new("cap-badcfg");
    let p = s.0.join("c.toml");
    std::fs::write(
        &p,
        "[model]\nverifier = \"x\"\n[output]\ndir = \"o\"\n[tensors]\nverifier = [\"z_raw\"]\n[[sources]]\nkind = \"needle\"\ncount = 1\nseed = 1\nlines = [1, 2]\n",
    )
    .unwrap();
    let err = CaptureConfig::load(&p).unwrap_err().to_string();
    assert!(err.contains("c.toml") && err.contains("z_raw"), "{err}");
    for batch in [0, 17] {
        std::fs::write(
            &p,
            format!("[model]\nverifier = \"x\"\n[output]\ndir = \"o\"\n[generation]\nbatch = {batch}\n[[sources]]\nkind = \"needle\"\ncount = 1\nseed = 1\nlines = [1, 2]\n"),
        )
        .unwrap();
        let err = CaptureConfig::load(&p).unwrap_err().to_string();
        assert!(
            err.contains("c.toml") && err.contains("generation.batch"),
            "{err}"
        );
    }

    let v = GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(4), 8), &Device::flex())
        .unwrap();
    let tok = tokenizer(&s.0);
    let prompts = s.0.join("p.jsonl");
    std::fs::write(&prompts, "{\"text\": \"w4\"}\n").unwrap();
    let mut cfg = config(&s.0.join("ds"), &prompts, Dtype::F32);
    cfg.tensors.drafter_kv = false;
    cfg.tensors.verifier_layers = LayerSet::List(vec![0, 40]);
    let models = models(&v, &tok, None);
    let err = kakeya_capture::run(
        &cfg,
        Path::new("c.toml"),
        &models,
        RunOptions {
            shard: (0, 1),
            resume: false,
        },
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("c.toml") && err.contains("layer 40"), "{err}");
    assert!(!s.0.join("ds").exists(), "nothing written for a bad config");
}

#[test]
fn continuations_decoded_together_give_the_same_dataset_and_resume_across_batch_sizes() {
    let s = Scratch::new("cap-batch");
    // Q8_0 weights: decode steps run the batch-invariant block kernel, as on the real model.
    let v = GemmaModel::from_checkpoint(
        random_quantized_checkpoint(&tiny_config(4), 8),
        &Device::flex(),
    )
    .unwrap();
    let d = drafter(&v);
    let tok = tokenizer(&s.0);
    let prompts = s.0.join("p.jsonl");
    write_prompts(&prompts, 7);
    let models = models(&v, &tok, Some(&d));
    let run = |out: &Path, batch: usize, per_shard: usize, resume: bool, half: bool| {
        let mut cfg = config(out, &prompts, Dtype::F32);
        cfg.generation.batch = batch;
        cfg.generation.gen_len = 9;
        cfg.output.sequences_per_shard = per_shard;
        // `--shard 0/2` alone stands for a run stopped half-way.
        kakeya_capture::run(
            &cfg,
            Path::new("cfg.toml"),
            &models,
            RunOptions {
                shard: (0, if half { 2 } else { 1 }),
                resume,
            },
            &mut |_| {},
        )
        .unwrap();
    };
    let one = s.0.join("batch1");
    run(&one, 1, 4, false, false);
    let four = s.0.join("batch4");
    run(&four, 4, 4, false, false);
    let want = read_all(&one);
    assert_eq!(want.len(), 7);
    assert!(
        want.iter()
            .any(|r| r.2.iter().filter(|&&p| !p).count() == 9),
        "some run to gen_len"
    );
    assert!(read_all(&four) == want, "batch 4 differs from batch 1");
    // Half the shards with batch 1, the rest resumed with batch 3: the same dataset.
    let mixed = s.0.join("mixed");
    run(&mixed, 1, 2, false, true);
    run(&mixed, 3, 2, true, false);
    assert!(
        read_all(&mixed) == want,
        "resumed with another batch differs"
    );
}

#[test]
fn tensors_rebuilt_from_a_token_only_capture_equal_a_one_step_capture() {
    let s = Scratch::new("cap-reuse");
    let v = GemmaModel::from_checkpoint(
        random_quantized_checkpoint(&tiny_config(4), 8),
        &Device::flex(),
    )
    .unwrap();
    let d = drafter(&v);
    let tok = tokenizer(&s.0);
    let prompts = s.0.join("p.jsonl");
    write_prompts(&prompts, 5);
    let models = models(&v, &tok, Some(&d));
    let run = |cfg: &CaptureConfig, resume: bool| {
        kakeya_capture::run(
            cfg,
            Path::new("cfg.toml"),
            &models,
            RunOptions {
                shard: (0, 1),
                resume,
            },
            &mut |_| {},
        )
    };
    let mut full = config(&s.0.join("full"), &prompts, Dtype::F32);
    full.generation.gen_len = 9;
    run(&full, false).unwrap();
    let want = read_all(&full.output.dir);

    // The costly half alone: token ids, no tensor column.
    let mut tokens = full.clone();
    tokens.output.dir = s.0.join("tokens");
    tokens.tensors.verifier = Vec::new();
    tokens.tensors.aux_layers = Some(Vec::new());
    tokens.tensors.drafter_kv = false;
    run(&tokens, false).unwrap();
    assert!(
        Dataset::open(&tokens.output.dir)
            .unwrap()
            .manifest()
            .columns
            .is_empty()
    );
    let got = read_all(&tokens.output.dir);
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(
            (g.0, &g.1, &g.2),
            (w.0, &w.1, &w.2),
            "tokens of sequence {}",
            w.0
        );
    }

    // Every tensor rebuilt from those tokens: the one-step dataset, bit for bit.
    let mut rebuilt = full.clone();
    rebuilt.output.dir = s.0.join("rebuilt");
    rebuilt.generation.continuations = Some(tokens.output.dir.clone());
    run(&rebuilt, false).unwrap();
    assert!(
        read_all(&rebuilt.output.dir) == want,
        "rebuilt dataset differs"
    );
    // Where the continuations came from is not part of the dataset's identity.
    let a = Dataset::open(&rebuilt.output.dir).unwrap();
    let b = Dataset::open(&full.output.dir).unwrap();
    assert_eq!(a.manifest().fingerprint(), b.manifest().fingerprint());

    // Continuations of other settings, or not yet captured, are refused by name.
    let mut other = rebuilt.clone();
    other.output.dir = s.0.join("other");
    other.generation.gen_len = 8;
    let err = run(&other, false).unwrap_err().to_string();
    assert!(err.contains("tokens") && err.contains("gen_len 9"), "{err}");
    let mut half = tokens.clone();
    half.output.dir = s.0.join("half");
    kakeya_capture::run(
        &half,
        Path::new("cfg.toml"),
        &models,
        RunOptions {
            shard: (0, 2),
            resume: false,
        },
        &mut |_| {},
    )
    .unwrap();
    let mut partial = rebuilt.clone();
    partial.output.dir = s.0.join("partial");
    partial.generation.continuations = Some(half.output.dir.clone());
    let err = run(&partial, false).unwrap_err().to_string();
    assert!(
        err.contains("half") && err.contains("sequence 2 is not"),
        "{err}"
    );
}
