//! f_θ's losses and gradients (with and without `normalize_attention`; on a Gemma 3-shaped
//! verifier and on a Gemma 4-shaped one: per-layer K/V geometry, proportional RoPE, scale 1,
//! v_norm) and five of the trainer's own steps (its loss, global clip, AdamW and schedule)
//! against the PyTorch reference (`tests/fixtures/f_theta/make_f_theta.py [--gemma4]` →
//! `f_theta.json`, `f_theta_gemma4.json`; losses, terms and gradients 1e-4, weights after the
//! steps 1e-5), plus the properties DESIGN §7 asks of them: identical
//! K/V give zero loss, the hybrid loss exceeds attn_distill when directions differ, and the
//! trainer's step reaches f_θ only, never the verifier's weights.

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::rope::Rope;
use kakeya_models::testing::{f_theta_config, random_checkpoint, tiny_config};
use kakeya_models::{FTheta, Gemma3Model, norm::RmsNorm};
use kakeya_train::ftheta::FThetaTrainConfig;
use kakeya_train::ftheta::data::{LayerData, SeqData};
use kakeya_train::ftheta::loss::{
    GroupTargets, Lambdas, LayerFrozen, LayerTargets, LossKind, Rows, TargetScales, Terms,
    group_terms, layer_loss, layer_terms,
};
use kakeya_train::ftheta::params::FThetaParams;
use kakeya_train::ftheta::step::{
    Passes, batch_loss, batch_loss_in, frozen_groups, frozen_layers, optimizer_step,
};
use kakeya_train::optim::{Moments, global_norm};
use kakeya_train::run::leaves;
use kakeya_weights::ftheta::FThetaInputs;
use kakeya_weights::{FThetaConfig, HostTensor};
use serde_json::Value;

const KINDS: [LossKind; 5] = [
    LossKind::Mse,
    LossKind::CosMag,
    LossKind::Combined,
    LossKind::AttnDistill,
    LossKind::AttnDistillHybrid,
];

/// `tests/fixtures/f_theta/<name>`.
fn fixture_named(name: &str) -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/f_theta")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// The Gemma 3-shaped fixture (with the trainer's steps).
fn fixture() -> Value {
    fixture_named("f_theta.json")
}

/// Both fixtures, named: Gemma 3's layers, and Gemma 4's (per-layer K/V geometry, proportional
/// RoPE on the full layer, scale 1, v_norm).
fn fixtures() -> [(&'static str, Value); 2] {
    [
        ("gemma3", fixture()),
        ("gemma4", fixture_named("f_theta_gemma4.json")),
    ]
}

/// Layer `l`'s value of the per-layer list `key` in the fixture's dims, or the shared `shared`
/// (the Gemma 3 fixture has only the shared ones).
fn per_layer(dims: &Value, key: &str, shared: &str, l: usize) -> usize {
    match dims[key].as_array() {
        Some(a) => usize_of(&a[l]),
        None => usize_of(&dims[shared]),
    }
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn t2(v: &Value, rows: usize, d: &Device) -> Tensor<2> {
    let data = floats(v);
    let cols = data.len() / rows;
    Tensor::from_data(TensorData::new(data, [rows, cols]), d)
}

fn usize_of(v: &Value) -> usize {
    v.as_u64().unwrap() as usize
}

struct Case {
    frozen: Vec<LayerFrozen>,
    targets: Vec<LayerTargets>,
    params: FThetaParams,
    dk: Tensor<2>,
    dv: Tensor<2>,
}

/// The fixture verifier's frozen attention pieces on `d`.
fn frozen(f: &Value, d: &Device) -> Vec<LayerFrozen> {
    let dims = &f["dims"];
    let layers = usize_of(&dims["layers"]);
    let hidden = usize_of(&dims["hidden"]);
    let bases = floats(&dims["rope_bases"]);
    let eps = dims["rms_eps"].as_f64().unwrap();
    (0..layers)
        .map(|l| {
            let hd = per_layer(dims, "layer_head_dims", "head_dim", l);
            let global = dims["global_layers"][l].as_bool().unwrap();
            let norm = |scale: Vec<f32>| RmsNorm {
                scale: Tensor::<1>::from_data(TensorData::new(scale, [hd]), d),
                eps,
            };
            let base = f64::from(bases[usize::from(global)]);
            LayerFrozen {
                q_norm: norm(floats(&f["frozen"]["q_norm"][l])),
                k_norm: norm(floats(&f["frozen"]["k_norm"][l])),
                v_norm: (dims["v_norm"] == true).then(|| norm(vec![1.0; hd])),
                o_proj: t2(&f["frozen"]["o_proj"][l], hidden, d),
                heads: usize_of(&dims["heads"]),
                kv_heads: per_layer(dims, "layer_kv_heads", "kv_heads", l),
                head_dim: hd,
                scale: dims["scale"].as_f64().unwrap(),
                window: (!global).then(|| usize_of(&dims["window"])),
                rope: match dims["partial_rotary"].as_f64() {
                    Some(share) if global => Rope::proportional(hd, base, share),
                    _ => Rope::new(hd, base, 1.0),
                },
            }
        })
        .collect()
}

/// The fixture's initial f_θ on `d`.
fn params(f: &Value, d: &Device) -> FThetaParams {
    let dims = &f["dims"];
    let layers = usize_of(&dims["layers"]);
    let widths: Vec<usize> = (0..layers)
        .map(|l| {
            per_layer(dims, "layer_kv_heads", "kv_heads", l)
                * per_layer(dims, "layer_head_dims", "head_dim", l)
        })
        .collect();
    let config = FThetaConfig {
        loss: "attn_distill_hybrid".into(),
        ..f_theta_config(
            usize_of(&dims["drafter_layers"]),
            usize_of(&dims["drafter_kv"]),
            FThetaInputs::Own,
            usize_of(&dims["rank"]),
            layers,
            widths[0],
        )
        .with_layer_widths(&widths)
    };
    let mut host: BTreeMap<String, HostTensor> = f["params"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(n, p)| {
            (
                n.clone(),
                HostTensor {
                    shape: p["shape"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(usize_of)
                        .collect(),
                    data: floats(&p["value"]),
                },
            )
        })
        .collect();
    FThetaParams::from_host(config, &mut host, d).unwrap()
}

fn case(f: &Value, d: &Device) -> Case {
    let dims = &f["dims"];
    let t = usize_of(&dims["t"]);
    let layers = usize_of(&dims["layers"]);
    let qpos: Vec<usize> = dims["qpos"]
        .as_array()
        .unwrap()
        .iter()
        .map(usize_of)
        .collect();
    let targets = (0..layers)
        .map(|l| LayerTargets {
            q_raw: Some(t2(&f["data"]["q_raw"][l], qpos.len(), d)),
            q_pos: qpos.clone(),
            k: t2(&f["data"]["k_raw"][l], t, d),
            v: t2(&f["data"]["v_raw"][l], t, d),
            o: Some(t2(&f["data"]["o_tgt"][l], qpos.len(), d)),
        })
        .collect();
    Case {
        frozen: frozen(f, d),
        targets,
        params: params(f, d),
        dk: t2(&f["drafter_k"], t, d),
        dv: t2(&f["drafter_v"], t, d),
    }
}

fn all_terms(c: &Case, model: &FTheta) -> Vec<Terms> {
    let zk = model.k.encode(c.dk.clone());
    let zv = model.v.encode(c.dv.clone());
    c.frozen
        .iter()
        .zip(&c.targets)
        .enumerate()
        .map(|(l, (fr, tg))| {
            layer_terms(
                fr,
                tg,
                model.k.decode(zk.clone(), l),
                model.v.decode(zv.clone(), l),
            )
        })
        .collect()
}

fn mean_loss(kind: LossKind, normalize_attention: bool, terms: &[Terms]) -> Tensor<1> {
    let n = terms.len() as f64;
    terms
        .iter()
        .map(|t| layer_loss(kind, &Lambdas::default(), normalize_attention, t))
        .reduce(|a, b| a + b)
        .unwrap()
        .div_scalar(n)
}

fn value(t: Tensor<1>) -> f64 {
    f64::from(t.into_scalar::<f32>())
}

fn host(t: &Tensor<2>) -> Vec<f32> {
    t.clone().into_data().try_into_vec::<f32>().unwrap()
}

fn weights(p: &FThetaParams) -> Vec<Tensor<2>> {
    p.tensors.iter().map(|(_, _, t)| t.clone()).collect()
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs().max(1.0)
}

#[test]
fn every_loss_and_term_matches_the_pytorch_reference() {
    for (name, f) in fixtures() {
        losses_and_terms_match(name, &f);
    }
}

fn losses_and_terms_match(name: &str, f: &Value) {
    let d = Device::flex();
    let c = case(f, &d);
    let model = c.params.model(&weights(&c.params));
    let terms = all_terms(&c, &model);
    let mut worst: f64 = 0.0;
    for (normalize, want) in [(false, &f["losses"]), (true, &f["normalized"]["losses"])] {
        for kind in KINDS {
            let got = value(mean_loss(kind, normalize, &terms));
            let want = want[kind.name()].as_f64().unwrap();
            worst = worst.max((got - want).abs() / want.abs().max(1.0));
            assert!(
                close(got, want, 1e-4),
                "{name}: {} (normalize_attention {normalize}): {got} vs {want}",
                kind.name()
            );
        }
    }
    eprintln!("{name} losses: largest relative deviation from torch {worst:.2e}");
    for (l, t) in terms.iter().enumerate() {
        let r = &f["terms"][l];
        let pairs = [
            ("mse_k", &t.mse_k),
            ("mse_v", &t.mse_v),
            ("cos_k", &t.cos_k),
            ("cos_v", &t.cos_v),
            ("mag_k", &t.mag_k),
            ("mag_v", &t.mag_v),
            ("kdir", &t.kdir),
            ("vdir", &t.vdir),
            ("kmag", &t.kmag),
            ("vmag", &t.vmag),
            ("mse_o", t.mse_o.as_ref().unwrap()),
        ];
        for (term, got) in pairs {
            let (got, want) = (value(got.clone()), r[term].as_f64().unwrap());
            assert!(
                close(got, want, 1e-4),
                "{name} layer {l} {term}: {got} vs {want}"
            );
        }
        // normalize_attention's divisor: the layer's mean(O_tgt²) at the query positions.
        let want = f["normalized"]["o_sq"][l].as_f64().unwrap();
        assert!(
            close(t.scales[0].o_sq[0], want, 1e-4),
            "{name} layer {l} o_sq: {} vs {want}",
            t.scales[0].o_sq[0]
        );
    }
}

#[test]
fn identical_kv_give_zero_for_every_loss_and_hybrid_exceeds_attn_distill_when_directions_differ() {
    for (name, f) in fixtures() {
        zero_and_direction_properties_hold(name, &f);
    }
}

fn zero_and_direction_properties_hold(name: &str, f: &Value) {
    let d = Device::flex();
    let c = case(f, &d);
    let exact: Vec<Terms> = c
        .frozen
        .iter()
        .zip(&c.targets)
        .map(|(fr, tg)| layer_terms(fr, tg, tg.k.clone(), tg.v.clone()))
        .collect();
    for kind in KINDS {
        for normalize in [false, true] {
            let v = value(mean_loss(kind, normalize, &exact));
            assert!(v.abs() < 1e-6, "{name} {} ({normalize}): {v}", kind.name());
        }
    }
    // Same magnitudes, other directions: each head vector's elements reversed. The magnitude
    // terms stay ~0, the direction terms do not, so hybrid − attn_distill is their sum.
    let flipped: Vec<Terms> = c
        .frozen
        .iter()
        .zip(&c.targets)
        .map(|(fr, tg)| {
            let flip = |x: &Tensor<2>| {
                let [n, w] = x.dims();
                x.clone()
                    .reshape([n, w / fr.head_dim, fr.head_dim])
                    .flip([2])
                    .reshape([n, w])
            };
            layer_terms(fr, tg, flip(&tg.k), flip(&tg.v))
        })
        .collect();
    let hybrid = value(mean_loss(LossKind::AttnDistillHybrid, false, &flipped));
    let attn = value(mean_loss(LossKind::AttnDistill, false, &flipped));
    let dirs: f64 = flipped
        .iter()
        .map(|t| value(t.kdir.clone()) + value(t.vdir.clone()))
        .sum::<f64>()
        / flipped.len() as f64;
    assert!(
        dirs > 0.1,
        "{name}: reversed head vectors point elsewhere: {dirs}"
    );
    assert!(
        hybrid > attn + 0.1,
        "{name}: hybrid {hybrid} vs attn_distill {attn}"
    );
    assert!(
        close(hybrid - attn, dirs, 1e-3),
        "{name}: the difference is the direction terms"
    );
}

#[test]
fn hybrid_gradients_match_the_reference_with_and_without_normalize_attention() {
    for (name, f) in fixtures() {
        hybrid_gradients_match(name, &f);
    }
}

fn hybrid_gradients_match(name: &str, f: &Value) {
    let d = Device::flex();
    let ad = d.clone().autodiff();
    let c = case(f, &ad);
    let mut worst: f64 = 0.0;
    for (normalize, want) in [(false, f), (true, &f["normalized"])] {
        let leaves: Vec<Tensor<2>> = c
            .params
            .tensors
            .iter()
            .map(|(_, _, p)| p.clone().require_grad())
            .collect();
        let model = c.params.model(&leaves);
        let loss = mean_loss(
            LossKind::AttnDistillHybrid,
            normalize,
            &all_terms(&c, &model),
        );
        let grads = loss.backward();
        let grads: Vec<Tensor<2>> = leaves.iter().map(|l| l.grad(&grads).unwrap()).collect();
        // Training stacks each width group's decoders; the reference names one per layer.
        let stacked = c
            .params
            .tensors
            .iter()
            .zip(&grads)
            .map(|((n, shape, _), g)| {
                let (shape, data) = (shape.clone(), host(g));
                (n.clone(), HostTensor { shape, data })
            })
            .collect();
        let per_layer = c.params.config.unstack(&stacked);
        assert_eq!(
            per_layer.len(),
            want["hybrid_grads"].as_object().unwrap().len()
        );
        for (tensor, g) in &per_layer {
            let want = floats(&want["hybrid_grads"][tensor]);
            let scale = want.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
            assert_eq!(g.data.len(), want.len(), "{tensor}");
            for (a, b) in g.data.iter().zip(&want) {
                worst = worst.max(f64::from((a - b).abs() / scale));
                assert!(
                    (a - b).abs() <= 1e-4 * scale,
                    "{name} {tensor} (normalize_attention {normalize}): grad {a} vs {b}"
                );
            }
        }
        let norm = global_norm(&grads);
        let want_norm = want["grad_norm"].as_f64().unwrap();
        assert!(
            close(norm, want_norm, 1e-4),
            "{name} normalize_attention {normalize}: {norm} vs {want_norm}"
        );
    }
    eprintln!("{name} gradients: largest deviation from torch {worst:.2e} of the tensor's largest");
}

/// The fixture's step config: the trainer's schedule, AdamW and clip, the normalised hybrid
/// loss, every position a query (`queries_per_sequence` above every length).
fn step_config(f: &Value) -> FThetaTrainConfig {
    let (st, adam, l) = (&f["steps"]["schedule"], &f["adam"], &f["lambdas"]);
    FThetaTrainConfig::parse(
        std::path::Path::new("f-theta.toml"),
        &format!(
            r#"
[data]
dataset = "unused"
[model]
verifier = "unused"
drafter = "unused"
rank = {}
[loss]
kind = "attn_distill_hybrid"
lambdas = {{ kdir = {}, vdir = {}, kmag = {}, vmag = {} }}
queries_per_sequence = 64
normalize_attention = true
[train]
steps = {}
warmup_steps = {}
lr = {}
sequences_per_step = 2
beta1 = {}
beta2 = {}
eps = {}
weight_decay = {}
grad_clip = {}
[output]
dir = "unused"
export = "unused"
"#,
            f["dims"]["rank"],
            l["kdir"],
            l["vdir"],
            l["kmag"],
            l["vmag"],
            st["steps"],
            st["warmup"],
            st["peak"],
            adam["betas"][0],
            adam["betas"][1],
            adam["eps"],
            adam["weight_decay"],
            adam["clip"],
        ),
    )
    .unwrap()
}

/// The fixture's step sequences as the trainer reads them.
fn step_batch(f: &Value) -> Vec<SeqData> {
    f["steps"]["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, s)| SeqData {
            seq: i,
            len: usize_of(&s["len"]),
            dk: floats(&s["drafter_k"]),
            dv: floats(&s["drafter_v"]),
            layers: (0..usize_of(&f["dims"]["layers"]))
                .map(|l| LayerData {
                    q: floats(&s["q_raw"][l]),
                    k: floats(&s["k_raw"][l]),
                    v: floats(&s["v_raw"][l]),
                    o: floats(&s["o_tgt"][l]),
                })
                .collect(),
            saturated: 0,
        })
        .collect()
}

/// Every step of the trainer's path from the fixture's f_θ: per step the loss, the learning
/// rate, the gradient norm before clipping and the weights after the step.
type Step = (f64, f64, f64, Vec<(String, Vec<f32>)>);

fn trainer_steps(f: &Value, cfg: &FThetaTrainConfig) -> Vec<Step> {
    let d = Device::flex();
    let ad = d.clone().autodiff();
    let mut params = params(f, &d);
    let frozen = frozen_groups(&frozen(f, &ad), &params.config);
    let batch = step_batch(f);
    let mut moments: Vec<Moments> = params
        .tensors
        .iter()
        .map(|(_, _, p)| Moments::zeros_like(p))
        .collect();
    (0..cfg.train.steps)
        .map(|t| {
            let leaves = leaves(&params.tensors);
            let model = params.model(&leaves);
            let loss = batch_loss(&model, &frozen, &batch, cfg, t, &ad);
            let loss_value = value(loss.clone());
            let (lr, norm) = optimizer_step(cfg, t, loss, &leaves, &mut params, &mut moments);
            // Per layer, as the reference names them.
            let after = params
                .to_checkpoint()
                .tensors
                .into_iter()
                .map(|(n, t)| (n, t.data))
                .collect();
            (loss_value, lr, norm, after)
        })
        .collect()
}

/// Largest absolute difference between the weights and the reference's after a step.
fn weight_deviation(f: &Value, step: usize, after: &[(String, Vec<f32>)]) -> f64 {
    let want = &f["steps"]["record"][step]["after"];
    let mut worst: f64 = 0.0;
    assert_eq!(after.len(), want.as_object().unwrap().len());
    for (name, got) in after {
        let want = floats(&want[name]);
        assert_eq!(got.len(), want.len(), "{name}");
        for (a, b) in got.iter().zip(&want) {
            worst = worst.max(f64::from((a - b).abs()));
        }
    }
    worst
}

#[test]
fn five_trainer_steps_match_torch_adamw_with_a_clipped_global_norm() {
    let f = fixture();
    let tol = f["steps"]["tolerance"].as_f64().unwrap();
    assert_eq!(tol, 1e-5);
    let cfg = step_config(&f);
    let steps = trainer_steps(&f, &cfg);
    let record = f["steps"]["record"].as_array().unwrap();
    assert_eq!(steps.len(), record.len());
    let mut worst: f64 = 0.0;
    let mut clipped = 0;
    for (t, ((loss, lr, norm, after), r)) in steps.iter().zip(record).enumerate() {
        let want_loss = r["loss"].as_f64().unwrap();
        assert!(
            close(*loss, want_loss, 1e-4),
            "step {t}: loss {loss} vs {want_loss}"
        );
        let want_lr = r["lr"].as_f64().unwrap();
        assert!(close(*lr, want_lr, 1e-12), "step {t}: lr {lr} vs {want_lr}");
        let want_norm = r["grad_norm"].as_f64().unwrap();
        assert!(
            close(*norm, want_norm, 1e-4),
            "step {t}: grad norm {norm} vs {want_norm}"
        );
        clipped += usize::from(*norm > cfg.train.grad_clip);
        let dev = weight_deviation(&f, t, after);
        worst = worst.max(dev);
        assert!(dev <= tol, "step {t}: weights {dev:.3e} from torch's");
    }
    eprintln!("five steps: weights at most {worst:.3e} from torch's");
    // The clip acts at the first steps (and not at the last), so its factor differs from step
    // to step and Adam's moments see it: without the clip the same steps end far from torch's.
    assert!(clipped >= 2 && clipped < steps.len(), "{clipped} clipped");
    let mut off = cfg.clone();
    off.train.grad_clip = 0.0;
    let unclipped = trainer_steps(&f, &off);
    let last = steps.len() - 1;
    let dev = weight_deviation(&f, last, &unclipped[last].3);
    eprintln!("without the clip: {dev:.3e} from torch's clipped steps");
    assert!(dev > 100.0 * tol, "the clip is invisible: {dev:.3e}");
}

#[test]
fn the_trainers_step_reaches_f_theta_only_not_the_verifiers_weights() {
    let d = Device::flex();
    let ad = d.clone().autodiff();
    let cfg = tiny_config(4);
    let v = Gemma3Model::from_checkpoint(random_checkpoint(&cfg, 3), &d).unwrap();
    let frozen = frozen_layers(&v, &ad);
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    let q = cfg.num_attention_heads * cfg.head_dim;
    let config = FThetaConfig {
        loss: "attn_distill_hybrid".into(),
        ..f_theta_config(1, 6, FThetaInputs::Own, 5, cfg.num_hidden_layers, kv)
    };
    let mut params = FThetaParams::init(config, 1, &d);
    let groups = frozen_groups(&frozen, &params.config);
    let r = |n: usize, s: u64| -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u64 * 2654435761 + s) % 1000) as f32 / 500.0) - 1.0)
            .collect()
    };
    // Two sequences of 9 and 7 positions; the trainer draws 4 query positions in each.
    let batch: Vec<SeqData> = [9usize, 7]
        .iter()
        .enumerate()
        .map(|(i, &n)| SeqData {
            seq: i,
            len: n,
            dk: r(n * 6, 1 + i as u64),
            dv: r(n * 6, 2 + i as u64),
            layers: (0..cfg.num_hidden_layers as u64)
                .map(|l| LayerData {
                    q: r(n * q, 10 + l),
                    k: r(n * kv, 20 + l),
                    v: r(n * kv, 30 + l),
                    o: r(n * cfg.hidden_size, 40 + l),
                })
                .collect(),
            saturated: 0,
        })
        .collect();
    let tc = FThetaTrainConfig::parse(
        std::path::Path::new("f-theta.toml"),
        r#"
[data]
dataset = "unused"
[model]
verifier = "unused"
drafter = "unused"
rank = 5
[loss]
kind = "attn_distill_hybrid"
queries_per_sequence = 4
normalize_attention = true
[train]
steps = 10
lr = 1e-2
[output]
dir = "unused"
export = "unused"
"#,
    )
    .unwrap();
    // The trainer's loss, differentiated: every f_θ tensor gets a gradient, no verifier one.
    let leaves0 = leaves(&params.tensors);
    let model = params.model(&leaves0);
    let grads = batch_loss(&model, &groups, &batch, &tc, 0, &ad).backward();
    // Both sequences in one pass, padded (as on a GPU: rows one after the other, each query
    // masked to its own sequence, 16 rows padded to 24 and 8 queries to 12) give the loss and
    // gradients of one pass per sequence.
    let leaves_joint = leaves(&params.tensors);
    let joint = batch_loss_in(
        &params.model(&leaves_joint),
        &groups,
        &batch,
        &tc,
        0,
        &ad,
        Passes {
            sequences: 2,
            pad: 12,
        },
    );
    let one = Passes {
        sequences: 1,
        pad: 1,
    };
    let alone = batch_loss_in(&model, &groups, &batch, &tc, 0, &ad, one);
    let (j, a) = (value(joint.clone()), value(alone));
    assert!(
        close(j, a, 1e-6),
        "two sequences in one pass: {j} vs {a} one at a time"
    );
    let joint_grads = joint.backward();
    for (((name, _, _), l0), l1) in params.tensors.iter().zip(&leaves0).zip(&leaves_joint) {
        let (g0, g1) = (
            host(&l0.grad(&grads).unwrap()),
            host(&l1.grad(&joint_grads).unwrap()),
        );
        let scale = g0.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        let worst = g0
            .iter()
            .zip(&g1)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-5 * scale,
            "{name}: gradients differ by {worst:e} of {scale:e}"
        );
    }
    for ((name, _, _), leaf) in params.tensors.iter().zip(&leaves0) {
        let g = leaf
            .grad(&grads)
            .unwrap_or_else(|| panic!("{name} got no gradient"));
        let s = f64::from(g.abs().sum().into_scalar::<f32>());
        assert!(s > 0.0, "{name}: zero gradient");
    }
    for (l, fr) in frozen.iter().enumerate() {
        assert!(
            fr.o_proj.grad(&grads).is_none(),
            "layer {l} o_proj got a gradient"
        );
        assert!(
            fr.q_norm.scale.grad(&grads).is_none(),
            "layer {l} q_norm got a gradient"
        );
        assert!(
            fr.k_norm.scale.grad(&grads).is_none(),
            "layer {l} k_norm got a gradient"
        );
    }
    // A real step: every f_θ tensor moves, the verifier's pieces stay its own weights.
    let before: Vec<Vec<f32>> = params.tensors.iter().map(|(_, _, p)| host(p)).collect();
    let mut moments: Vec<Moments> = params
        .tensors
        .iter()
        .map(|(_, _, p)| Moments::zeros_like(p))
        .collect();
    let leaves1 = leaves(&params.tensors);
    let model = params.model(&leaves1);
    let loss = batch_loss(&model, &groups, &batch, &tc, 0, &ad);
    optimizer_step(&tc, 0, loss, &leaves1, &mut params, &mut moments);
    for ((name, _, p), b) in params.tensors.iter().zip(&before) {
        let moved = host(p).iter().zip(b).filter(|(x, y)| x != y).count();
        assert_eq!(
            moved,
            b.len(),
            "{name}: {moved} of {} elements moved",
            b.len()
        );
    }
    let same = |a: Vec<f32>, b: Vec<f32>| a == b;
    let data1 = |t: &Tensor<1>| t.clone().into_data().try_into_vec::<f32>().unwrap();
    for (l, (fr, layer)) in frozen.iter().zip(&v.layers).enumerate() {
        assert!(!fr.o_proj.is_require_grad() && !fr.k_norm.scale.is_require_grad());
        assert!(!fr.q_norm.scale.is_require_grad(), "layer {l}");
        assert!(
            same(host(&fr.o_proj), host(&layer.attn.o_proj.weight)),
            "layer {l} o_proj"
        );
        assert!(
            same(data1(&fr.q_norm.scale), data1(&layer.attn.q_norm.scale)),
            "layer {l}"
        );
        assert!(
            same(data1(&fr.k_norm.scale), data1(&layer.attn.k_norm.scale)),
            "layer {l}"
        );
    }
}

/// The trainer's pass over a width group's layers at once (stacked decoders, stacked frozen
/// pieces, per-layer masks and RoPE tables) equals the terms of each layer alone.
#[test]
fn stacked_layers_give_each_layers_own_terms() {
    for (name, f) in fixtures() {
        let d = Device::flex();
        let c = case(&f, &d);
        let model = c.params.model(&weights(&c.params));
        let alone = all_terms(&c, &model);
        let zk = model.k.encode(c.dk.clone());
        let zv = model.v.encode(c.dv.clone());
        let groups = frozen_groups(&c.frozen, &c.params.config);
        assert!(
            groups.iter().any(|g| g.ids.len() > 1),
            "{name}: no group to stack"
        );
        for fr in &groups {
            let members: Vec<LayerTargets> = fr.ids.iter().map(|&l| c.targets[l].clone()).collect();
            let stack3 = |pick: &dyn Fn(&LayerTargets) -> Tensor<2>| {
                Tensor::stack::<3>(members.iter().map(pick).collect(), 0)
            };
            let mut scales = TargetScales::default();
            for (t, l) in members.iter().zip(&fr.layers) {
                let o = host(t.o.as_ref().unwrap());
                scales.push(&host(&t.k), &host(&t.v), Some(&o), l.head_dim);
            }
            let tg = GroupTargets {
                q_raw: Some(stack3(&|t| t.q_raw.clone().unwrap())),
                rows: Rows::one(members[0].k.dims()[0], &members[0].q_pos),
                k: stack3(&|t| t.k.clone()),
                v: stack3(&|t| t.v.clone()),
                o: Some(stack3(&|t| t.o.clone().unwrap())),
                scales: vec![scales],
            };
            let decoded = |path: &kakeya_models::ftheta::FThetaPath, z: &Tensor<2>| {
                let each = fr.ids.iter().map(|&l| path.decode(z.clone(), l)).collect();
                Tensor::stack::<3>(each, 0)
            };
            let terms = group_terms(fr, &tg, decoded(&model.k, &zk), decoded(&model.v, &zv));
            let loss = host1(&layer_loss(
                LossKind::AttnDistillHybrid,
                &Lambdas::default(),
                true,
                &terms,
            ));
            for (i, &l) in fr.ids.iter().enumerate() {
                let want = value(layer_loss(
                    LossKind::AttnDistillHybrid,
                    &Lambdas::default(),
                    true,
                    &alone[l],
                ));
                assert!(
                    close(f64::from(loss[i]), want, 1e-5),
                    "{name} layer {l}: stacked {} vs alone {want}",
                    loss[i]
                );
                let (a, b) = (terms.diagnostics()[i], alone[l].diagnostics()[0]);
                for (x, y) in [
                    (a.mse_o_ratio, b.mse_o_ratio),
                    (a.kdir, b.kdir),
                    (a.vmag, b.vmag),
                ] {
                    assert!(close(x, y, 1e-5), "{name} layer {l}: {a:?} vs {b:?}");
                }
            }
        }
    }
}

fn host1(t: &Tensor<1>) -> Vec<f32> {
    t.clone().into_data().try_into_vec::<f32>().unwrap()
}
