//! Closed-form initialisation of f_θ.
//!
//! With no non-linearity between encoder and decoder, each f_θ path is an affine map of rank
//! at most `rank` from the drafter's K/V to the verifier's raw K/V of every layer at once (the
//! encoder is shared, so the rank constraint is on the concatenated `[layers · kv]` output).
//! The best such map in the mean-squared sense is reduced-rank regression:
//!
//! 1. the full ridge least-squares fit `W`, `b` from the normal equations — one streamed pass
//!    over the training sequences accumulates means and centred cross-products (merged per
//!    sequence with Chan et al.'s pairwise update, in f64), then a Cholesky solve;
//! 2. if `rank` is below the input width, the fitted values `Ŷ = (X − x̄)W` are projected on
//!    their top `rank` principal directions `V_r`: encoder `W V_r`, decoder `V_rᵀ`. With
//!    `Cxx = L Lᵀ` and `B = Lᵀ W`, `ŶᵀŶ = BᵀB`, whose leading eigenvectors come from the small
//!    `[in, in]` matrix `B Bᵀ` (symmetric Jacobi): `V_r = Bᵀ U_r Σ_r⁻¹`.
//!
//! Gradient descent from a random start is far from that optimum after thousands of steps
//! (on Gemma 3 270M the fit's held-out V direction error is less than half the trained
//! f_θ's), so the trainer starts here and then fine-tunes for the attention loss.

use std::collections::BTreeMap;

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_weights::{FThetaConfig, HostTensor};

use kakeya_capture::Dataset;
use kakeya_weights::ftheta::FThetaInputs;

use super::config::FThetaTrainConfig;
use super::data::{self, DataInfo};
use super::params::FThetaParams;
use super::train::FEvent;
use crate::error::{Result, TrainError};

/// Means and centred cross-products of `(x, y)` observations.
#[derive(Debug, Clone)]
pub struct Normal {
    in_dim: usize,
    out_dim: usize,
    intercept: bool,
    n: f64,
    mx: Vec<f64>,
    my: Vec<f64>,
    /// `Σ (x − x̄)(x − x̄)ᵀ`, `[in, in]` row-major.
    cxx: Vec<f64>,
    /// `Σ (x − x̄)(y − ȳ)ᵀ`, `[in, out]` row-major.
    cxy: Vec<f64>,
}

/// A fitted affine map `y ≈ x · w + b`.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// `[in, out]` row-major.
    pub w: Vec<f64>,
    /// `[out]`.
    pub b: Vec<f64>,
}

/// A fitted map through a `rank`-wide code: `y ≈ (x · enc + enc_b) · dec + dec_b`.
#[derive(Debug, Clone, PartialEq)]
pub struct Factored {
    /// Code width.
    pub rank: usize,
    /// `[in, rank]` row-major.
    pub enc: Vec<f64>,
    /// `[rank]`.
    pub enc_b: Vec<f64>,
    /// `[rank, out]` row-major.
    pub dec: Vec<f64>,
    /// `[out]`.
    pub dec_b: Vec<f64>,
}

fn host(t: Tensor<2>) -> Vec<f64> {
    crate::drafter::host(t).into_iter().map(f64::from).collect()
}

impl Normal {
    /// An empty accumulator; without `intercept` the fit goes through the origin (moments are
    /// taken about zero).
    pub fn new(in_dim: usize, out_dim: usize, intercept: bool) -> Self {
        Self {
            in_dim,
            out_dim,
            intercept,
            n: 0.0,
            mx: vec![0.0; in_dim],
            my: vec![0.0; out_dim],
            cxx: vec![0.0; in_dim * in_dim],
            cxy: vec![0.0; in_dim * out_dim],
        }
    }

    /// Observations so far.
    pub fn count(&self) -> f64 {
        self.n
    }

    /// Adds `rows` observations.
    ///
    /// # Shapes
    /// - `x`: `[rows, in]`, `y`: `[rows, out]` (row-major)
    pub fn add(&mut self, x: &[f32], y: &[f32], rows: usize, device: &Device) {
        if rows == 0 {
            return;
        }
        debug_assert_eq!(x.len(), rows * self.in_dim);
        debug_assert_eq!(y.len(), rows * self.out_dim);
        let mean = |v: &[f32], w: usize| -> Vec<f64> {
            let mut m = vec![0.0f64; w];
            if self.intercept {
                for r in v.chunks_exact(w) {
                    for (a, &b) in m.iter_mut().zip(r) {
                        *a += f64::from(b);
                    }
                }
                m.iter_mut().for_each(|a| *a /= rows as f64);
            }
            m
        };
        let (bx, by) = (mean(x, self.in_dim), mean(y, self.out_dim));
        let centred = |v: &[f32], m: &[f64], w: usize| -> Tensor<2> {
            let c: Vec<f32> = v
                .chunks_exact(w)
                .flat_map(|r| r.iter().zip(m).map(|(&a, &b)| (f64::from(a) - b) as f32))
                .collect();
            Tensor::from_data(TensorData::new(c, [rows, w]), device)
        };
        let xc = centred(x, &bx, self.in_dim);
        let yc = centred(y, &by, self.out_dim);
        let xt = xc.clone().transpose();
        let bxx = host(xt.clone().matmul(xc));
        let bxy = host(xt.matmul(yc));
        // Chan et al.: merge (n_a, mean_a, C_a) with (n_b, mean_b, C_b).
        let (na, nb) = (self.n, rows as f64);
        let n = na + nb;
        let f = na * nb / n;
        let dx: Vec<f64> = bx.iter().zip(&self.mx).map(|(b, a)| b - a).collect();
        let dy: Vec<f64> = by.iter().zip(&self.my).map(|(b, a)| b - a).collect();
        for i in 0..self.in_dim {
            let row = &mut self.cxx[i * self.in_dim..(i + 1) * self.in_dim];
            for ((c, &b), &d) in row
                .iter_mut()
                .zip(&bxx[i * self.in_dim..(i + 1) * self.in_dim])
                .zip(&dx)
            {
                *c += b + f * dx[i] * d;
            }
            let row = &mut self.cxy[i * self.out_dim..(i + 1) * self.out_dim];
            for ((c, &b), &d) in row
                .iter_mut()
                .zip(&bxy[i * self.out_dim..(i + 1) * self.out_dim])
                .zip(&dy)
            {
                *c += b + f * dx[i] * d;
            }
        }
        for (m, d) in self.mx.iter_mut().zip(&dx) {
            *m += d * nb / n;
        }
        for (m, d) in self.my.iter_mut().zip(&dy) {
            *m += d * nb / n;
        }
        self.n = n;
    }

    /// Solves `(Cxx + λI) W = Cxy` with `λ = ridge · trace(Cxx) / in`, and `b = ȳ − Wᵀ x̄`.
    /// `None` when the system is singular (no observations, or constant inputs and no ridge).
    pub fn solve(&self, ridge: f64) -> Option<Fit> {
        self.solve_with_factor(ridge).map(|(fit, _)| fit)
    }

    /// The fit and the Cholesky factor `L` (lower triangle, `[in, in]`) of `Cxx + λI`.
    fn solve_with_factor(&self, ridge: f64) -> Option<(Fit, Vec<f64>)> {
        let n = self.in_dim;
        let mut a = self.cxx.clone();
        let trace: f64 = (0..n).map(|i| a[i * n + i]).sum();
        let lambda = ridge * trace / n as f64;
        for i in 0..n {
            a[i * n + i] += lambda;
        }
        // Cholesky: a = L Lᵀ, L stored in the lower triangle.
        for j in 0..n {
            let mut d = a[j * n + j];
            for k in 0..j {
                d -= a[j * n + k] * a[j * n + k];
            }
            if d <= 1e-12 * (trace / n as f64).max(f64::MIN_POSITIVE) || !d.is_finite() {
                return None;
            }
            let d = d.sqrt();
            a[j * n + j] = d;
            for i in j + 1..n {
                let mut s = a[i * n + j];
                for k in 0..j {
                    s -= a[i * n + k] * a[j * n + k];
                }
                a[i * n + j] = s / d;
            }
            for k in j + 1..n {
                a[j * n + k] = 0.0;
            }
        }
        let m = self.out_dim;
        let mut w = self.cxy.clone();
        // L Z = Cxy, then Lᵀ W = Z, a whole row of right-hand sides at a time.
        for i in 0..n {
            for k in 0..i {
                let l = a[i * n + k];
                if l != 0.0 {
                    let (done, rest) = w.split_at_mut(i * m);
                    for (x, &z) in rest[..m].iter_mut().zip(&done[k * m..(k + 1) * m]) {
                        *x -= l * z;
                    }
                }
            }
            let d = a[i * n + i];
            w[i * m..(i + 1) * m].iter_mut().for_each(|x| *x /= d);
        }
        for i in (0..n).rev() {
            for k in i + 1..n {
                let l = a[k * n + i];
                if l != 0.0 {
                    let (head, tail) = w.split_at_mut(k * m);
                    for (x, &z) in head[i * m..(i + 1) * m].iter_mut().zip(&tail[..m]) {
                        *x -= l * z;
                    }
                }
            }
            let d = a[i * n + i];
            w[i * m..(i + 1) * m].iter_mut().for_each(|x| *x /= d);
        }
        let mut b = self.my.clone();
        for i in 0..n {
            for (bj, &wij) in b.iter_mut().zip(&w[i * m..(i + 1) * m]) {
                *bj -= self.mx[i] * wij;
            }
        }
        Some((Fit { w, b }, a))
    }

    /// The best map through a `rank`-wide code (reduced-rank ridge regression; the full fit
    /// when `rank ≥ in`). `None` when the system is singular.
    pub fn solve_rank(&self, ridge: f64, rank: usize) -> Option<Factored> {
        let (n, m) = (self.in_dim, self.out_dim);
        let (fit, l) = self.solve_with_factor(ridge)?;
        if rank >= n {
            // Identity encoder on the first `in` codes, the fit as decoder.
            let mut enc = vec![0.0; n * rank];
            (0..n).for_each(|i| enc[i * rank + i] = 1.0);
            let mut dec = fit.w;
            dec.resize(rank * m, 0.0);
            return Some(Factored {
                rank,
                enc,
                enc_b: vec![0.0; rank],
                dec,
                dec_b: fit.b,
            });
        }
        // B = Lᵀ W, [in, out].
        let mut bm = vec![0.0; n * m];
        for i in 0..n {
            for k in i..n {
                let lki = l[k * n + i];
                if lki != 0.0 {
                    let (dst, src) = (&mut bm[i * m..(i + 1) * m], &fit.w[k * m..(k + 1) * m]);
                    dst.iter_mut().zip(src).for_each(|(d, &s)| *d += lki * s);
                }
            }
        }
        // G = B Bᵀ, [in, in].
        let mut g = vec![0.0; n * n];
        for i in 0..n {
            for j in 0..=i {
                let d: f64 = bm[i * m..(i + 1) * m]
                    .iter()
                    .zip(&bm[j * m..(j + 1) * m])
                    .map(|(a, b)| a * b)
                    .sum();
                g[i * n + j] = d;
                g[j * n + i] = d;
            }
        }
        let (values, vectors) = symmetric_eigen(g, n);
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
        // dec = V_rᵀ = Σ_r⁻¹ U_rᵀ B, [rank, out]; directions with no variance stay zero.
        let top = values[order[0]].max(0.0);
        let mut dec = vec![0.0; rank * m];
        for (c, &e) in order.iter().take(rank).enumerate() {
            let sigma = values[e].max(0.0).sqrt();
            if sigma <= 1e-12 * top.sqrt() {
                continue;
            }
            let row = &mut dec[c * m..(c + 1) * m];
            for i in 0..n {
                let u = vectors[i * n + e] / sigma;
                if u != 0.0 {
                    row.iter_mut()
                        .zip(&bm[i * m..(i + 1) * m])
                        .for_each(|(d, &b)| *d += u * b);
                }
            }
        }
        // enc = W V_r = W decᵀ, [in, rank]; the code is centred: enc_b = −x̄ᵀ enc.
        let mut enc = vec![0.0; n * rank];
        for i in 0..n {
            let wi = &fit.w[i * m..(i + 1) * m];
            for c in 0..rank {
                enc[i * rank + c] = wi
                    .iter()
                    .zip(&dec[c * m..(c + 1) * m])
                    .map(|(a, b)| a * b)
                    .sum();
            }
        }
        let enc_b: Vec<f64> = (0..rank)
            .map(|c| -(0..n).map(|i| self.mx[i] * enc[i * rank + c]).sum::<f64>())
            .collect();
        Some(Factored {
            rank,
            enc,
            enc_b,
            dec,
            dec_b: self.my.clone(),
        })
    }
}

/// Eigen-decomposition of a symmetric `[n, n]` matrix by cyclic Jacobi rotations: the
/// eigenvalues and the eigenvectors as the columns of a row-major `[n, n]` matrix.
fn symmetric_eigen(mut a: Vec<f64>, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut v = vec![0.0; n * n];
    (0..n).for_each(|i| v[i * n + i] = 1.0);
    let scale: f64 = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    for _sweep in 0..100 {
        let off: f64 = (0..n)
            .flat_map(|i| (0..n).filter(move |&j| j != i).map(move |j| (i, j)))
            .map(|(i, j)| a[i * n + j] * a[i * n + j])
            .sum::<f64>()
            .sqrt();
        if off <= 1e-14 * scale || scale == 0.0 {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq.abs() <= 1e-300 {
                    continue;
                }
                let (app, aqq) = (a[p * n + p], a[q * n + q]);
                let theta = (aqq - app) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                // A ← Jᵀ A J on rows/columns p and q.
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vkp - s * vkq;
                    v[k * n + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    ((0..n).map(|i| a[i * n + i]).collect(), v)
}

/// f_θ's parameters that compute the two factored fits exactly: the K path's and the V
/// path's, each from `in` to `[layers · kv]` through `config.rank` codes.
pub fn params_from_fits(
    config: FThetaConfig,
    k: &Factored,
    v: &Factored,
    device: &Device,
) -> FThetaParams {
    let (rank, inp) = (config.rank, config.in_dim());
    // Layer `l`'s outputs are columns `offsets[l]..offsets[l] + width` of the fits.
    let widths = config.layer_widths();
    let offsets: Vec<usize> = widths
        .iter()
        .scan(0, |o, &w| {
            let at = *o;
            *o += w;
            Some(at)
        })
        .collect();
    let out: usize = widths.iter().sum();
    debug_assert!(k.rank == rank && v.rank == rank);
    let mut tensors: BTreeMap<String, HostTensor> = config
        .expected_tensors()
        .into_iter()
        .map(|(name, shape)| {
            let fit = if name.starts_with('k') { k } else { v };
            let data: Vec<f64> = if name.ends_with("_enc.weight") {
                // [rank, in]
                (0..rank)
                    .flat_map(|c| (0..inp).map(move |i| fit.enc[i * rank + c]))
                    .collect()
            } else if name.ends_with("_enc.bias") {
                fit.enc_b.clone()
            } else {
                let layer: usize = name
                    .split('.')
                    .nth(1)
                    .and_then(|s| s.parse().ok())
                    .expect("decoder names carry their layer");
                let (at, kv) = (offsets[layer], widths[layer]);
                if name.ends_with(".weight") {
                    // [kv, rank]
                    (0..kv)
                        .flat_map(|r| (0..rank).map(move |c| fit.dec[c * out + at + r]))
                        .collect()
                } else {
                    fit.dec_b[at..at + kv].to_vec()
                }
            };
            let data: Vec<f32> = data.into_iter().map(|x| x as f32).collect();
            (name, HostTensor { shape, data })
        })
        .collect();
    FThetaParams::from_host(config, &mut tensors, device).expect("every tensor was fitted")
}

/// The least-squares start: one pass over the training sequences'
/// drafter K/V and raw verifier K/V.
pub(super) fn least_squares(
    cfg: &FThetaTrainConfig,
    info: &DataInfo,
    ds: &Dataset,
    f_theta: &FThetaConfig,
    device: &Device,
    on_event: &mut dyn FnMut(FEvent),
) -> Result<FThetaParams> {
    let raw_only = DataInfo {
        attention: false,
        ..info.clone()
    };
    let (inp, out) = (f_theta.in_dim(), f_theta.layer_widths().iter().sum());
    let mut nk = Normal::new(inp, out, f_theta.bias);
    let mut nv = Normal::new(inp, out, f_theta.bias);
    let total = info.train.len();
    for (i, &seq) in info.train.iter().enumerate() {
        let s = raw_only.read(ds, seq)?;
        let rows_of = |k: bool| -> Vec<&[f32]> {
            s.layers
                .iter()
                .map(|l| if k { &l.k[..] } else { &l.v[..] })
                .collect()
        };
        let (yk, yv) = (
            data::side_by_side(&rows_of(true), s.len),
            data::side_by_side(&rows_of(false), s.len),
        );
        match f_theta.inputs {
            FThetaInputs::Own => {
                nk.add(&s.dk, &yk, s.len, device);
                nv.add(&s.dv, &yv, s.len, device);
            }
            FThetaInputs::Both => {
                let x = data::side_by_side(&[&s.dk, &s.dv], s.len);
                nk.add(&x, &yk, s.len, device);
                nv.add(&x, &yv, s.len, device);
            }
        }
        on_event(FEvent::Fitting { done: i + 1, total });
    }
    let singular = || {
        TrainError::invalid(
            &info.dir,
            "the least-squares start is singular (constant drafter K/V?); set model.init_ridge > 0 or model.init = \"random\"",
        )
    };
    let rank = f_theta.rank;
    let kf = nk
        .solve_rank(cfg.model.init_ridge, rank)
        .ok_or_else(singular)?;
    let vf = nv
        .solve_rank(cfg.model.init_ridge, rank)
        .ok_or_else(singular)?;
    tracing::info!(
        positions = nk.count(),
        ridge = cfg.model.init_ridge,
        "f_θ least-squares start fitted"
    );
    Ok(params_from_fits(f_theta.clone(), &kf, &vf, device))
}

#[cfg(test)]
mod tests;
