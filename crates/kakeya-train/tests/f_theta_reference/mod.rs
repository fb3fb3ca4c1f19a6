//! The PyTorch reference of f_θ's losses, gradients and trainer steps
//! (`tests/fixtures/f_theta/make_f_theta.py [--gemma4]` → `f_theta.json`,
//! `f_theta_gemma4.json`) read into Kakeya's types, for `f_theta_losses.rs` and
//! `f_theta_steps.rs`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::rope::Rope;
use kakeya_models::testing::f_theta_config;
use kakeya_models::{FTheta, norm::RmsNorm};
use kakeya_train::ftheta::loss::{
    Lambdas, LayerFrozen, LayerTargets, LossKind, Terms, layer_loss, layer_terms,
};
use kakeya_train::ftheta::params::FThetaParams;
use kakeya_weights::ftheta::FThetaInputs;
use kakeya_weights::{FThetaConfig, HostTensor};
use serde_json::Value;

pub const KINDS: [LossKind; 5] = [
    LossKind::Mse,
    LossKind::CosMag,
    LossKind::Combined,
    LossKind::AttnDistill,
    LossKind::AttnDistillHybrid,
];

/// `tests/fixtures/f_theta/<name>`.
pub fn fixture_named(name: &str) -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/f_theta")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// The Gemma 3-shaped fixture (with the trainer's steps).
pub fn fixture() -> Value {
    fixture_named("f_theta.json")
}

/// Both fixtures, named: Gemma 3's layers, and Gemma 4's (per-layer K/V geometry, proportional
/// RoPE on the full layer, scale 1, v_norm).
pub fn fixtures() -> [(&'static str, Value); 2] {
    [
        ("gemma3", fixture()),
        ("gemma4", fixture_named("f_theta_gemma4.json")),
    ]
}

/// Layer `l`'s value of the per-layer list `key` in the fixture's dims, or the shared `shared`
/// (the Gemma 3 fixture has only the shared ones).
pub fn per_layer(dims: &Value, key: &str, shared: &str, l: usize) -> usize {
    match dims[key].as_array() {
        Some(a) => usize_of(&a[l]),
        None => usize_of(&dims[shared]),
    }
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

pub fn t2(v: &Value, rows: usize, d: &Device) -> Tensor<2> {
    let data = floats(v);
    let cols = data.len() / rows;
    Tensor::from_data(TensorData::new(data, [rows, cols]), d)
}

pub fn usize_of(v: &Value) -> usize {
    v.as_u64().unwrap() as usize
}

pub struct Case {
    pub frozen: Vec<LayerFrozen>,
    pub targets: Vec<LayerTargets>,
    pub params: FThetaParams,
    pub dk: Tensor<2>,
    pub dv: Tensor<2>,
}

/// The fixture verifier's frozen attention pieces on `d`.
pub fn frozen(f: &Value, d: &Device) -> Vec<LayerFrozen> {
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
pub fn params(f: &Value, d: &Device) -> FThetaParams {
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

pub fn case(f: &Value, d: &Device) -> Case {
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

pub fn all_terms(c: &Case, model: &FTheta) -> Vec<Terms> {
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

pub fn mean_loss(kind: LossKind, normalize_attention: bool, terms: &[Terms]) -> Tensor<1> {
    let n = terms.len() as f64;
    terms
        .iter()
        .map(|t| layer_loss(kind, &Lambdas::default(), normalize_attention, t))
        .reduce(|a, b| a + b)
        .unwrap()
        .div_scalar(n)
}

pub fn value(t: Tensor<1>) -> f64 {
    f64::from(t.into_scalar::<f32>())
}

pub fn host(t: &Tensor<2>) -> Vec<f32> {
    t.clone().into_data().try_into_vec::<f32>().unwrap()
}

pub fn weights(p: &FThetaParams) -> Vec<Tensor<2>> {
    p.tensors.iter().map(|(_, _, t)| t.clone()).collect()
}

pub fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * b.abs().max(1.0)
}
