//! Drafter training on a tiny random verifier: the training forward is the runtime drafter's
//! math, the drafter learns the verifier's continuations (held-out acceptance rises well
//! above 1), only drafter weights move, resuming is bit-for-bit, bad datasets are refused
//! before training.

use std::path::Path;

mod drafter_heldout;
mod tiny_data;

use drafter_heldout::{read_captured, runtime_heldout_acceptance, split};
use tiny_data::{SHA, capture, train_config};

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::testing::Scratch;
use kakeya_models::testing::{random_checkpoint, tiny_config};
use kakeya_models::{DFlashDrafter, DraftRequest, GemmaModel};
use kakeya_runtime::CompactStore;
use kakeya_train::data::Sequence;
use kakeya_train::drafter::{Batch, DrafterParams, Frozen};
use kakeya_train::train::EvalRecord;
use kakeya_train::{TrainError, TrainOptions, prepare, train_drafter};
use kakeya_weights::DraftCheckpoint;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn verifier() -> GemmaModel {
    GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(64), 11), &Device::flex()).unwrap()
}

fn opts() -> TrainOptions {
    TrainOptions {
        resume: false,
        device: kakeya_models::testing::test_device(),
        stop_after: None,
    }
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_into_vec::<f32>().unwrap()
}

#[test]
fn training_forward_equals_the_runtime_drafter_block_by_block() {
    let full = training_vs_runtime(false);
    // A sliding first layer (z-lab's Gemma 4 drafters have them) composes its window with the
    // trainer's anchor masks exactly as the runtime applies it alone, and it changes the
    // drafts (the test can tell).
    let sliding = training_vs_runtime(true);
    let d = full
        .iter()
        .zip(&sliding)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(d > 1e-3, "a window of 3 changed nothing ({d})");
}

/// The runtime drafter's logits of every picked block, after checking that the training
/// forward gives them too; `sliding`: the first drafter layer sees 3 positions back.
fn training_vs_runtime(sliding: bool) -> Vec<f32> {
    let s = Scratch::new(if sliding {
        "train-fwd-win"
    } else {
        "train-fwd"
    });
    let v = verifier();
    let ds = capture(&s.0, &v, 6, 10, "1, 3, 4");
    let cfg = train_config(&ds, &s.0.join("run"), 1, 40);
    let prep = prepare(&cfg, &v, SHA).unwrap();
    let d2t = prep.d2t.clone().unwrap();
    let mut config = prep.config.clone();
    if sliding {
        config.layer_windows[0] = Some(3);
    }
    let mut params = DrafterParams::init(config, 9, &Device::flex());
    // Norm multipliers away from 1 so that a swapped norm cannot pass.
    let mut rng = StdRng::seed_from_u64(1);
    for (_, shape, t) in &mut params.tensors {
        if shape.len() == 1 {
            let n = shape[0];
            let d: Vec<f32> = (0..n).map(|_| rng.random_range(0.5..1.5)).collect();
            *t = Tensor::from_data(TensorData::new(d, [1, n]), &Device::flex());
        }
    }
    let frozen = Frozen::new(
        v.embed.clone(),
        v.config.hidden_size,
        Some(&d2t),
        &Device::flex(),
    );
    let seqs: Vec<&Sequence> = prep.data.train.iter().take(2).collect();
    let picks: Vec<(&Sequence, Vec<usize>)> = seqs
        .iter()
        .map(|s| {
            let r = s.anchor_range();
            (*s, vec![r.start, (r.start + r.end) / 2, r.end - 1])
        })
        .collect();
    let batch = Batch::build(prep.data.width, 4, &picks);
    let weights: Vec<Tensor<2>> = params.tensors.iter().map(|(_, _, t)| t.clone()).collect();
    let got = host(params.forward(&weights, &frozen, &batch).0);
    // The runtime drafter takes raw aux states; training saw them divided per channel.
    let scales = prep.data.scales.clone();
    assert!(
        scales.iter().any(|&s| (s - 1.0).abs() > 0.1),
        "scales are not trivial"
    );
    let ck = params.to_checkpoint(Some(d2t.clone()), &scales);
    let drafter = DFlashDrafter::from_checkpoint(ck, &v).unwrap();
    let vd = d2t.len();
    let mut block_index = 0;
    let mut worst = 0f32;
    let mut all = Vec::new();
    for (s, anchors) in &picks {
        for &a in anchors {
            let width = prep.data.width;
            let raw: Vec<f32> = s.aux[..a * width]
                .iter()
                .enumerate()
                .map(|(i, v)| v * scales[i % width])
                .collect();
            let ctx = Tensor::<2>::from_data(TensorData::new(raw, [a, width]), &Device::flex());
            let block = [s.tokens[a], 4, 4, 4];
            let mut caches = CompactStore::new(drafter.context_width(), None, &Device::flex());
            let out = drafter
                .forward(
                    &DraftRequest {
                        context: Some(ctx),
                        block: &block,
                        capture_context: false,
                    },
                    &mut caches,
                )
                .unwrap();
            let want = host(drafter.logits(out.hidden.slice([1..4, 0..32])));
            let got_b = &got[block_index * 3 * vd..(block_index + 1) * 3 * vd];
            for (x, y) in got_b.iter().zip(&want) {
                worst = worst.max((x - y).abs());
            }
            all.extend(want);
            block_index += 1;
        }
    }
    assert!(worst < 1e-4, "training vs runtime logits differ by {worst}");
    all
}

#[test]
fn drafter_learns_the_verifiers_continuations_and_only_drafter_weights_move() {
    let s = Scratch::new("train-learn");
    let v = verifier();
    let ds = capture(&s.0, &v, 60, 24, "1, 3, 4");
    let cfg = train_config(&ds, &s.0.join("run"), 400, 0);
    let prep = prepare(&cfg, &v, SHA).unwrap();
    let names: Vec<String> = prep
        .config
        .expected_tensors()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let report = train_drafter(&cfg, &v, prep, &opts(), &mut |_| {}).unwrap();
    let first = &report.evals[0];
    let last = report.evals.last().unwrap();
    eprintln!(
        "held-out acceptance {:.3} -> {:.3}, loss {:.3} -> {:.3}",
        first.acceptance_length, last.acceptance_length, first.loss, last.loss
    );
    assert!(last.acceptance_length >= 2.0, "{last:?}");
    assert!(last.acceptance_length > first.acceptance_length + 0.7);
    assert!(last.loss < first.loss * 0.5);
    // The exported drafter holds only drafter tensors, and each of them moved from its init.
    let ck = DraftCheckpoint::load(&cfg.output.export).unwrap();
    let mut exported: Vec<&String> = ck.tensors.keys().collect();
    exported.sort();
    let mut expected: Vec<&String> = names.iter().collect();
    expected.sort();
    assert_eq!(exported, expected);
    // Every tensor in the exported file (read from its safetensors header: the loader skips
    // names it does not know), against z-lab's layout written out here rather than the
    // config's own list: a verifier tensor (its embedding / tied head) trained along as a
    // parameter would be exported under a name of its own, with the `[vocab, hidden]` shape.
    let got = safetensors_header(&cfg.output.export.join("model.safetensors"));
    assert_eq!(got, zlab_layout_one_layer());
    assert_eq!(
        report.parameters,
        got.iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum::<usize>()
    );
    let init = DrafterParams::init(ck.config.clone(), cfg.train.seed, &Device::flex());
    let init = init.to_checkpoint(None, &report_scales(&s.0.join("run/report.json")));
    for (name, t0) in init.tensors {
        let before = t0.data;
        let after = &ck.tensors[&name].data;
        let moved = before
            .iter()
            .zip(after)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(moved > 1e-4, "{name} did not train (max change {moved})");
    }
    assert!(s.0.join("run/report.json").is_file() && s.0.join("run/curves.png").is_file());
    // The runtime drafter, loaded from the export and bound to the verifier's own (untouched)
    // embedding and head, drafting greedily on raw captured aux states at the anchors the
    // held-out evaluation uses, reproduces the reported held-out acceptance. This also catches
    // a verifier embedding that training changed but the export does not carry.
    let rt = runtime_heldout_acceptance(&v, &cfg, &ds);
    let in_file = report_last_eval(&s.0.join("run/report.json"));
    assert_eq!(in_file.anchors, last.anchors);
    assert!((in_file.acceptance_length - last.acceptance_length).abs() < 1e-12);
    assert_eq!(rt.anchors, last.anchors, "anchor count");
    // f32 export: the runtime's logits equal the training forward's up to float rounding
    // (< 1e-4, first test), so a greedy draft can only differ where the runtime's top two
    // logits are within NEAR_TIE; each such block may move by up to B − 1 accepted tokens.
    let n = rt.anchors as f64;
    let tol = rt.ambiguous as f64 * (cfg.model.block_size - 1) as f64 / n;
    eprintln!(
        "runtime held-out acceptance {:.4} vs reported {:.4} over {} anchors ({} near-tie blocks, tolerance {tol:.4})",
        rt.acceptance_length, last.acceptance_length, rt.anchors, rt.ambiguous
    );
    assert!(
        rt.ambiguous * 20 <= rt.anchors,
        "too many near-tie blocks for the check to mean anything: {}",
        rt.ambiguous
    );
    assert!(
        (rt.acceptance_length - last.acceptance_length).abs() <= tol + 1e-12,
        "runtime {} vs reported {} (tolerance {tol})",
        rt.acceptance_length,
        last.acceptance_length
    );
    let slot_tol = rt.ambiguous as f64 / n;
    for (k, (a, b)) in rt
        .per_slot_acceptance
        .iter()
        .zip(&last.per_slot_acceptance)
        .enumerate()
    {
        assert!(
            (a - b).abs() <= slot_tol + 1e-12,
            "slot {}: runtime {a} vs reported {b}",
            k + 1
        );
    }
}

#[test]
fn a_run_started_from_an_exported_drafter_begins_where_that_one_ended() {
    let s = Scratch::new("train-init");
    let v = verifier();
    let ds = capture(&s.0, &v, 30, 16, "1, 3, 4");
    let mut cfg = train_config(&ds, &s.0.join("first"), 60, 0);
    cfg.train.seed = 5;
    cfg.model.draft_vocab = 0;
    cfg.output.export_dtype = kakeya_weights::StoreDtype::F32;
    let first = train_drafter(
        &cfg,
        &v,
        prepare(&cfg, &v, SHA).unwrap(),
        &opts(),
        &mut |_| {},
    )
    .unwrap();
    let end = first.evals.last().unwrap().clone();
    assert!(end.acceptance_length > first.evals[0].acceptance_length);
    // Same data, same held-out anchors: the second run's step-0 evaluation is the first run's
    // last one (up to the export's rescaling of fc by the input scales, float rounding).
    let mut again = cfg.clone();
    again.model.init = Some(cfg.output.export.clone());
    again.output.dir = s.0.join("second");
    again.output.export = s.0.join("second/drafter");
    again.train.steps = 1;
    let second = train_drafter(
        &again,
        &v,
        prepare(&again, &v, SHA).unwrap(),
        &opts(),
        &mut |_| {},
    )
    .unwrap();
    let start = &second.evals[0];
    assert_eq!(start.step, 0);
    assert!(
        (start.loss - end.loss).abs() <= 1e-4 * end.loss,
        "{} vs {}",
        start.loss,
        end.loss
    );
    assert_eq!(start.anchors, end.anchors);
    assert!(
        (start.acceptance_length - end.acceptance_length).abs() <= 2.0 / end.anchors as f64,
        "{} vs {}",
        start.acceptance_length,
        end.acceptance_length
    );
    // A fresh start evaluates far from it: the init was used.
    assert!((first.evals[0].loss - end.loss).abs() > 0.1 * end.loss);
    // Another shape is refused, naming the folder, before anything is written.
    let mut wrong = again.clone();
    wrong.model.layers = 2;
    wrong.output.dir = s.0.join("third");
    let e = train_drafter(
        &wrong,
        &v,
        prepare(&wrong, &v, SHA).unwrap(),
        &opts(),
        &mut |_| {},
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains(&cfg.output.export.display().to_string()) && e.contains("another shape"),
        "{e}"
    );
    assert!(!s.0.join("third").exists());
}

/// Names and PyTorch shapes of a one-layer DFlash drafter in z-lab's layout for this test's
/// shape (hidden 32, 3 target layers, 4 × 8 query and 2 × 8 KV heads, MLP 64), by name.
fn zlab_layout_one_layer() -> Vec<(String, Vec<usize>)> {
    let mut v: Vec<(String, Vec<usize>)> = [
        ("fc.weight", vec![32, 96]),
        ("hidden_norm.weight", vec![32]),
        ("norm.weight", vec![32]),
        ("layers.0.input_layernorm.weight", vec![32]),
        ("layers.0.post_attention_layernorm.weight", vec![32]),
        ("layers.0.self_attn.q_proj.weight", vec![32, 32]),
        ("layers.0.self_attn.k_proj.weight", vec![16, 32]),
        ("layers.0.self_attn.v_proj.weight", vec![16, 32]),
        ("layers.0.self_attn.o_proj.weight", vec![32, 32]),
        ("layers.0.self_attn.q_norm.weight", vec![8]),
        ("layers.0.self_attn.k_norm.weight", vec![8]),
        ("layers.0.mlp.gate_proj.weight", vec![64, 32]),
        ("layers.0.mlp.up_proj.weight", vec![64, 32]),
        ("layers.0.mlp.down_proj.weight", vec![32, 64]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_string(), s))
    .collect();
    v.sort();
    v
}

/// `(name, shape)` of every tensor a safetensors file holds, by name (the 8-byte
/// little-endian header length, then the JSON header).
fn safetensors_header(path: &Path) -> Vec<(String, Vec<usize>)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut out: Vec<(String, Vec<usize>)> = header
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            (k.clone(), shape)
        })
        .collect();
    out.sort();
    out
}

/// The last held-out evaluation written to a run's `report.json`.
fn report_last_eval(path: &Path) -> EvalRecord {
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    serde_json::from_value(r["evals"].as_array().unwrap().last().unwrap().clone()).unwrap()
}

/// The input scales a run folded into its exported `fc` (from its report).
fn report_scales(path: &Path) -> Vec<f32> {
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    r["input_scales"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn resuming_after_an_interruption_is_bit_for_bit() {
    let s = Scratch::new("train-resume");
    let v = verifier();
    let ds = capture(&s.0, &v, 12, 12, "1, 3, 4");
    let straight = train_config(&ds, &s.0.join("a"), 10, 30);
    train_drafter(
        &straight,
        &v,
        prepare(&straight, &v, SHA).unwrap(),
        &opts(),
        &mut |_| {},
    )
    .unwrap();
    let split = train_config(&ds, &s.0.join("b"), 10, 30);
    let stop = TrainOptions {
        stop_after: Some(5),
        ..opts()
    };
    let e = train_drafter(
        &split,
        &v,
        prepare(&split, &v, SHA).unwrap(),
        &stop,
        &mut |_| {},
    )
    .unwrap_err();
    assert!(matches!(e, TrainError::Interrupted(5)), "{e}");
    assert!(!split.output.export.exists());
    // Without --resume an existing state is refused.
    let e = train_drafter(
        &split,
        &v,
        prepare(&split, &v, SHA).unwrap(),
        &opts(),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("--resume"), "{e}");
    let resume = TrainOptions {
        resume: true,
        ..opts()
    };
    let mut first_step = None;
    train_drafter(
        &split,
        &v,
        prepare(&split, &v, SHA).unwrap(),
        &resume,
        &mut |ev| {
            if let kakeya_train::Event::Started { start, .. } = ev {
                first_step = Some(start);
            }
        },
    )
    .unwrap();
    assert_eq!(first_step, Some(5));
    let a = DraftCheckpoint::load(&straight.output.export).unwrap();
    let b = DraftCheckpoint::load(&split.output.export).unwrap();
    assert_eq!(a.d2t, b.d2t);
    for (name, t) in &a.tensors {
        assert_eq!(t.data, b.tensors[name].data, "{name} differs after resume");
    }
    // --resume with nothing saved yet starts fresh (one command line starts and continues).
    let fresh = train_config(&ds, &s.0.join("c"), 10, 30);
    let mut first_step = None;
    train_drafter(
        &fresh,
        &v,
        prepare(&fresh, &v, SHA).unwrap(),
        &resume,
        &mut |ev| {
            if let kakeya_train::Event::Started { start, .. } = ev {
                first_step = Some(start);
            }
        },
    )
    .unwrap();
    assert_eq!(first_step, Some(0));
    let c = DraftCheckpoint::load(&fresh.output.export).unwrap();
    for (name, t) in &a.tensors {
        assert_eq!(
            t.data, c.tensors[name].data,
            "{name} differs from a fresh --resume"
        );
    }
}

#[test]
fn datasets_without_the_aux_columns_or_from_another_verifier_are_refused() {
    let s = Scratch::new("train-bad");
    let v = verifier();
    let ds = capture(&s.0, &v, 4, 6, "1, 3");
    let cfg = train_config(&ds, &s.0.join("run"), 5, 0);
    let e = prepare(&cfg, &v, SHA).err().unwrap().to_string();
    assert!(
        e.contains(&ds.display().to_string()) && e.contains("[4]"),
        "{e}"
    );
    let mut cfg2 = cfg.clone();
    cfg2.model.target_layers = Some(vec![1, 3]);
    let e = prepare(&cfg2, &v, &"0".repeat(64))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("recapture with this verifier"), "{e}");
    assert!(!s.0.join("run").exists());
}

#[test]
fn draft_vocab_is_built_from_the_training_continuations() {
    let s = Scratch::new("train-vocab");
    let v = verifier();
    let ds = capture(&s.0, &v, 10, 8, "1, 3, 4");
    // Generated-token counts of the training split, from the dataset as stored.
    let all = read_captured(&ds, &[1, 3, 4]);
    let (train, _) = split(&all, 5);
    let mut count = [0usize; 97];
    for c in &train {
        for (&t, &p) in c.tokens.iter().zip(&c.in_prompt) {
            if !p {
                count[t as usize] += 1;
            }
        }
    }
    // Most frequent first; a stable sort keeps equal counts in ascending id order.
    let mut ranked: Vec<u32> = (0..97u32).filter(|&t| count[t as usize] > 0).collect();
    ranked.sort_by_key(|&t| std::cmp::Reverse(count[t as usize]));
    let c = |i: usize| count[ranked[i] as usize];
    eprintln!(
        "{} distinct generated tokens, counts {:?}",
        ranked.len(),
        (0..ranked.len()).map(c).collect::<Vec<_>>()
    );
    // A size whose cut falls inside a group of equal counts (so the tie rule decides), and
    // one above the number of distinct tokens (so the top-up by lowest unused id decides).
    let cut = (1..ranked.len())
        .find(|&n| n >= 2 && c(n - 1) == c(n) && c(n) < c(0))
        .expect("a tie group to cut inside");
    let topped = ranked.len() + 5;
    assert!(topped < 97);
    for (n, run) in [(cut, "cut"), (topped, "topped")] {
        let mut want: Vec<u32> = ranked.iter().copied().take(n).collect();
        let unused: Vec<u32> = (0..97u32).filter(|t| !want.contains(t)).collect();
        want.extend(unused.into_iter().take(n - want.len()));
        want.sort_unstable();
        let cfg = train_config(&ds, &s.0.join(run), 1, n);
        let prep = prepare(&cfg, &v, SHA).unwrap();
        assert_eq!(prep.d2t.as_deref(), Some(&want[..]), "draft vocab of {n}");
        assert_eq!(prep.config.draft_vocab_size, Some(n));
        if n == cut {
            // The exported drafter carries the same map as its `d2t` tensor.
            train_drafter(&cfg, &v, prep, &opts(), &mut |_| {}).unwrap();
            let ck = DraftCheckpoint::load(&cfg.output.export).unwrap();
            assert_eq!(ck.d2t.as_deref(), Some(&want[..]), "exported d2t");
            assert_eq!(ck.config.draft_vocab_size, Some(n));
        }
    }
}
