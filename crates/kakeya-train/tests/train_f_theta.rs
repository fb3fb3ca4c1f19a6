//! f_θ training on a tiny random verifier and drafter: training lowers the held-out
//! attention-output error, the export loads and refuses another model pair, the reloaded export
//! reproduces the report's held-out figures, `init_from` starts from exactly the exported
//! weights, resuming is bit-for-bit, a NaN loss stops training with its step and keeps the last
//! good checkpoint, and datasets without the needed columns are refused before training.

mod f_theta_data;

use std::path::Path;

use burn::tensor::Device;
use f_theta_data::{ALL, DSHA, VSHA, capture, config, opts};
use kakeya_capture::Dataset;
use kakeya_models::testing::Scratch;
use kakeya_models::testing::{random_checkpoint, tiny_config};
use kakeya_models::{FTheta, GemmaModel};
use kakeya_train::TrainError;
use kakeya_train::ftheta::config::FThetaInit;
use kakeya_train::ftheta::data::SeqData;
use kakeya_train::ftheta::step::{evaluate, frozen_groups, frozen_layers};
use kakeya_train::ftheta::train::FEval;
use kakeya_train::ftheta::{FEvent, FThetaReport, FThetaTrainConfig, prepare, train_f_theta};
use kakeya_weights::FThetaCheckpoint;

fn verifier() -> GemmaModel {
    // Window 8: the sliding layers' masks cut into these 20–40-position sequences.
    GemmaModel::from_checkpoint(random_checkpoint(&tiny_config(8), 11), &Device::flex()).unwrap()
}

/// Prepares and trains `cfg` on `v` with the default options, ignoring progress events.
fn train_quietly(cfg: &FThetaTrainConfig, v: &GemmaModel) -> FThetaReport {
    train_f_theta(
        cfg,
        v,
        prepare(cfg, v, VSHA, DSHA).unwrap(),
        &opts(),
        &mut |_| {},
    )
    .unwrap()
}

#[test]
fn training_lowers_the_heldout_attention_error_and_exports_for_its_model_pair() {
    let s = Scratch::new("ftheta-learn");
    let v = verifier();
    let ds = capture(&s.0, &v, 25, ALL, true);
    let run = s.0.join("run");
    let mut cfg = config(&ds, &run, 120, "");
    // From a random start, so that the learning is the optimiser's.
    cfg.model.init = FThetaInit::Random;
    let setup = prepare(&cfg, &v, VSHA, DSHA).unwrap();
    assert_eq!((setup.info.train.len(), setup.info.heldout.len()), (20, 5));
    let report = train_f_theta(&cfg, &v, setup, &opts(), &mut |_| {}).unwrap();
    // On a GPU every step is replayed from a recording (`[train] graph`); the CPU never replays.
    let gpu = kakeya_models::gpu::is_gpu(&opts().device);
    assert_eq!(report.replayed_steps, if gpu { 120 } else { 0 });
    let first = &report.evals[0];
    let last = report.evals.last().unwrap();
    let ratio = |e: &kakeya_train::ftheta::train::FEval| {
        e.per_layer.iter().map(|d| d.mse_o_ratio).sum::<f64>() / e.per_layer.len() as f64
    };
    eprintln!(
        "held-out mseO ratio {:.4} → {:.4}; kDir {:.4} → {:.4}; floor {:?}",
        ratio(first),
        ratio(last),
        first.sliding.kdir,
        last.sliding.kdir,
        report.floor.as_ref().map(|f| f.sliding.mse_o_ratio)
    );
    assert!(
        ratio(last) < 0.5 * ratio(first),
        "held-out attention error {} → {}",
        ratio(first),
        ratio(last)
    );
    // The verifier's own K/V through the recomputation reproduce the captured outputs.
    let floor = report.floor.as_ref().unwrap();
    assert!(floor.sliding.mse_o_ratio < 1e-8 && floor.global.mse_o_ratio < 1e-8);
    assert!(run.join("report.json").is_file() && run.join("curves.png").is_file());
    let dir = run.join("export");
    let ck = FThetaCheckpoint::read_dir(&dir).unwrap();
    assert_eq!(ck.config.rank, 32);
    assert_eq!(ck.config.drafter_layers, vec![0, 1]);
    ck.check_pair(&dir, VSHA, DSHA).unwrap();
    let e = ck.check_pair(&dir, DSHA, DSHA).unwrap_err().to_string();
    assert!(e.contains("config.json") && e.contains("verifier"), "{e}");
}

#[test]
fn the_least_squares_start_predicts_raw_kv_better_than_a_random_one() {
    let s = Scratch::new("ftheta-lstsq");
    let v = verifier();
    let ds = capture(&s.0, &v, 25, ALL, true);
    // Rank 32 is below the 64-wide input (reduced rank), 64 holds the full fit.
    let first_eval = |init: FThetaInit, rank: usize, name: &str| {
        let mut cfg = config(&ds, &s.0.join(name), 6, "");
        cfg.model.init = init;
        cfg.model.rank = Some(rank);
        let setup = prepare(&cfg, &v, VSHA, DSHA).unwrap();
        let mut fitted = 0;
        let r = train_f_theta(&cfg, &v, setup, &opts(), &mut |e| {
            if let FEvent::Fitting { done, total } = e {
                assert!(done <= total && total == 20);
                fitted = done;
            }
        })
        .unwrap();
        assert_eq!(r.evals[0].step, 0);
        (r.evals[0].clone(), fitted)
    };
    let (random, none) = first_eval(FThetaInit::Random, 32, "random");
    let (low, read) = first_eval(FThetaInit::LeastSquares, 32, "lstsq-32");
    let (full, _) = first_eval(FThetaInit::LeastSquares, 64, "lstsq-64");
    assert_eq!((none, read), (0, 20));
    for (name, e) in [("random", &random), ("rank 32", &low), ("rank 64", &full)] {
        eprintln!(
            "before any step, {name}: K rel-MSE {:.4}/{:.4}, V rel-MSE {:.4}/{:.4}, mseO ratio {:.4}/{:.4} (sliding/global)",
            e.sliding.k_rel_mse,
            e.global.k_rel_mse,
            e.sliding.v_rel_mse,
            e.global.v_rel_mse,
            e.sliding.mse_o_ratio,
            e.global.mse_o_ratio
        );
    }
    for (r, l, f) in [
        (&random.sliding, &low.sliding, &full.sliding),
        (&random.global, &low.global, &full.global),
    ] {
        // Predicting each target's mean already gives a relative MSE of about 1; the fits
        // must do better than that and than a random map. (Held out, more codes need not fit
        // better: this drafter's K/V span fewer than 32 dimensions.)
        for fit in [l, f] {
            assert!(fit.k_rel_mse < 0.9 && fit.v_rel_mse < 0.9, "{fit:?}");
            assert!(fit.k_rel_mse < r.k_rel_mse && fit.v_rel_mse < r.v_rel_mse);
            assert!(fit.mse_o_ratio < r.mse_o_ratio);
        }
    }
}

/// Every number of an evaluation, by its JSON path (the step excepted).
fn figures(e: &FEval) -> Vec<(String, f64)> {
    fn walk(path: String, v: &serde_json::Value, out: &mut Vec<(String, f64)>) {
        match v {
            serde_json::Value::Number(n) => out.push((path, n.as_f64().unwrap())),
            serde_json::Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    walk(format!("{path}[{i}]"), x, out);
                }
            }
            serde_json::Value::Object(o) => {
                for (k, x) in o {
                    walk(format!("{path}.{k}"), x, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(String::new(), &serde_json::to_value(e).unwrap(), &mut out);
    out.retain(|(p, _)| p != ".step");
    out
}

/// The largest relative difference between two evaluations' figures (they must have the same
/// ones).
fn largest_difference(a: &FEval, b: &FEval) -> f64 {
    let (a, b) = (figures(a), figures(b));
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|((pa, x), (pb, y))| {
            assert_eq!(pa, pb);
            (x - y).abs() / x.abs().max(y.abs()).max(1e-30)
        })
        .fold(0.0, f64::max)
}

/// The dtype of every tensor in a safetensors file, from its header.
fn safetensors_dtypes(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .map(|(_, v)| v["dtype"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn the_reloaded_export_reproduces_the_reports_heldout_figures() {
    let s = Scratch::new("ftheta-export");
    let v = verifier();
    let ds = capture(&s.0, &v, 10, ALL, true);
    let run = s.0.join("run");
    let cfg = config(&ds, &run, 8, "");
    let setup = prepare(&cfg, &v, VSHA, DSHA).unwrap();
    let info = setup.info.clone();
    train_f_theta(&cfg, &v, setup, &opts(), &mut |_| {}).unwrap();
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    let evals: Vec<FEval> = serde_json::from_value(report["evals"].clone()).unwrap();
    let (first, last) = (&evals[0], evals.last().unwrap());
    assert_eq!(last.step, 8);
    // Training moved the figures, so reproducing them needs the trained weights.
    assert!(largest_difference(first, last) > 1e-3);
    // The export stores f32, the trainer's own precision: the reloaded f_θ is the trained one,
    // and the same evaluation gives the same figures (up to the report's JSON round trip).
    let dir = run.join("export");
    let dtypes = safetensors_dtypes(&dir.join("f_theta.safetensors"));
    assert!(
        !dtypes.is_empty() && dtypes.iter().all(|d| d == "F32"),
        "{dtypes:?}"
    );
    let ck = FThetaCheckpoint::read_dir(&dir).unwrap();
    // On the device that trained and evaluated it (the same kernels give the same bits).
    let d = kakeya_models::testing::test_device();
    let model = FTheta::from_checkpoint(&ck, &d).unwrap();
    let frozen = frozen_groups(&frozen_layers(&v, &d), &model.config);
    let data = Dataset::open(&ds).unwrap();
    let held: Vec<SeqData> = info
        .heldout
        .iter()
        .map(|&q| info.read(&data, q).unwrap())
        .collect();
    let again = evaluate(&model, &frozen, &held, &cfg, last.step, false).unwrap();
    let diff = largest_difference(&again, last);
    eprintln!("reloaded export vs report.json: largest relative difference {diff:.2e}");
    assert!(
        diff <= 1e-12,
        "the reloaded f_θ's figures differ by {diff:.2e}"
    );
}

#[test]
fn init_from_starts_from_exactly_the_exported_weights() {
    let s = Scratch::new("ftheta-init-from");
    let v = verifier();
    let ds = capture(&s.0, &v, 10, ALL, true);
    let first = s.0.join("first");
    let cfg = config(&ds, &first, 6, "");
    let a = train_quietly(&cfg, &v);
    let (fresh, trained) = (&a.evals[0], a.evals.last().unwrap());
    assert_eq!(trained.step, 6);
    // The warm start's figures before any step are the exported model's, not a fresh start's.
    let mut warm = config(&ds, &s.0.join("warm"), 6, "");
    warm.model.init_from = Some(first.join("export"));
    let b = train_quietly(&warm, &v);
    assert_eq!(b.evals[0].step, 0);
    let same = largest_difference(&b.evals[0], trained);
    let apart = largest_difference(fresh, trained);
    eprintln!("init_from step 0 vs the export's figures {same:.2e}; a fresh start {apart:.2e}");
    assert!(
        same <= 1e-12,
        "init_from's step 0 is {same:.2e} from the export's figures"
    );
    assert!(apart > 1e-3, "a fresh start is only {apart:.2e} from them");
}

fn export_bytes(run: &Path) -> Vec<u8> {
    std::fs::read(run.join("export").join("f_theta.safetensors")).unwrap()
}

#[test]
fn resuming_after_an_interruption_is_bit_for_bit() {
    let s = Scratch::new("ftheta-resume");
    let v = verifier();
    let ds = capture(&s.0, &v, 10, ALL, true);
    let whole = s.0.join("whole");
    let cfg = config(&ds, &whole, 10, "");
    train_quietly(&cfg, &v);
    let parts = s.0.join("parts");
    let cfg = config(&ds, &parts, 10, "");
    let mut o = opts();
    o.stop_after = Some(7);
    let e = train_f_theta(
        &cfg,
        &v,
        prepare(&cfg, &v, VSHA, DSHA).unwrap(),
        &o,
        &mut |_| {},
    )
    .unwrap_err();
    assert!(matches!(e, TrainError::Interrupted(7)), "{e}");
    // Without --resume an existing state is not overwritten.
    let e = train_f_theta(
        &cfg,
        &v,
        prepare(&cfg, &v, VSHA, DSHA).unwrap(),
        &opts(),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("--resume"), "{e}");
    let mut o = opts();
    o.resume = true;
    train_f_theta(
        &cfg,
        &v,
        prepare(&cfg, &v, VSHA, DSHA).unwrap(),
        &o,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(export_bytes(&whole), export_bytes(&parts));
}

#[test]
fn a_non_finite_loss_stops_training_with_its_step_and_keeps_the_last_good_checkpoint() {
    let s = Scratch::new("ftheta-nan");
    let v = verifier();
    let ds = capture(&s.0, &v, 10, ALL, true);
    let run = s.0.join("run");
    // A learning rate of 1e30 sends every weight to ~1e30 after one step: K̂ overflows f32.
    let mut cfg = config(&ds, &run, 10, "");
    cfg.train.lr = 1e30;
    cfg.train.warmup_steps = 0;
    cfg.output.checkpoint_every = 1;
    let mut saved = Vec::new();
    let e = train_f_theta(
        &cfg,
        &v,
        prepare(&cfg, &v, VSHA, DSHA).unwrap(),
        &opts(),
        &mut |ev| {
            if let kakeya_train::ftheta::FEvent::Saved(n) = ev {
                saved.push(n);
            }
        },
    )
    .unwrap_err();
    let TrainError::NonFinite { step, ref kept, .. } = e else {
        panic!("expected a non-finite loss, got {e}");
    };
    assert_eq!(step, 2, "{e}");
    assert_eq!(kept, "step 1");
    assert_eq!(saved, vec![1]);
    let msg = e.to_string();
    assert!(msg.contains("step 2") && msg.contains("step 1"), "{msg}");
    // The kept state is step 1's and nothing was exported.
    let st = std::fs::read_to_string(run.join("state").join("state.json")).unwrap();
    let st: serde_json::Value = serde_json::from_str(&st).unwrap();
    assert_eq!(st["step"], 1);
    assert!(!run.join("export").exists());
}

#[test]
fn datasets_without_the_needed_columns_are_refused_before_training() {
    let s = Scratch::new("ftheta-bad");
    let v = verifier();
    let run = s.0.join("run");
    // Raw K/V only: enough for mse, not for the attention losses.
    let kv_only = capture(&s.0, &v, 5, r#""k_raw", "v_raw""#, true);
    let cfg = config(&kv_only, &run, 10, "");
    let e = prepare(&cfg, &v, VSHA, DSHA).err().unwrap().to_string();
    assert!(
        e.contains(&kv_only.display().to_string()) && e.contains("v00_q_raw"),
        "{e}"
    );
    let mut mse = cfg.clone();
    mse.loss.kind = kakeya_train::ftheta::LossKind::Mse;
    prepare(&mse, &v, VSHA, DSHA).unwrap();
    // No drafter K/V at all.
    let no_drafter = capture(&s.0, &v, 5, ALL, false);
    let cfg = config(&no_drafter, &run, 10, "");
    let e = prepare(&cfg, &v, VSHA, DSHA).err().unwrap().to_string();
    assert!(e.contains("no drafter K/V"), "{e}");
    // Another verifier or drafter.
    let ds = capture(&s.0, &v, 5, ALL, true);
    let cfg = config(&ds, &run, 10, "");
    let e = prepare(&cfg, &v, DSHA, DSHA).err().unwrap().to_string();
    assert!(e.contains("recapture with this verifier"), "{e}");
    let e = prepare(&cfg, &v, VSHA, VSHA).err().unwrap().to_string();
    assert!(e.contains("recapture with this drafter"), "{e}");
    assert!(!run.exists());
}

/// Trains `KAKEYA_FTHETA_STEPS` steps (default 6; the warm-up is 5) on the test device and nothing else: the probe
/// of `scripts/kernel_count.sh f-theta`, whose two counts' difference is the launches of the
/// steps between them.
#[test]
#[ignore = "a probe for scripts/kernel_count.sh"]
fn f_theta_steps_for_the_kernel_count() {
    let steps = std::env::var("KAKEYA_FTHETA_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6);
    let s = Scratch::new("ftheta-count");
    let v = verifier();
    let ds = capture(&s.0, &v, 10, ALL, true);
    let mut cfg = config(&ds, &s.0.join("run"), steps, "");
    cfg.output.checkpoint_every = 1000;
    cfg.output.eval_every = 1000;
    // KAKEYA_FTHETA_GRAPH=0: every step issued from the host (`[train] graph = false`).
    cfg.train.graph = std::env::var("KAKEYA_FTHETA_GRAPH").as_deref() != Ok("0");
    let report = train_quietly(&cfg, &v);
    assert_eq!(report.steps.len(), steps);
    let secs = report.steps.iter().skip(2).map(|s| s.secs).collect();
    let median = kakeya_train::run::median_secs(secs);
    eprintln!(
        "median step {:.2} ms (graph: {})",
        1e3 * median,
        cfg.train.graph
    );
}
