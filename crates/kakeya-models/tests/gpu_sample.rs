//! Sampling on the device (`kakeya_models::gpu::sample_rows`) against inverse-CDF sampling in
//! f64 on the host (the rule of `kakeya_runtime::Sampler`: in id order at temperature alone,
//! most likely first under a top-k or top-p cut). Built with a
//! GPU feature and run on that device: `KAKEYA_TEST_DEVICE=wgpu cargo test -p kakeya-models
//! --features wgpu --test gpu_sample` (scripts/test_wgpu.sh), or `cuda` on a lent GPU.
//!
//! Tolerance: the device sums in f32, the host in f64, so a draw may differ only where
//! `u · total` (or the top-p target) lies within 1e-5 of the total mass of a boundary between
//! the two tokens; every such draw is counted and must stay rare.
#![cfg(feature = "cube")]

use kakeya_models::gpu;

mod common;
use common::{device, tensor, values};

/// The host's draw and the cumulative masses (normalised to 1) before and after each entry.
fn host_draw(row: &[f32], temperature: f32, u: f64) -> (u32, Vec<f64>) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f64> = row
        .iter()
        .map(|&l| (((l - max) / temperature) as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut cum = Vec::with_capacity(w.len() + 1);
    let mut acc = 0.0;
    cum.push(0.0);
    for p in &w {
        acc += p / total;
        cum.push(acc);
    }
    let mut r = u;
    for (i, p) in w.iter().enumerate() {
        r -= p / total;
        if r < 0.0 && *p > 0.0 {
            return (i as u32, cum);
        }
    }
    let last = w.iter().rposition(|p| *p > 0.0).unwrap_or(0);
    (last as u32, cum)
}

/// Uniforms in [0, 1): a hashed spread, and both ends.
fn uniforms(n: usize, seed: u32) -> Vec<f32> {
    let mut u: Vec<f32> = values(n, seed).iter().map(|v| (v + 2.0) / 4.0).collect();
    u[0] = 0.0;
    if n > 1 {
        u[n - 1] = 1.0 - f32::EPSILON / 2.0;
    }
    u
}

#[test]
fn sampled_rows_follow_the_hosts_inverse_cdf() {
    let d = device();
    let mut draws = 0;
    let mut near_ties = 0;
    let mut distinct = std::collections::BTreeSet::new();
    // Small rows (many tokens likely), the real vocabulary, a row whose chunks end unevenly.
    for (vocab, rows, scale, temperature) in [
        (40, 64, 1.0, 1.0),
        (1000, 32, 3.0, 0.7),
        (262_144, 8, 8.0, 1.0),
        (5_003, 16, 2.0, 1.3),
    ] {
        let mut logits: Vec<f32> = values(vocab * rows, vocab as u32)
            .iter()
            .map(|v| v * scale)
            .collect();
        // Entries of zero weight, and a maximum at a row's last entry.
        for r in 0..rows {
            logits[r * vocab + (r * 7) % vocab] = -1.0e30;
        }
        logits[vocab - 1] = 40.0;
        let u = uniforms(rows, 3 + vocab as u32);
        let t = tensor::<2>(logits.clone(), [rows, vocab], &d);
        let got = gpu::sample_rows(&t, temperature, 0, 1.0, &u).expect("on a GPU");
        assert_eq!(got.len(), rows);
        for r in 0..rows {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let (want, cum) = host_draw(row, temperature, u[r] as f64);
            draws += 1;
            distinct.insert((vocab, got[r]));
            if got[r] == want {
                continue;
            }
            // Only a near tie: u lies within 1e-5 of the boundary between the two tokens.
            let (a, b) = (want.min(got[r]) as usize, want.max(got[r]) as usize);
            let gap = (u[r] as f64 - cum[b])
                .abs()
                .min((u[r] as f64 - cum[a + 1]).abs());
            assert!(
                gap < 1e-5 && cum[b] - cum[a + 1] < 1e-5,
                "vocab {vocab}, row {r}, u {}: device drew {} where the host drew {want} \
                 (boundary gap {gap:.3e})",
                u[r],
                got[r]
            );
            near_ties += 1;
        }
    }
    eprintln!("{draws} draws, {near_ties} differed at a near tie");
    assert!(near_ties * 20 <= draws, "{near_ties} of {draws} differed");
    // The draws spread over the rows' tokens (an argmax would give one per vocabulary).
    assert!(
        distinct.len() > 60,
        "only {} distinct draws",
        distinct.len()
    );
}

#[test]
fn a_cold_temperature_draws_the_argmax_and_u_zero_the_first_token() {
    let d = device();
    let vocab = 3000;
    let mut logits = values(vocab * 2, 9);
    logits[1234] = 5.0;
    logits[vocab + 2999] = 5.0;
    let t = tensor::<2>(logits, [2, vocab], &d);
    assert_eq!(
        gpu::sample_rows(&t, 1e-3, 0, 1.0, &[0.5, 0.999]).unwrap(),
        vec![1234, 2999]
    );
    // Equal logits: token i for u in [i/V, (i+1)/V).
    let flat = tensor::<2>(vec![0.0; 2 * vocab], [2, vocab], &d);
    assert_eq!(
        gpu::sample_rows(&flat, 1.0, 0, 1.0, &[0.0, 0.5001]).unwrap(),
        vec![0, 1500]
    );
}

/// The host's rule with cuts: the kept tokens most likely first (then the lower id), their
/// cumulative masses normalised to 1 (`cum[j]`: before the `j`-th kept token), and the draw.
fn host_sorted(
    row: &[f32],
    temperature: f32,
    top_k: usize,
    top_p: f32,
    u: f64,
) -> (Vec<u32>, Vec<f64>, u32) {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    if top_k > 0 {
        order.truncate(top_k);
    }
    let max = row[order[0]];
    let w: Vec<f64> = order
        .iter()
        .map(|&i| (((row[i] - max) / temperature) as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut keep = order.len();
    if top_p < 1.0 {
        let mut acc = 0.0;
        keep = w
            .iter()
            .position(|p| {
                acc += p / total;
                acc >= top_p as f64
            })
            .map_or(keep, |k| k + 1);
    }
    let kept: f64 = w[..keep].iter().sum();
    let mut cum = vec![0.0];
    let mut acc = 0.0;
    for p in &w[..keep] {
        acc += p / kept;
        cum.push(acc);
    }
    let ids: Vec<u32> = order[..keep].iter().map(|&i| i as u32).collect();
    let at = cum[1..].iter().position(|&c| c > u).unwrap_or(keep - 1);
    (ids, cum, order[at] as u32)
}

#[test]
fn top_k_and_top_p_on_the_device_keep_and_draw_as_the_host() {
    let d = device();
    let (mut draws, mut near_ties) = (0, 0);
    let mut distinct = std::collections::BTreeSet::new();
    for (vocab, rows, scale, temperature, top_k, top_p) in [
        (50, 48, 1.5, 1.0, 5, 1.0),
        (50, 48, 1.5, 0.8, 0, 0.7),
        (1000, 32, 3.0, 1.0, 40, 0.9),
        (1000, 32, 3.0, 1.2, 1, 1.0),
        (262_144, 6, 6.0, 1.0, 50, 0.95),
        (262_144, 6, 6.0, 0.7, 0, 0.8),
        (3_001, 16, 0.0, 1.0, 10, 0.5),
    ] {
        // `scale` 0: every logit equal, so the cuts fall among ties (kept by lower id).
        let logits: Vec<f32> = values(vocab * rows, 7 + vocab as u32)
            .iter()
            .map(|v| v * scale)
            .collect();
        let u = uniforms(rows, 11 + top_k as u32);
        let t = tensor::<2>(logits.clone(), [rows, vocab], &d);
        let got = gpu::sample_rows(&t, temperature, top_k, top_p, &u).expect("on a GPU");
        for r in 0..rows {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let (ids, cum, want) = host_sorted(row, temperature, top_k, top_p, u[r] as f64);
            draws += 1;
            distinct.insert((vocab, top_k, got[r]));
            let what = format!(
                "vocab {vocab}, top-k {top_k}, top-p {top_p}, row {r}, u {}",
                u[r]
            );
            let Some(at) = ids.iter().position(|&i| i == got[r]) else {
                panic!("{what}: the device drew {} outside the kept set", got[r]);
            };
            if got[r] == want {
                continue;
            }
            // A near tie: the uniform within 1e-5 of the drawn token's interval.
            let gap = (u[r] as f64 - cum[at])
                .abs()
                .min((u[r] as f64 - cum[at + 1]).abs());
            assert!(
                gap < 1e-5,
                "{what}: drew {} where the host drew {want} (gap {gap:.3e})",
                got[r]
            );
            near_ties += 1;
        }
    }
    eprintln!("{draws} draws under cuts, {near_ties} differed at a near tie");
    assert!(near_ties * 20 <= draws, "{near_ties} of {draws} differed");
    assert!(
        distinct.len() > 60,
        "only {} distinct draws",
        distinct.len()
    );
}
