//! f_θ on Gemma 4 verifiers (transformers' tiny `dense` and `dense-kv` fixtures of
//! tests/fixtures/gemma4: sliding and full layers of different K/V geometry, proportional RoPE,
//! scale 1, v_norm, k_eq_v, KV sharing): one decoder per layer with K/V of its own at its width,
//! the loss's attention is the model's, the least-squares start and training lower the held-out
//! errors, and the export restores losslessly in the restored KV modes.

mod f_theta_data;

use std::path::Path;

use burn::tensor::Device;
use f_theta_data::{ALL, DSHA, VSHA, capture, config, opts, tiny_drafter};
use kakeya_models::testing::Scratch;
use kakeya_models::{FTheta, GemmaModel};
use kakeya_runtime::kv::{FThetaRestorer, KvMode, KvPolicy};
use kakeya_runtime::{
    DFlashProposer, GenerationConfig, KvSetup, Session, SpecConfig, Verifier, generate,
    speculative_generate,
};
use kakeya_train::ftheta::config::FThetaInit;
use kakeya_train::ftheta::train::FEval;
use kakeya_train::ftheta::{prepare, train_f_theta};
use kakeya_weights::{Checkpoint, FThetaCheckpoint};

#[test]
fn f_theta_trains_on_gemma4_verifiers_and_restores_their_kv() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // transformers' tiny Gemma 4s: sliding layers 2 × 16 wide; full layers 1 × 32 with k_eq_v
    // (`dense`) or 2 × 32 (`dense-kv`) and proportional RoPE; scale 1, v_norm; layers 4 and
    // 5 share layer 3's and 2's K/V.
    for (name, widths) in [("dense", [32, 32, 32, 32]), ("dense-kv", [32, 32, 64, 32])] {
        let s = Scratch::new(&format!("ftheta-g4-{name}"));
        let ck = Checkpoint::load(root.join("tests/fixtures/gemma4").join(name)).unwrap();
        let v = GemmaModel::from_checkpoint(ck, &Device::flex()).unwrap();
        let ds = capture(&s.0, &v, 25, ALL, true);
        // The least-squares start: one fit over every layer's columns, split into per-layer
        // decoders at their own widths and offsets.
        let cfg = config(&ds, &s.0.join("lstsq"), 6, "");
        let setup = prepare(&cfg, &v, VSHA, DSHA).unwrap();
        // One decoder per layer with K/V of its own, at its width; none for the sharing ones.
        assert_eq!(setup.f_theta.layer_widths(), widths, "{name}");
        let report = train_f_theta(&cfg, &v, setup, &opts(), &mut |_| {}).unwrap();
        let start = &report.evals[0].per_layer;
        let mean = |f: &dyn Fn(&kakeya_train::ftheta::Diagnostics) -> f64| {
            start.iter().map(f).sum::<f64>() / start.len() as f64
        };
        let (k_rel, v_rel) = (mean(&|d| d.k_rel_mse), mean(&|d| d.v_rel_mse));
        eprintln!("{name}: least-squares start, held-out K/V relative MSE {k_rel:.3} / {v_rel:.3}");
        assert!(k_rel < 0.8 && v_rel < 0.8, "{name}: {k_rel} / {v_rel}");
        // The loss's attention (v_norm, proportional RoPE, scale 1, per-layer heads) recomputes
        // the captured outputs from the captured raw Q/K/V: it is the model's attention.
        let floor = report.floor.as_ref().unwrap();
        for (l, d) in floor.per_layer.iter().enumerate() {
            assert!(
                d.mse_o_ratio < 1e-8,
                "{name} layer {l}: floor {}",
                d.mse_o_ratio
            );
        }
        // From a random start, the optimiser's own learning.
        let run = s.0.join("run");
        let mut cfg = config(&ds, &run, 200, "");
        cfg.model.init = FThetaInit::Random;
        let setup = prepare(&cfg, &v, VSHA, DSHA).unwrap();
        let report = train_f_theta(&cfg, &v, setup, &opts(), &mut |_| {}).unwrap();
        let ratio = |e: &FEval| {
            e.per_layer.iter().map(|d| d.mse_o_ratio).sum::<f64>() / e.per_layer.len() as f64
        };
        let (first, last) = (&report.evals[0], report.evals.last().unwrap());
        eprintln!(
            "{name}: held-out mseO ratio {:.4} → {:.4}",
            ratio(first),
            ratio(last)
        );
        assert!(
            ratio(last) < 0.6 * ratio(first),
            "{name}: held-out attention error {} → {}",
            ratio(first),
            ratio(last)
        );
        // The export restores the verifier's evicted K/V: speculative decoding in the restored
        // modes equals plain decoding in the same mode.
        let d = tiny_drafter(&v);
        let f = FThetaCheckpoint::read_dir(&run.join("export")).unwrap();
        assert_eq!(f.config.layer_widths(), v.config.own_kv_widths());
        let f = FTheta::from_checkpoint(&f, v.device()).unwrap();
        let r = FThetaRestorer::new(&f, d.num_layers(), d.context_width()).unwrap();
        let greedy = GenerationConfig::greedy(20, 0);
        let p: Vec<u32> = (0..24u32).map(|j| (j * 41 + 7) % 120).collect();
        for mode in [KvMode::Restored, KvMode::RestoredSliding] {
            let kv = KvSetup::new(KvPolicy {
                mode,
                sink: 2,
                window: 4,
                ..KvPolicy::new(mode)
            })
            .drafter(&d)
            .restorer(&r);
            let want = generate(
                &mut Session::with_kv(&v, kv).unwrap(),
                &p,
                &greedy,
                &mut |_| {},
            )
            .unwrap()
            .tokens;
            let mut ver = Verifier::new(&v, kv, 4).unwrap();
            let got = speculative_generate(
                &mut ver,
                &mut DFlashProposer::new(&d),
                &p,
                &greedy,
                SpecConfig::fixed(4),
                &mut |_| {},
            )
            .unwrap();
            assert_eq!(got.tokens, want, "{name} {mode}");
        }
    }
}
