//! The bounded KV modes on the real default model (fetched by `scripts/fetch_default_model.py`),
//! with the committed drafter and the committed f_θ: speculative == plain greedy decoding in the
//! `restored` and `quant4` modes and the recommended bounded preset on four prompts longer than
//! 600 tokens, and the quantised
//! modes' dequantised K/V within the format's bound (against the exact copies the same
//! session still holds in its window); the formats' errors on the global layers, and f_θ's
//! quantised residuals against quantising the same K/V directly. Marked #[ignore] (minutes on
//! 2 cores); CI runs them with --include-ignored.

mod common;

use common::{load, root, trained_drafter};
use kakeya_models::FTheta;
use kakeya_runtime::kv::{FThetaRestorer, KvMode, KvPolicy, LayerKv, Rows};
use kakeya_runtime::{
    DFlashProposer, GenerationConfig, KvSetup, Session, SpecConfig, Verifier, generate,
    speculative_generate,
};
use kakeya_weights::FThetaCheckpoint;

/// Four prompts of 600+ tokens: runs of the built-in corpus, each starting elsewhere.
fn long_prompts(tok: &kakeya_weights::Tokenizer) -> Vec<Vec<u32>> {
    let body = std::fs::read_to_string(root().join("data/corpus/general.jsonl")).unwrap();
    let texts: Vec<String> = body
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| v["text"].as_str().map(String::from))
        .collect();
    (0..4)
        .map(|p| {
            let mut ids = vec![tok.bos];
            let mut i = p * 17;
            while ids.len() < 640 {
                ids.extend(tok.encode(&texts[i % texts.len()]).unwrap());
                ids.extend(tok.encode("\n\n").unwrap());
                i += 1;
            }
            ids
        })
        .collect()
}

/// `[kv_heads, n, head_dim]` → rows `[n, kv_heads · head_dim]`, row-major.
fn rows(x: burn::tensor::Tensor<3>) -> Vec<f32> {
    let [h, n, d] = x.dims();
    x.swap_dims(0, 1)
        .reshape([n, h * d])
        .into_data()
        .try_into_vec::<f32>()
        .unwrap()
}

fn cfg(max_tokens: usize) -> GenerationConfig {
    GenerationConfig::greedy(max_tokens, 256)
}

#[test]
#[ignore = "real model: run with --include-ignored"]
fn speculative_equals_plain_in_restored_quant4_residual_mixed_and_the_recommended_mode_on_long_prompts()
 {
    let (v, tok) = load();
    let d = trained_drafter(&v);
    let dir = root().join("checkpoints/f-theta-gemma3-270m");
    let ck = FThetaCheckpoint::read_dir(&dir).expect("committed f_θ");
    let f = FTheta::from_checkpoint(&ck, v.device()).unwrap();
    let r = FThetaRestorer::new(&f, d.num_layers(), d.context_width()).unwrap();
    let prompts = long_prompts(&tok);
    let mut modes = vec![KvMode::Restored, KvMode::Quant4, KvMode::RECOMMENDED];
    for extra in ["residual-k4v3", "bounded-k2v2-mixed"] {
        let m: KvMode = extra.parse().unwrap();
        if !modes.contains(&m) {
            modes.push(m);
        }
    }
    for mode in modes {
        let setup = KvSetup::new(KvPolicy::new(mode)).drafter(&d).restorer(&r);
        for (i, p) in prompts.iter().enumerate() {
            assert!(p.len() > 600);
            let plain = generate(
                &mut Session::with_kv(&v, setup).unwrap(),
                p,
                &cfg(40),
                &mut |_| {},
            )
            .unwrap();
            let mut ver = Verifier::new(&v, setup, 8).unwrap();
            let spec = speculative_generate(
                &mut ver,
                &mut DFlashProposer::new(&d),
                p,
                &cfg(40),
                SpecConfig::fixed(8),
                &mut |_| {},
            )
            .unwrap();
            assert_eq!(
                spec.tokens,
                plain.tokens,
                "{mode}, prompt {i} ({} tokens)",
                p.len()
            );
            let st = spec.spec.unwrap();
            eprintln!(
                "{mode} prompt {i}: {} tokens, identical; acceptance {:.2}; KV {} bytes ({:.2}x less than full in 16-bit)",
                p.len(),
                st.mean_acceptance_length,
                spec.stats.kv.total,
                spec.stats.kv.ratio_to_full_f16
            );
        }
    }
}

#[test]
#[ignore = "real model: run with --include-ignored"]
fn quantised_kv_of_the_real_model_is_within_half_a_step() {
    let (v, tok) = load();
    let p = &long_prompts(&tok)[0];
    let kvw = v.config.num_key_value_heads * v.config.head_dim;
    for mode in [KvMode::Quant8, KvMode::Quant4] {
        // f32 exact tiers: the window's copies are the values that were quantised.
        let policy = KvPolicy {
            dtype: kakeya_runtime::KvDtype::F32,
            ..KvPolicy::new(mode)
        };
        let mut s = Session::with_kv(&v, KvSetup::new(policy)).unwrap();
        s.run(p, 256).unwrap();
        let mut worst = 0.0f32;
        for l in 0..v.layers.len() {
            let LayerKv::Tiered(t) = &s.kv().layers()[l] else {
                panic!("{mode}: layer {l} is bounded")
            };
            let (first, qk, qv) = t.quantised().unwrap();
            // The same session's exact copies: the positions still in its window.
            let held = t.window().unwrap();
            let (ek, ev) = (rows(held.k), rows(held.v));
            for (exact, q) in [(&ek, qk), (&ev, qv)] {
                let Rows::Quant(q) = q else {
                    panic!("quantised rows")
                };
                let deq = q.dequantize(0, q.len());
                for (r, pos) in (first..first + q.len()).enumerate() {
                    let Some(e) = held.positions.iter().position(|&x| x == pos) else {
                        continue;
                    };
                    for j in 0..kvw {
                        let (x, y) = (exact[e * kvw + j], deq[r * kvw + j]);
                        let step = q.scale(r, j / q.group());
                        let err = (x - y).abs();
                        assert!(
                            err <= step / 2.0 * 1.001 + 1e-6,
                            "{mode} layer {l} position {pos} value {j}: {x} came back {y} (step {step})"
                        );
                        worst = worst.max(err / step.max(1e-30));
                    }
                }
            }
        }
        eprintln!("{mode}: every dequantised K/V value within {worst:.3} of a step (bound 0.5)");
    }
}

/// The real model's K/V of the global layers over a 640-token prompt, quantised in each
/// format the bounded tiers offer: the relative error of keys and values (Frobenius), printed
/// per format. Asserted: per-channel keys beat per-token keys at 2, 3 and 4 bits (the outlier
/// channels this layout is for), and fitted ranges err no more than min–max ones.
#[test]
#[ignore = "real model: run with --include-ignored"]
fn quantised_formats_on_the_real_models_global_layers() {
    use kakeya_runtime::kv::channels::ChannelRows;
    use kakeya_runtime::kv::rotation::Rotation;
    use kakeya_runtime::kv::{Bits, KvDtype};
    let (v, tok) = load();
    let p = &long_prompts(&tok)[1];
    let policy = KvPolicy {
        dtype: KvDtype::F32,
        ..KvPolicy::new(KvMode::Full)
    };
    let mut s = Session::with_kv(&v, KvSetup::new(policy)).unwrap();
    s.run(p, 256).unwrap();
    let (width, head_dim) = (v.config.kv_width_of(0), v.config.head_dim);
    let rel = |a: &[f32], b: &[f32]| {
        let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f32 = a.iter().map(|x| x * x).sum();
        (num / den).sqrt()
    };
    let rot = Rotation::new(head_dim, 1).unwrap();
    let mut worst = std::collections::BTreeMap::new();
    for l in (0..v.layers.len()).filter(|&l| v.cache_specs()[l] == kakeya_models::CacheSpec::Full) {
        let held = s.kv().native(l).unwrap().held().unwrap();
        let n = held.positions.len() / 64 * 64;
        let (k, val) = (rows(held.k), rows(held.v));
        let (k, val) = (&k[..n * width], &val[..n * width]);
        for bits in [2, 3, 4, 8] {
            let b = Bits::new(bits).unwrap();
            // Groups: "channel" per channel over 64 positions; "token" per token, 64 values;
            // "head" per token, one group per head; "fitted": ranges fitted for least squared
            // error instead of min–max.
            for (name, groups, rotate, x) in [
                ("K channel", "channel", false, k),
                ("K channel rotated", "channel", true, k),
                ("K token", "token", false, k),
                ("K token rotated", "token", true, k),
                ("K head rotated", "head", true, k),
                ("V token", "token", false, val),
                ("V token rotated", "token", true, val),
                ("V head rotated", "head", true, val),
                ("V head rotated fitted", "head fitted", true, val),
                ("K channel fitted", "channel fitted", false, k),
                ("K channel fitted mixed", "channel fitted mixed", false, k),
            ] {
                let mut y = x.to_vec();
                if rotate {
                    rot.apply(&mut y);
                }
                let mut back = match groups {
                    "channel" | "channel fitted" | "channel fitted mixed" => {
                        let mut c = ChannelRows::new(b, width, 0);
                        if groups != "channel" {
                            c = c.fitted();
                        }
                        if groups == "channel fitted mixed" {
                            c = c.mixed();
                        }
                        c.push(&y);
                        c.read(0, n).unwrap()
                    }
                    "token" => {
                        let mut r = Rows::new(width, Some(b));
                        r.push(&y);
                        r.read(0, n)
                    }
                    _ => {
                        let mut r = kakeya_runtime::kv::QuantRows::with_group(b, width, head_dim);
                        if groups == "head fitted" {
                            r = r.fitted();
                        }
                        r.push(&y);
                        r.dequantize(0, n)
                    }
                };
                if rotate {
                    rot.undo(&mut back);
                }
                let e = rel(x, &back);
                let w = worst.entry((name, bits)).or_insert(0.0f32);
                *w = w.max(e);
            }
        }
    }
    for ((name, bits), e) in &worst {
        eprintln!("{name:>18} {bits}-bit: worst relative error over global layers {e:.4}");
    }
    for ((name, bits), e) in &worst {
        assert!(e.is_finite() && *e < 1.0, "{name} {bits}-bit: {e}");
    }
    for bits in [2, 3, 4] {
        assert!(
            worst[&("K channel", bits)] < worst[&("K token", bits)],
            "{bits}-bit: per-channel keys are no better than per-token ones"
        );
        for (fitted, plain) in [
            ("K channel fitted", "K channel"),
            ("V head rotated fitted", "V head rotated"),
        ] {
            assert!(
                worst[&(fitted, bits)] <= worst[&(plain, bits)],
                "{bits}-bit: {fitted} errs more than min–max ranges"
            );
        }
    }
}

/// f_θ as a predictor whose residual is quantised (as AQUA-KV does), against quantising the
/// same K/V directly, on the real model's global layers over a 640-token prompt, in the space
/// f_θ predicts (the raw k_proj / v_proj outputs, before k_norm and RoPE). Printed per layer,
/// K and V, 2 to 4 bits: f_θ's own relative error (Frobenius), the error of direct
/// quantisation (rotated, one group per head, and keys per channel), the error of the
/// quantised residual, and the bytes per position of the compact store the prediction reads.
/// Asserted: f_θ predicts better than nothing (relative error under 1), and a residual
/// quantised at b bits comes back within the format's bound (its error is below the
/// prediction's).
#[test]
#[ignore = "real model: run with --include-ignored"]
fn f_theta_residuals_against_direct_quantisation_on_the_global_layers() {
    use kakeya_models::{DraftContext, KvPart};
    use kakeya_runtime::kv::channels::ChannelRows;
    use kakeya_runtime::kv::rotation::Rotation;
    use kakeya_runtime::kv::{Bits, QuantRows, Restorer};
    let (v, tok) = load();
    let d = trained_drafter(&v);
    let ck = FThetaCheckpoint::read_dir(&root().join("checkpoints/f-theta-gemma3-270m"))
        .expect("committed f_θ");
    let f = FTheta::from_checkpoint(&ck, v.device()).unwrap();
    let r = FThetaRestorer::new(&f, d.num_layers(), d.context_width()).unwrap();
    let p = &long_prompts(&tok)[1];
    let setup = KvSetup::new(KvPolicy::new(KvMode::Restored))
        .drafter(&d)
        .restorer(&r);
    let mut s = Session::with_kv(&v, setup).unwrap();
    s.run(p, 256).unwrap();
    let store = s.store_mut().unwrap().expect("a compact store").clone();
    let n = store.len() / 64 * 64;
    let oracle = common::oracle_restorer(&v, p);
    let (width, head_dim) = (v.config.kv_width_of(0), v.config.head_dim);
    let rot = Rotation::new(head_dim, 1).unwrap();
    let host = |t: burn::tensor::Tensor<2>| t.into_data().try_into_vec::<f32>().unwrap();
    let rel = |a: &[f32], b: &[f32]| {
        let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f32 = a.iter().map(|x| x * x).sum();
        (num / den).sqrt()
    };
    // Rotated, one group per head (the presets' values).
    let rotated = |x: &[f32], b: Bits| {
        let mut y = x.to_vec();
        rot.apply(&mut y);
        let mut q = QuantRows::with_group(b, width, head_dim);
        q.push(&y);
        let mut back = q.dequantize(0, n);
        rot.undo(&mut back);
        back
    };
    // Per channel over blocks of 64 positions (the presets' keys).
    let channels = |x: &[f32], b: Bits| {
        let mut c = ChannelRows::new(b, width, 0);
        c.push(x);
        c.read(0, n).unwrap()
    };
    eprintln!(
        "compact store: {} bytes per position (f32, the drafter's {} layers)",
        store.nbytes() / store.len(),
        d.num_layers()
    );
    for l in (0..v.layers.len()).filter(|&l| v.cache_specs()[l] == kakeya_models::CacheSpec::Full) {
        for part in [KvPart::K, KvPart::V] {
            let x = host(oracle.restore(l, 0..n, part, None).unwrap());
            let pred = host(r.restore(l, 0..n, part, Some(&store)).unwrap());
            let e_pred = rel(&x, &pred);
            assert!(e_pred < 1.0, "layer {l} {part:?}: f_θ's error {e_pred}");
            let resid: Vec<f32> = x.iter().zip(&pred).map(|(a, b)| a - b).collect();
            for bits in [2, 3, 4] {
                let b = Bits::new(bits).unwrap();
                let direct = rel(&x, &rotated(&x, b));
                let direct_ch = rel(&x, &channels(&x, b));
                // The prediction plus the dequantised residual, against the truth.
                let with_pred = |e: Vec<f32>| -> f32 {
                    let back: Vec<f32> = e.iter().zip(&pred).map(|(e, p)| e + p).collect();
                    rel(&x, &back)
                };
                let residual = with_pred(rotated(&resid, b));
                let residual_ch = with_pred(channels(&resid, b));
                assert!(
                    residual < e_pred && residual_ch < e_pred,
                    "layer {l} {part:?} {bits}-bit: quantised residual {residual} / {residual_ch} against f_θ's {e_pred}"
                );
                eprintln!(
                    "layer {l:>2} {part:?} {bits}-bit: f_θ alone {e_pred:.3}; direct rotated {direct:.3}, per channel {direct_ch:.3}; residual rotated {residual:.3}, per channel {residual_ch:.3}"
                );
            }
        }
    }
}
