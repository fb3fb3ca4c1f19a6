use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn planted(rows: usize, inp: usize, out: usize, seed: u64) -> (Vec<f32>, Vec<f32>, Fit) {
    let mut rng = StdRng::seed_from_u64(seed);
    let w: Vec<f64> = (0..inp * out)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let b: Vec<f64> = (0..out).map(|_| rng.random_range(-3.0..3.0)).collect();
    // Inputs with an offset far from zero and unequal scales.
    let x: Vec<f32> = (0..rows * inp)
        .map(|i| 5.0 + (1 + i % inp) as f32 * rng.random_range(-1.0f32..1.0))
        .collect();
    let mut y = vec![0.0f32; rows * out];
    for r in 0..rows {
        for j in 0..out {
            let mut s = b[j];
            for i in 0..inp {
                s += f64::from(x[r * inp + i]) * w[i * out + j];
            }
            y[r * out + j] = s as f32;
        }
    }
    (x, y, Fit { w, b })
}

fn close(a: &[f64], b: &[f64], tol: f64) -> f64 {
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    assert!(worst < tol, "largest difference {worst}");
    worst
}

#[test]
fn recovers_a_planted_affine_map_from_chunks() {
    let (inp, out) = (7, 5);
    let (x, y, truth) = planted(300, inp, out, 1);
    let dev = Device::flex();
    let mut nrm = Normal::new(inp, out, true);
    // Uneven chunks, as sequences of different lengths.
    let mut r0 = 0;
    for len in [1, 40, 97, 162] {
        nrm.add(
            &x[r0 * inp..(r0 + len) * inp],
            &y[r0 * out..(r0 + len) * out],
            len,
            &dev,
        );
        r0 += len;
    }
    assert_eq!(nrm.count(), 300.0);
    let fit = nrm.solve(0.0).unwrap();
    // y is exact up to its f32 rounding.
    close(&fit.w, &truth.w, 1e-4);
    close(&fit.b, &truth.b, 1e-3);
}

#[test]
fn chunked_moments_equal_one_pass() {
    let (inp, out) = (4, 3);
    let (x, y, _) = planted(50, inp, out, 2);
    let dev = Device::flex();
    let mut one = Normal::new(inp, out, true);
    one.add(&x, &y, 50, &dev);
    let mut many = Normal::new(inp, out, true);
    for r in 0..50 {
        many.add(
            &x[r * inp..(r + 1) * inp],
            &y[r * out..(r + 1) * out],
            1,
            &dev,
        );
    }
    // The cross-products are f32 matmuls of centred data, merged in f64.
    let scale = one.cxx.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    close(&one.cxx, &many.cxx, 1e-6 * scale);
    close(&one.mx, &many.mx, 1e-9);
    close(&one.my, &many.my, 1e-9);
}

#[test]
fn ridge_shrinks_and_the_origin_fit_has_no_intercept() {
    let (inp, out) = (3, 2);
    let (x, y, _) = planted(80, inp, out, 3);
    let dev = Device::flex();
    let mut nrm = Normal::new(inp, out, true);
    nrm.add(&x, &y, 80, &dev);
    let norm = |f: &Fit| f.w.iter().map(|v| v * v).sum::<f64>();
    let plain = nrm.solve(0.0).unwrap();
    let shrunk = nrm.solve(10.0).unwrap();
    assert!(norm(&shrunk) < 0.5 * norm(&plain));

    // Through the origin: y = x·w exactly (no offset) is recovered, b = 0.
    let w = [0.5, -2.0, 1.5, 0.25, -1.0, 3.0];
    let yo: Vec<f32> = x
        .chunks_exact(inp)
        .flat_map(|r| {
            (0..out).map(move |j| {
                (0..inp)
                    .map(|i| f64::from(r[i]) * w[i * out + j])
                    .sum::<f64>() as f32
            })
        })
        .collect();
    let mut o = Normal::new(inp, out, false);
    o.add(&x, &yo, 80, &dev);
    let fit = o.solve(0.0).unwrap();
    close(&fit.w, &w, 1e-4);
    assert!(fit.b.iter().all(|&b| b == 0.0));
    // Constant inputs without ridge are singular, not a panic.
    let mut c = Normal::new(2, 1, true);
    c.add(&[1.0, 2.0, 1.0, 2.0], &[0.0, 1.0], 2, &dev);
    assert!(c.solve(0.0).is_none());
}

/// `(x · enc + enc_b) · dec + dec_b` for row-major `x: [rows, in]`.
fn apply(f: &Factored, x: &[f32], inp: usize) -> Vec<f64> {
    let out = f.dec_b.len();
    x.chunks_exact(inp)
        .flat_map(|r| {
            let code: Vec<f64> = (0..f.rank)
                .map(|c| {
                    f.enc_b[c]
                        + (0..inp)
                            .map(|i| f64::from(r[i]) * f.enc[i * f.rank + c])
                            .sum::<f64>()
                })
                .collect();
            (0..out)
                .map(|j| {
                    f.dec_b[j]
                        + (0..f.rank)
                            .map(|c| code[c] * f.dec[c * out + j])
                            .sum::<f64>()
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

fn sse(f: &Factored, x: &[f32], y: &[f32], inp: usize) -> f64 {
    apply(f, x, inp)
        .iter()
        .zip(y)
        .map(|(p, &t)| (p - f64::from(t)).powi(2))
        .sum()
}

#[test]
fn jacobi_diagonalises_a_symmetric_matrix() {
    let n = 9;
    let mut rng = StdRng::seed_from_u64(7);
    let mut a = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..=i {
            let x: f64 = rng.random_range(-1.0..1.0);
            a[i * n + j] = x;
            a[j * n + i] = x;
        }
    }
    let (values, v) = symmetric_eigen(a.clone(), n);
    for i in 0..n {
        for j in 0..n {
            // V diag(λ) Vᵀ = A and Vᵀ V = I.
            let rebuilt: f64 = (0..n)
                .map(|k| v[i * n + k] * values[k] * v[j * n + k])
                .sum();
            assert!((rebuilt - a[i * n + j]).abs() < 1e-10);
            let dot: f64 = (0..n).map(|k| v[k * n + i] * v[k * n + j]).sum();
            assert!((dot - f64::from(u8::from(i == j))).abs() < 1e-10);
        }
    }
}

#[test]
fn full_rank_factoring_is_the_plain_fit() {
    let (inp, out) = (5, 4);
    let (x, y, truth) = planted(120, inp, out, 8);
    let mut nrm = Normal::new(inp, out, true);
    nrm.add(&x, &y, 120, &Device::flex());
    for rank in [5, 8] {
        let f = nrm.solve_rank(0.0, rank).unwrap();
        let (tw, tb) = (&truth.w, &truth.b);
        let want: Vec<f64> = x
            .chunks_exact(inp)
            .flat_map(|r| {
                (0..out).map(move |j| {
                    tb[j]
                        + (0..inp)
                            .map(|i| f64::from(r[i]) * tw[i * out + j])
                            .sum::<f64>()
                })
            })
            .collect();
        close(&apply(&f, &x, inp), &want, 1e-3);
    }
}

#[test]
fn reduced_rank_recovers_a_planted_low_rank_map() {
    // y = b + x · P · Q with P: [6, 2], Q: [2, 8] — rank 2 through a 2-wide code.
    let (inp, out, r, rows) = (6, 8, 2, 200);
    let mut rng = StdRng::seed_from_u64(9);
    let mut draw = |n: usize| -> Vec<f64> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let (p, q, b) = (draw(inp * r), draw(r * out), draw(out));
    let x: Vec<f32> = draw(rows * inp)
        .into_iter()
        .map(|v| (3.0 + 2.0 * v) as f32)
        .collect();
    let y: Vec<f32> = x
        .chunks_exact(inp)
        .flat_map(|row| {
            let code: Vec<f64> = (0..r)
                .map(|c| (0..inp).map(|i| f64::from(row[i]) * p[i * r + c]).sum())
                .collect();
            (0..out)
                .map(|j| (b[j] + (0..r).map(|c| code[c] * q[c * out + j]).sum::<f64>()) as f32)
                .collect::<Vec<_>>()
        })
        .collect();
    let mut nrm = Normal::new(inp, out, true);
    nrm.add(&x, &y, rows, &Device::flex());
    let f = nrm.solve_rank(0.0, r).unwrap();
    let ys: Vec<f64> = y.iter().map(|&v| f64::from(v)).collect();
    close(&apply(&f, &x, inp), &ys, 1e-4);
    // One code fewer cannot.
    let f1 = nrm.solve_rank(0.0, 1).unwrap();
    assert!(sse(&f1, &x, &y, inp) > 1e-2);
}

#[test]
fn reduced_rank_fit_is_a_least_squares_optimum() {
    // Noisy full-rank data: no rank-3 map fits; nudging the fit in any direction, encoder,
    // decoder or biases, must not lower its squared error.
    let (inp, out, rank, rows) = (7, 6, 3, 300);
    let (x, mut y, _) = planted(rows, inp, out, 10);
    let mut rng = StdRng::seed_from_u64(11);
    y.iter_mut()
        .for_each(|v| *v += rng.random_range(-2.0f32..2.0));
    let mut nrm = Normal::new(inp, out, true);
    nrm.add(&x, &y, rows, &Device::flex());
    let f = nrm.solve_rank(0.0, rank).unwrap();
    let (best, full) = (
        sse(&f, &x, &y, inp),
        sse(&nrm.solve_rank(0.0, inp).unwrap(), &x, &y, inp),
    );
    assert!(best > full * 1.01, "rank {rank} {best} vs full {full}");
    for trial in 0..40 {
        let mut g = f.clone();
        let eps = 1e-3;
        let part = match trial % 4 {
            0 => &mut g.enc,
            1 => &mut g.dec,
            2 => &mut g.enc_b,
            _ => &mut g.dec_b,
        };
        part.iter_mut()
            .for_each(|v| *v += eps * rng.random_range(-1.0..1.0));
        let e = sse(&g, &x, &y, inp);
        assert!(e >= best * (1.0 - 1e-9), "trial {trial}: {e} < {best}");
    }
}

#[test]
fn f_theta_built_from_fits_computes_them() {
    use kakeya_weights::ftheta::FThetaInputs;
    let (layers, kv, dl, dkv) = (3, 4, 2, 3);
    // Inputs are 6 (own) or 12 (both) wide: codes narrower and wider than that.
    for (inputs, rank) in [(FThetaInputs::Own, 4), (FThetaInputs::Both, 13)] {
        let config = kakeya_models::testing::f_theta_config(dl, dkv, inputs, rank, layers, kv);
        let inp = config.in_dim();
        let out = layers * kv;
        let mut rng = StdRng::seed_from_u64(4);
        let mut factored = || {
            let mut d =
                |n: usize| -> Vec<f64> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
            Factored {
                rank,
                enc: d(inp * rank),
                enc_b: d(rank),
                dec: d(rank * out),
                dec_b: d(out),
            }
        };
        let (kfit, vfit) = (factored(), factored());
        let dev = Device::flex();
        let model = params_from_fits(config.clone(), &kfit, &vfit, &dev);
        let weights: Vec<Tensor<2>> = model.tensors.iter().map(|t| t.2.clone()).collect();
        let f = model.model(&weights);
        let rows = 6;
        let mut draw = || -> Vec<f32> {
            (0..rows * dl * dkv)
                .map(|_| rng.random_range(-2.0..2.0))
                .collect()
        };
        let (dk, dv) = (draw(), draw());
        let w = dl * dkv;
        let x: Vec<f32> = match inputs {
            FThetaInputs::Own => dk.clone(),
            FThetaInputs::Both => (0..rows)
                .flat_map(|r| {
                    dk[r * w..(r + 1) * w]
                        .iter()
                        .chain(&dv[r * w..(r + 1) * w])
                        .copied()
                })
                .collect(),
        };
        let xv = if inputs == FThetaInputs::Own { &dv } else { &x };
        let t = |v: &[f32]| Tensor::<2>::from_data(TensorData::new(v.to_vec(), [rows, w]), &dev);
        let (kwant, vwant) = (apply(&kfit, &x, inp), apply(&vfit, xv, inp));
        for l in 0..layers {
            let (k_hat, v_hat) = f.forward(t(&dk), t(&dv), l);
            for (got, want) in [(k_hat, &kwant), (v_hat, &vwant)] {
                let want: Vec<f64> = (0..rows)
                    .flat_map(|r| want[r * out + l * kv..r * out + (l + 1) * kv].to_vec())
                    .collect();
                close(&host(got), &want, 1e-4);
            }
        }
    }
}
