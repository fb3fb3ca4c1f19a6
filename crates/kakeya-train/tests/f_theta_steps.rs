//! Five of the f_θ trainer's own steps (its loss, global clip, AdamW and schedule) against
//! PyTorch's (`tests/fixtures/f_theta/make_f_theta.py` → `f_theta.json`; weights after the
//! steps 1e-5); the property DESIGN §7 asks of them, that the step reaches f_θ only, never the
//! verifier's weights; and a step's sequences in one padded pass (as on a GPU) against one
//! pass per sequence, with gradients.

mod f_theta_reference;

use f_theta_reference::*;

use burn::tensor::{Device, Tensor};
use kakeya_models::GemmaModel;
use kakeya_models::testing::{f_theta_config, random_checkpoint, tiny_config};
use kakeya_train::ftheta::FThetaTrainConfig;
use kakeya_train::ftheta::data::{LayerData, SeqData};
use kakeya_train::ftheta::params::FThetaParams;
use kakeya_train::ftheta::step::{
    GroupFrozen, LayerFrozen, Passes, Prepared, batch_loss, batch_loss_in, frozen_groups,
    frozen_layers, layouts, optimizer_step, prepare_step, prepared_loss,
};
use kakeya_train::optim::Moments;
use kakeya_train::run::leaves;
use kakeya_weights::FThetaConfig;
use kakeya_weights::ftheta::FThetaInputs;
use serde_json::Value;

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
    // On a GPU (`KAKEYA_TEST_DEVICE`) the clip's factor stays on the device and goes into the
    // AdamW kernel: the same five steps must match torch's there too.
    let d = kakeya_models::testing::test_device();
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
            // As the trainer does: the step prepared and staged ahead (its reader's thread),
            // then uploaded. On CUDA staging puts every target buffer in pinned memory.
            let passes = Passes::for_device(&ad);
            let mut prepared = prepare_step(&layouts(&frozen), &batch, cfg, t, passes);
            let (bytes, pinned) = Prepared::stage([&mut prepared], &d);
            assert!(bytes > 0);
            let cuda = std::env::var("KAKEYA_TEST_DEVICE").as_deref() == Ok("cuda");
            assert_eq!(
                pinned,
                if cuda { bytes } else { 0 },
                "bytes staged in pinned memory"
            );
            let loss = prepared_loss(&model, &frozen, &batch, prepared, cfg, &ad);
            let loss_value = value(loss.clone());
            let (lr, norm) =
                optimizer_step(cfg, t, loss, &leaves, &mut params, &mut moments).unwrap();
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

/// A tiny verifier (its attention's pieces frozen on the autodiff device), f_θ's parameters,
/// two sequences of 9 and 7 positions and the trainer's config (4 query positions drawn in
/// each, the normalised hybrid loss): what the step tests below share.
struct StepFixture {
    ad: Device,
    v: GemmaModel,
    frozen: Vec<LayerFrozen>,
    params: FThetaParams,
    groups: Vec<GroupFrozen>,
    batch: Vec<SeqData>,
    tc: FThetaTrainConfig,
}

impl StepFixture {
    /// f_θ's tensors as fresh leaves, and the trainer's loss over them differentiated.
    fn trainer_gradients(&self) -> (Vec<Tensor<2>>, burn::tensor::Gradients) {
        let leaves = leaves(&self.params.tensors);
        let model = self.params.model(&leaves);
        let loss = batch_loss(&model, &self.groups, &self.batch, &self.tc, 0, &self.ad);
        (leaves, loss.backward())
    }
}

fn step_fixture() -> StepFixture {
    let d = Device::flex();
    let ad = d.clone().autodiff();
    let cfg = tiny_config(4);
    let v = GemmaModel::from_checkpoint(random_checkpoint(&cfg, 3), &d).unwrap();
    let frozen = frozen_layers(&v, &ad);
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    let q = cfg.num_attention_heads * cfg.head_dim;
    let config = FThetaConfig {
        loss: "attn_distill_hybrid".into(),
        ..f_theta_config(1, 6, FThetaInputs::Own, 5, cfg.num_hidden_layers, kv)
    };
    let params = FThetaParams::init(config, 1, &d);
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
    StepFixture {
        ad,
        v,
        frozen,
        params,
        groups,
        batch,
        tc,
    }
}

/// A step's sequences in one padded pass (as on a GPU: rows one after the other, each query
/// masked to its own sequence, 16 rows padded to 24 and 8 queries to 12) give the loss of one
/// pass per sequence for every loss kind, and the gradients of the trainer's own pass.
#[test]
fn one_padded_pass_over_two_sequences_equals_a_pass_per_sequence() {
    let fx = step_fixture();
    let (leaves0, grads) = fx.trainer_gradients();
    let StepFixture {
        ad,
        params,
        groups,
        batch,
        tc,
        ..
    } = fx;
    let model = params.model(&leaves0);
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
    // The same for every other loss (those without attention read the raw targets).
    for kind in KINDS {
        let mut other = tc.clone();
        other.loss.kind = kind;
        let passes = |sequences, pad| Passes { sequences, pad };
        let joint = batch_loss_in(&model, &groups, &batch, &other, 0, &ad, passes(2, 12));
        let alone = batch_loss_in(&model, &groups, &batch, &other, 0, &ad, passes(1, 1));
        let (j, a) = (value(joint), value(alone));
        assert!(
            j.is_finite() && close(j, a, 1e-6),
            "{}: {j} in one pass vs {a} one at a time",
            kind.name()
        );
    }
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
}

/// The trainer's loss, differentiated: every f_θ tensor gets a gradient, no verifier one.
#[test]
fn the_trainers_gradients_reach_f_theta_only() {
    let fx = step_fixture();
    let (leaves0, grads) = fx.trainer_gradients();
    let StepFixture { frozen, params, .. } = fx;
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
}

/// A real step: every f_θ tensor moves, the verifier's pieces stay its own weights.
#[test]
fn the_trainers_step_moves_f_theta_only_not_the_verifiers_weights() {
    let StepFixture {
        ad,
        v,
        frozen,
        mut params,
        groups,
        batch,
        tc,
    } = step_fixture();
    let before: Vec<Vec<f32>> = params.tensors.iter().map(|(_, _, p)| host(p)).collect();
    let mut moments: Vec<Moments> = params
        .tensors
        .iter()
        .map(|(_, _, p)| Moments::zeros_like(p))
        .collect();
    let leaves1 = leaves(&params.tensors);
    let model = params.model(&leaves1);
    let loss = batch_loss(&model, &groups, &batch, &tc, 0, &ad);
    optimizer_step(&tc, 0, loss, &leaves1, &mut params, &mut moments).unwrap();
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
            same(host(&fr.o_proj), host(&layer.attn.o_proj.dense_weight())),
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

/// The trainer's steps replayed from a recording (`[train] graph`, on a GPU:
/// `kakeya_train::ftheta::replay`) against the same steps issued one by one. The same kernels
/// run in the same order (the update written in place, its step's hyper-parameters read from a
/// buffer), so the losses, gradient norms and weights are the same bits. The batches alternate
/// between two sequences and one, so two recordings are made and each is replayed with fresh
/// inputs copied into the buffers it recorded. Run with `KAKEYA_TEST_DEVICE=wgpu` (or, built
/// with `--features cuda`, `cuda`: there the recordings are CUDA graphs).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn replayed_steps_equal_the_steps_issued_one_by_one() {
    use kakeya_train::ftheta::pass::PassInputs;
    use kakeya_train::ftheta::replay::Replayer;

    let f = fixture();
    let mut cfg = step_config(&f);
    cfg.train.steps = 6;
    let d = kakeya_models::testing::test_device();
    assert!(
        kakeya_models::gpu::is_gpu(&d),
        "run with KAKEYA_TEST_DEVICE=wgpu (or cuda): steps are replayed on a GPU"
    );
    let ad = d.clone().autodiff();
    let all = step_batch(&f);
    let batch = |t: usize| match t % 2 {
        0 => all.clone(),
        _ => vec![all[1].clone()],
    };
    let run = |replay: bool| {
        let mut p = params(&f, &d);
        let frozen = frozen_groups(&frozen(&f, &ad), &p.config);
        let mut moments: Vec<Moments> = p
            .tensors
            .iter()
            .map(|(_, _, x)| Moments::zeros_like(x))
            .collect();
        let mut replayer =
            replay.then(|| Replayer::new(&cfg, &d, Default::default()).expect("a GPU replays"));
        let mut values = Vec::new();
        for t in 0..cfg.train.steps {
            let b = batch(t);
            if let Some(r) = &mut replayer {
                let passes = Passes::for_device(&ad);
                let prepared = prepare_step(&layouts(&frozen), &b, &cfg, t, passes);
                let host = prepared.into_single_pass().expect("one pass on a GPU");
                let part: Vec<&SeqData> = b.iter().collect();
                let inputs = PassInputs::training(&part, host, &cfg, &ad);
                let stepped = r.step(t, (&p, &moments), (&frozen, &cfg), inputs, b.len());
                values.push(stepped.read().unwrap());
            } else {
                let leaves = leaves(&p.tensors);
                let model = p.model(&leaves);
                let loss = batch_loss(&model, &frozen, &b, &cfg, t, &ad);
                let loss_value = value(loss.clone());
                let (_, norm) =
                    optimizer_step(&cfg, t, loss, &leaves, &mut p, &mut moments).unwrap();
                values.push((loss_value, norm));
            }
        }
        if let Some(r) = &replayer {
            // Replayed from recordings (CUDA graphs; recorded command buffers on wgpu), not by
            // re-running the step.
            assert!(r.replays_graphs(), "the device recorded no graph");
        }
        let weights: Vec<Vec<f32>> = p.tensors.iter().map(|(_, _, x)| host(x)).collect();
        let moments: Vec<Vec<f32>> = moments
            .iter()
            .flat_map(|m| [host(&m.m), host(&m.v)])
            .collect();
        (values, weights, moments)
    };
    let (plain, replayed) = (run(false), run(true));
    for (t, (a, b)) in plain.0.iter().zip(&replayed.0).enumerate() {
        assert_eq!(a, b, "step {t}: (loss, grad norm) one by one vs replayed");
    }
    assert_eq!(plain.1, replayed.1, "weights after the steps");
    assert_eq!(plain.2, replayed.2, "AdamW's moments after the steps");
    // The steps did something: the weights moved from their start.
    let start: Vec<Vec<f32>> = params(&f, &d)
        .tensors
        .iter()
        .map(|(_, _, x)| host(x))
        .collect();
    assert_ne!(start, replayed.1);
}
