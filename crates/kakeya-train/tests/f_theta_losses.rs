//! f_θ's losses, gradients and one AdamW step against the PyTorch reference
//! (`tests/fixtures/f_theta/make_f_theta.py` → `f_theta.json`, tolerance 1e-4), plus the
//! properties DESIGN §7 asks of them: identical K/V give zero loss, the hybrid loss exceeds
//! attn_distill when directions differ, and gradients reach f_θ only.

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::rope::Rope;
use kakeya_models::testing::{f_theta_config, random_checkpoint, tiny_config};
use kakeya_models::{FTheta, Gemma3Model, norm::RmsNorm};
use kakeya_train::ftheta::loss::{
    Lambdas, LayerFrozen, LayerTargets, LossKind, Terms, layer_loss, layer_terms,
};
use kakeya_train::ftheta::params::FThetaParams;
use kakeya_train::optim::{AdamW, Moments, clip_factor, global_norm};
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

fn fixture() -> Value {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/f_theta/f_theta.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
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

fn case(f: &Value, d: &Device) -> Case {
    let dims = &f["dims"];
    let t = usize_of(&dims["t"]);
    let layers = usize_of(&dims["layers"]);
    let hd = usize_of(&dims["head_dim"]);
    let hidden = usize_of(&dims["hidden"]);
    let qpos: Vec<usize> = dims["qpos"]
        .as_array()
        .unwrap()
        .iter()
        .map(usize_of)
        .collect();
    let bases = floats(&dims["rope_bases"]);
    let frozen = (0..layers)
        .map(|l| {
            let global = dims["global_layers"][l].as_bool().unwrap();
            let norm = |k: &str| RmsNorm {
                scale: Tensor::<1>::from_data(TensorData::new(floats(&f["frozen"][k][l]), [hd]), d),
                eps: dims["rms_eps"].as_f64().unwrap(),
            };
            LayerFrozen {
                q_norm: norm("q_norm"),
                k_norm: norm("k_norm"),
                o_proj: t2(&f["frozen"]["o_proj"][l], hidden, d),
                heads: usize_of(&dims["heads"]),
                kv_heads: usize_of(&dims["kv_heads"]),
                head_dim: hd,
                scale: dims["scale"].as_f64().unwrap(),
                window: (!global).then(|| usize_of(&dims["window"])),
                rope: Rope::new(hd, f64::from(bases[usize::from(global)]), 1.0),
            }
        })
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
    let config = FThetaConfig {
        loss: "attn_distill_hybrid".into(),
        ..f_theta_config(
            usize_of(&dims["drafter_layers"]),
            usize_of(&dims["drafter_kv"]),
            FThetaInputs::Own,
            usize_of(&dims["rank"]),
            layers,
            usize_of(&dims["kv_heads"]) * hd,
        )
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
    let params = FThetaParams::from_host(config, &mut host, d).unwrap();
    Case {
        frozen,
        targets,
        params,
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

fn mean_loss(kind: LossKind, terms: &[Terms]) -> Tensor<1> {
    let n = terms.len() as f64;
    terms
        .iter()
        .map(|t| layer_loss(kind, &Lambdas::default(), false, t))
        .reduce(|a, b| a + b)
        .unwrap()
        .div_scalar(n)
}

fn value(t: Tensor<1>) -> f64 {
    f64::from(t.into_scalar::<f32>())
}

fn weights(p: &FThetaParams) -> Vec<Tensor<2>> {
    p.tensors.iter().map(|(_, _, t)| t.clone()).collect()
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs().max(1.0)
}

#[test]
fn every_loss_and_term_matches_the_pytorch_reference() {
    let f = fixture();
    let d = Device::flex();
    let c = case(&f, &d);
    let model = c.params.model(&weights(&c.params));
    let terms = all_terms(&c, &model);
    for kind in KINDS {
        let got = value(mean_loss(kind, &terms));
        let want = f["losses"][kind.name()].as_f64().unwrap();
        assert!(close(got, want, 1e-4), "{}: {got} vs {want}", kind.name());
    }
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
            ("kmag", &t.kmag),
            ("vmag", &t.vmag),
            ("mse_o", t.mse_o.as_ref().unwrap()),
        ];
        for (name, got) in pairs {
            let (got, want) = (value(got.clone()), r[name].as_f64().unwrap());
            assert!(close(got, want, 1e-4), "layer {l} {name}: {got} vs {want}");
        }
    }
}

#[test]
fn identical_kv_give_zero_for_every_loss_and_hybrid_exceeds_attn_distill_when_directions_differ() {
    let f = fixture();
    let d = Device::flex();
    let c = case(&f, &d);
    let exact: Vec<Terms> = c
        .frozen
        .iter()
        .zip(&c.targets)
        .map(|(fr, tg)| layer_terms(fr, tg, tg.k.clone(), tg.v.clone()))
        .collect();
    for kind in KINDS {
        let v = value(mean_loss(kind, &exact));
        assert!(v.abs() < 1e-6, "{}: {v}", kind.name());
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
    let hybrid = value(mean_loss(LossKind::AttnDistillHybrid, &flipped));
    let attn = value(mean_loss(LossKind::AttnDistill, &flipped));
    let dirs: f64 = flipped
        .iter()
        .map(|t| value(t.kdir.clone()) + value(t.cos_v.clone()))
        .sum::<f64>()
        / flipped.len() as f64;
    assert!(dirs > 0.1, "reversed head vectors point elsewhere: {dirs}");
    assert!(
        hybrid > attn + 0.1,
        "hybrid {hybrid} vs attn_distill {attn}"
    );
    assert!(
        close(hybrid - attn, dirs, 1e-3),
        "the difference is the direction terms"
    );
}

#[test]
fn gradients_and_one_clipped_adamw_step_match_the_reference() {
    let f = fixture();
    let d = Device::flex();
    let ad = d.clone().autodiff();
    let c = case(&f, &ad);
    let leaves: Vec<Tensor<2>> = c
        .params
        .tensors
        .iter()
        .map(|(_, _, p)| p.clone().require_grad())
        .collect();
    let model = c.params.model(&leaves);
    let loss = mean_loss(LossKind::AttnDistillHybrid, &all_terms(&c, &model));
    let grads = loss.backward();
    let grads: Vec<Tensor<2>> = leaves.iter().map(|l| l.grad(&grads).unwrap()).collect();
    for ((name, _, _), g) in c.params.tensors.iter().zip(&grads) {
        let want = floats(&f["hybrid_grads"][name]);
        let got = g.clone().into_data().try_into_vec::<f32>().unwrap();
        let scale = want.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-4 * scale, "{name}: grad {a} vs {b}");
        }
    }
    let norm = global_norm(&grads);
    let want_norm = f["grad_norm"].as_f64().unwrap();
    assert!(close(norm, want_norm, 1e-4), "{norm} vs {want_norm}");
    let adam = &f["adam"];
    let opt = AdamW {
        lr: adam["lr"].as_f64().unwrap(),
        beta1: adam["betas"][0].as_f64().unwrap(),
        beta2: adam["betas"][1].as_f64().unwrap(),
        eps: adam["eps"].as_f64().unwrap(),
        weight_decay: adam["weight_decay"].as_f64().unwrap(),
    };
    let factor = clip_factor(norm, adam["clip"].as_f64().unwrap());
    assert!(factor < 1.0, "the fixture's gradient is clipped");
    let base = case(&f, &d);
    for ((name, _, p), g) in base.params.tensors.iter().zip(grads) {
        let g = Tensor::<2>::from_data(g.into_data(), &d).mul_scalar(factor);
        let mut mom = Moments {
            m: p.zeros_like(),
            v: p.zeros_like(),
        };
        let after = opt.update(p.clone(), g, &mut mom, 1, true);
        let got = after.into_data().try_into_vec::<f32>().unwrap();
        let want = floats(&f["after_adamw"][name]);
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5, "{name}: {a} vs {b} after one step");
        }
    }
}

#[test]
fn gradients_reach_f_theta_only_not_the_verifiers_weights() {
    let d = Device::flex();
    let ad = d.clone().autodiff();
    let cfg = tiny_config(4);
    let v = Gemma3Model::from_checkpoint(random_checkpoint(&cfg, 3), &d).unwrap();
    let frozen: Vec<LayerFrozen> = v
        .layers
        .iter()
        .map(|l| LayerFrozen::from_attention(&l.attn, &ad))
        .collect();
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    let q = cfg.num_attention_heads * cfg.head_dim;
    let n = 9;
    let config = FThetaConfig {
        loss: "attn_distill_hybrid".into(),
        ..f_theta_config(1, 6, FThetaInputs::Own, 5, cfg.num_hidden_layers, kv)
    };
    let params = FThetaParams::init(config, 1, &d);
    let leaves: Vec<Tensor<2>> = params
        .tensors
        .iter()
        .map(|(_, _, p)| p.clone().autodiff().require_grad())
        .collect();
    let model = params.model(&leaves);
    let r = |rows: usize, cols: usize, s: u64| {
        let data: Vec<f32> = (0..rows * cols)
            .map(|i| (((i as u64 * 2654435761 + s) % 1000) as f32 / 500.0) - 1.0)
            .collect();
        Tensor::<2>::from_data(TensorData::new(data, [rows, cols]), &ad)
    };
    let zk = model.k.encode(r(n, 6, 1));
    let zv = model.v.encode(r(n, 6, 2));
    let mut loss: Option<Tensor<1>> = None;
    for (l, fr) in frozen.iter().enumerate() {
        let tg = LayerTargets {
            q_raw: Some(r(3, q, 3 + l as u64)),
            q_pos: vec![2, 5, 8],
            k: r(n, kv, 10 + l as u64),
            v: r(n, kv, 20 + l as u64),
            o: Some(r(3, cfg.hidden_size, 30 + l as u64)),
        };
        let t = layer_terms(
            fr,
            &tg,
            model.k.decode(zk.clone(), l),
            model.v.decode(zv.clone(), l),
        );
        let x = layer_loss(LossKind::AttnDistillHybrid, &Lambdas::default(), true, &t);
        loss = Some(match loss {
            Some(a) => a + x,
            None => x,
        });
    }
    let grads = loss.unwrap().backward();
    for ((name, _, _), leaf) in params.tensors.iter().zip(&leaves) {
        let g = leaf
            .grad(&grads)
            .unwrap_or_else(|| panic!("{name} got no gradient"));
        let s = f64::from(g.abs().sum().into_scalar::<f32>());
        assert!(s > 0.0, "{name}: zero gradient");
    }
    for (l, fr) in frozen.iter().enumerate() {
        assert!(fr.o_proj.grad(&grads).is_none(), "layer {l} o_proj");
        assert!(fr.q_norm.scale.grad(&grads).is_none(), "layer {l} q_norm");
        assert!(fr.k_norm.scale.grad(&grads).is_none(), "layer {l} k_norm");
    }
}
