//! f_θ's losses (DESIGN §7), per verifier layer, from predicted and true raw K/V.
//!
//! Definitions (checked against `tests/fixtures/f_theta/make_f_theta.py`, a PyTorch version of
//! the same formulas): head vectors are the `[kv_heads, head_dim]` slices of a row;
//! `|x| = sqrt(Σx² + 1e-12)`, `cos(a, b) = a·b / (|a||b|)`.
//! - `mse_k = mean((K̂−K)²)`; `cos_k = mean(1 − cos(K̂_h, K_h))`; `mag_k = mean((|K̂_h| − |K_h|)²)`
//! - `kdir = mean(1 − cos(k_norm K̂_h, k_norm K_h))`; `kmag = mag_k / mean(|K_h|²)`
//! - the same for V, with `vdir = mean(1 − cos(v_norm V̂_h, v_norm V_h))` (Gemma 3 has no
//!   v_norm: `vdir = cos_v`)
//! - `mse_o = mean((O − O_tgt)²)` where `O = o_proj(softmax(Q·K̂'ᵀ·s + mask)·V̂')`,
//!   `Q = RoPE(q_norm(Q_raw))`, `K̂' = RoPE(k_norm(K̂))` at the original positions,
//!   `V̂' = v_norm(V̂)` (Gemma 4; the identity for Gemma 3), the layer's causal or sliding mask,
//!   GQA, the layer's RoPE (Gemma 4's full layers: proportional) and score scale.
//!
//! Losses: `mse = mse_k + mse_v`; `cos_mag = cos_k + mag_k + cos_v + mag_v`;
//! `combined = cos_mag + 0.1·mse`; `attn_distill = mse_o`;
//! `attn_distill_hybrid = mse_o + λkDir·kdir + λvDir·vdir + λkMag·kmag + λvMag·vmag`.

use burn::tensor::{Device, Int, Tensor, TensorData};
use kakeya_models::gemma3::attention::Attention;
use kakeya_models::norm::RmsNorm;
use kakeya_models::rope::Rope;
use kakeya_models::sdpa::grouped_attention;
use kakeya_weights::AttentionKind;
use serde::{Deserialize, Serialize};

/// Masked-out score (large and finite, so that gradients through softmax stay finite).
const MASKED: f32 = -1e9;
/// Added under square roots of squared norms.
const NORM_EPS: f64 = 1e-12;

/// Which loss trains f_θ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// MSE of raw K and V.
    Mse,
    /// Direction (1 − cos) + magnitude MSE per head vector.
    CosMag,
    /// `cos_mag + 0.1 · mse`.
    Combined,
    /// MSE of the attention output recomputed with the predicted K/V.
    AttnDistill,
    /// `attn_distill` + direction and relative-magnitude terms (the default).
    #[default]
    AttnDistillHybrid,
}

impl LossKind {
    /// Whether the loss recomputes attention (needs Q_raw and the attention output).
    pub fn needs_attention(self) -> bool {
        matches!(self, Self::AttnDistill | Self::AttnDistillHybrid)
    }

    /// The config name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Mse => "mse",
            Self::CosMag => "cos_mag",
            Self::Combined => "combined",
            Self::AttnDistill => "attn_distill",
            Self::AttnDistillHybrid => "attn_distill_hybrid",
        }
    }
}

/// Weights of the hybrid loss's extra terms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lambdas {
    /// Key direction (after k_norm).
    #[serde(default = "one")]
    pub kdir: f64,
    /// Value direction.
    #[serde(default = "one")]
    pub vdir: f64,
    /// Key relative magnitude.
    #[serde(default = "tenth")]
    pub kmag: f64,
    /// Value relative magnitude.
    #[serde(default = "tenth")]
    pub vmag: f64,
}

fn one() -> f64 {
    1.0
}

fn tenth() -> f64 {
    0.1
}

impl Default for Lambdas {
    fn default() -> Self {
        Self {
            kdir: 1.0,
            vdir: 1.0,
            kmag: 0.1,
            vmag: 0.1,
        }
    }
}

/// The verifier's frozen pieces of one layer's attention.
#[derive(Debug, Clone)]
pub struct LayerFrozen {
    /// Per-head query RMSNorm (Gemma's `1 + w` multiplier).
    pub q_norm: RmsNorm,
    /// Per-head key RMSNorm.
    pub k_norm: RmsNorm,
    /// Gemma 4's weightless per-head value RMSNorm (`None`: Gemma 3, values as projected).
    pub v_norm: Option<RmsNorm>,
    /// `o_proj` weight, `[hidden, heads · head_dim]`.
    pub o_proj: Tensor<2>,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Score scale.
    pub scale: f64,
    /// Sliding window (`None`: global, causal only).
    pub window: Option<usize>,
    /// This layer's RoPE.
    pub rope: Rope,
}

impl LayerFrozen {
    /// Copies a verifier layer's attention weights onto `device` (its autodiff twin when
    /// training; they never require gradients).
    pub fn from_attention(a: &Attention, device: &Device) -> Self {
        let to1 = |t: &Tensor<1>| Tensor::<1>::from_data(t.to_data(), device);
        let copy = |n: &RmsNorm| RmsNorm {
            scale: to1(&n.scale),
            eps: n.eps,
        };
        Self {
            q_norm: copy(&a.q_norm),
            k_norm: copy(&a.k_norm),
            v_norm: a.v_norm.as_ref().map(copy),
            o_proj: Tensor::from_data(a.o_proj.weight.to_data(), device),
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            scale: a.scale,
            window: (a.kind == AttentionKind::Sliding).then_some(a.window),
            rope: a.rope.clone(),
        }
    }

    /// Whether this is a global (full-attention) layer.
    pub fn is_global(&self) -> bool {
        self.window.is_none()
    }

    fn visible(&self, q: usize, k: usize) -> bool {
        k <= q && self.window.is_none_or(|w| q - k < w)
    }
}

/// The frozen attention pieces of layers of one shape (heads, head width, score scale),
/// stacked along a leading layer axis so that one launch serves them all.
#[derive(Debug, Clone)]
pub struct GroupFrozen {
    /// The members' verifier layer indices.
    pub ids: Vec<usize>,
    /// The members, in order.
    pub layers: Vec<LayerFrozen>,
    /// Query/key/value norm multipliers, `[L, 1, 1, head_dim]` (values: `None` without a
    /// v_norm).
    q_scale: Tensor<4>,
    k_scale: Tensor<4>,
    v_scale: Option<Tensor<4>>,
    /// `o_projᵀ` of each member, `[L, heads · head_dim, hidden]`.
    o_proj_t: Tensor<3>,
    /// Distinct windows and RoPEs of the members, and each member's index into them.
    windows: Vec<Option<usize>>,
    window_of: Vec<usize>,
    ropes: Vec<Rope>,
    rope_of: Vec<usize>,
}

/// The distinct values of `items` (first-appearance order) and each item's index into them.
fn distinct<T: PartialEq + Clone>(items: impl Iterator<Item = T>) -> (Vec<T>, Vec<usize>) {
    let mut values: Vec<T> = Vec::new();
    let index = items
        .map(|x| match values.iter().position(|v| *v == x) {
            Some(i) => i,
            None => {
                values.push(x);
                values.len() - 1
            }
        })
        .collect();
    (values, index)
}

impl GroupFrozen {
    /// Stacks `layers` (all of one shape), verifier layers `ids`.
    ///
    /// # Panics
    /// When the layers differ in heads, KV heads, head width, score scale or whether they
    /// norm values (f_θ groups layers by KV width, which fixes these in Gemma 3 and 4).
    pub fn new(ids: Vec<usize>, layers: Vec<LayerFrozen>) -> Self {
        let f = &layers[0];
        assert!(
            layers.iter().all(|l| (l.heads, l.kv_heads, l.head_dim)
                == (f.heads, f.kv_heads, f.head_dim)
                && l.scale == f.scale
                && l.v_norm.is_some() == f.v_norm.is_some()),
            "f_θ's loss stacks only layers of one attention shape"
        );
        let hd = f.head_dim;
        let stack = |pick: &dyn Fn(&LayerFrozen) -> Tensor<1>| {
            Tensor::stack::<2>(layers.iter().map(pick).collect(), 0).reshape([
                layers.len(),
                1,
                1,
                hd,
            ])
        };
        let q_scale = stack(&|l| l.q_norm.scale.clone());
        let k_scale = stack(&|l| l.k_norm.scale.clone());
        let v_scale = f.v_norm.as_ref().map(|_| {
            stack(&|l| {
                l.v_norm
                    .as_ref()
                    .expect("every member norms values")
                    .scale
                    .clone()
            })
        });
        let o_proj_t = Tensor::stack::<3>(
            layers
                .iter()
                .map(|l| l.o_proj.clone().transpose())
                .collect(),
            0,
        );
        let (windows, window_of) = distinct(layers.iter().map(|l| l.window));
        let (ropes, rope_of) = distinct(layers.iter().map(|l| l.rope.clone()));
        Self {
            ids,
            layers,
            q_scale,
            k_scale,
            v_scale,
            o_proj_t,
            windows,
            window_of,
            ropes,
            rope_of,
        }
    }

    fn first(&self) -> &LayerFrozen {
        &self.layers[0]
    }

    /// `[L, n, width]` → `[L, n, heads, head_dim]`.
    fn head_vectors(&self, x: Tensor<3>, heads: usize) -> Tensor<4> {
        let [l, n, _] = x.dims();
        x.reshape([l, n, heads, self.first().head_dim])
    }

    /// RMSNorm of head vectors with each member's multiplier.
    fn norm(x: Tensor<4>, scale: &Tensor<4>, eps: f64) -> Tensor<4> {
        // `scale` is `[L, 1, 1, d]`; head vectors here are `[L, n, heads, d]`.
        RmsNorm::normalize(x, eps) * scale.clone()
    }

    fn keys_normed(&self, hk: Tensor<4>) -> Tensor<4> {
        Self::norm(hk, &self.k_scale, self.first().k_norm.eps)
    }

    /// Value head vectors as attention reads them (v_norm where the model has one).
    fn values(&self, hv: Tensor<4>) -> Tensor<4> {
        match (&self.v_scale, &self.first().v_norm) {
            (Some(s), Some(n)) => Self::norm(hv, s, n.eps),
            _ => hv,
        }
    }

    /// Each member's RoPE tables at `positions`, `[L, 1, T, d/2]` each.
    fn tables(&self, positions: &[usize], device: &Device) -> (Tensor<4>, Tensor<4>) {
        let (cos, sin): (Vec<Tensor<2>>, Vec<Tensor<2>>) = self
            .ropes
            .iter()
            .map(|r| r.tables(positions, device))
            .unzip();
        let pick = |t: Vec<Tensor<2>>| {
            let all = Tensor::stack::<3>(t, 0);
            let [_, n, h] = all.dims();
            let idx = index(&self.rope_of, device);
            all.select(0, idx).reshape([self.layers.len(), 1, n, h])
        };
        (pick(cos), pick(sin))
    }

    /// Each member's additive mask of queries at `q_pos` over keys `0..n`, rows group-major
    /// as [`grouped_attention`] reads them: `[L · kv_heads, G · nq, n]`.
    fn mask(&self, q_pos: &[usize], n: usize, device: &Device) -> Tensor<3> {
        let f = self.first();
        let groups = f.heads / f.kv_heads;
        let nq = q_pos.len();
        let mut all = Vec::with_capacity(self.windows.len() * groups * nq * n);
        for &w in &self.windows {
            let probe = LayerFrozen {
                window: w,
                ..f.clone()
            };
            let row: Vec<f32> = q_pos
                .iter()
                .flat_map(|&p| (0..n).map(move |j| (p, j)))
                .map(|(p, j)| if probe.visible(p, j) { 0.0 } else { MASKED })
                .collect();
            for _ in 0..groups {
                all.extend_from_slice(&row);
            }
        }
        let kinds = Tensor::<3>::from_data(
            TensorData::new(all, [self.windows.len(), groups * nq, n]),
            device,
        );
        let per_head: Vec<usize> = self
            .window_of
            .iter()
            .flat_map(|&w| std::iter::repeat_n(w, f.kv_heads))
            .collect();
        kinds.select(0, index(&per_head, device))
    }

    /// Every member's attention output (after o_proj) at `q_pos` over keys/values at
    /// positions `0..n`.
    ///
    /// # Shapes
    /// - `q_raw`: `[L, nq, heads · head_dim]`; `k_raw`, `v_raw`: `[L, n, kv_heads · head_dim]`
    /// - returns `[L, nq, hidden]`
    pub fn attention(
        &self,
        q_raw: Tensor<3>,
        q_pos: &[usize],
        k_raw: Tensor<3>,
        v_raw: Tensor<3>,
    ) -> Tensor<3> {
        let device = q_raw.device();
        let f = self.first();
        let (l, hd) = (self.layers.len(), f.head_dim);
        let [_, n, _] = k_raw.dims();
        let nq = q_pos.len();
        let k_pos: Vec<usize> = (0..n).collect();
        let (qc, qs) = self.tables(q_pos, &device);
        let (kc, ks) = self.tables(&k_pos, &device);
        let q = Self::norm(
            self.head_vectors(q_raw, f.heads),
            &self.q_scale,
            f.q_norm.eps,
        )
        .swap_dims(1, 2);
        let k = self
            .keys_normed(self.head_vectors(k_raw, f.kv_heads))
            .swap_dims(1, 2);
        let v = self
            .values(self.head_vectors(v_raw, f.kv_heads))
            .swap_dims(1, 2);
        let q = Rope::rotate(q, qc, qs).reshape([l * f.heads, nq, hd]);
        let k = Rope::rotate(k, kc, ks).reshape([l * f.kv_heads, n, hd]);
        let v = v.reshape([l * f.kv_heads, n, hd]);
        let mask = self.mask(q_pos, n, &device);
        grouped_attention(q, k, v, f.scale, Some(mask))
            .reshape([nq, l, f.heads * hd])
            .swap_dims(0, 1)
            .matmul(self.o_proj_t.clone())
    }
}

fn index(ids: &[usize], device: &Device) -> Tensor<1, Int> {
    let ids: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    Tensor::from_data(TensorData::new(ids.clone(), [ids.len()]), device)
}

/// One layer's true tensors for a sequence.
#[derive(Debug, Clone)]
pub struct LayerTargets {
    /// Raw queries at `q_pos`, `[nq, heads · head_dim]` (attention losses only).
    pub q_raw: Option<Tensor<2>>,
    /// Query positions.
    pub q_pos: Vec<usize>,
    /// Raw keys at positions `0..n`, `[n, kv_heads · head_dim]`.
    pub k: Tensor<2>,
    /// Raw values, `[n, kv_heads · head_dim]`.
    pub v: Tensor<2>,
    /// Attention output at `q_pos`, `[nq, hidden]` (attention losses only).
    pub o: Option<Tensor<2>>,
}

/// The targets' constants that normalise the terms, per member layer (host values, computed
/// from host data: no device round trip).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TargetScales {
    /// `mean(K²)` of each layer.
    pub k_sq: Vec<f64>,
    /// `mean(V²)`.
    pub v_sq: Vec<f64>,
    /// `mean(|K_h|²)` over head vectors (`|x|² = Σx² + 1e-12`).
    pub k_hsq: Vec<f64>,
    /// `mean(|V_h|²)`.
    pub v_hsq: Vec<f64>,
    /// `mean(O_tgt²)` at the query positions (0 without attention).
    pub o_sq: Vec<f64>,
}

impl TargetScales {
    /// Adds one layer's constants from its raw K, V (head width `head_dim`) and, with
    /// attention, its target outputs.
    pub fn push(&mut self, k: &[f32], v: &[f32], o: Option<&[f32]>, head_dim: usize) {
        let mean_sq = |x: &[f32]| {
            x.iter().map(|&a| f64::from(a) * f64::from(a)).sum::<f64>() / x.len().max(1) as f64
        };
        let head_sq = |x: &[f32]| mean_sq(x) * head_dim as f64 + NORM_EPS;
        self.k_sq.push(mean_sq(k));
        self.v_sq.push(mean_sq(v));
        self.k_hsq.push(head_sq(k));
        self.v_hsq.push(head_sq(v));
        self.o_sq.push(o.map_or(0.0, mean_sq));
    }
}

/// The true tensors of a group's layers for one sequence, stacked.
#[derive(Debug, Clone)]
pub struct GroupTargets {
    /// Raw queries at `q_pos`, `[L, nq, heads · head_dim]` (attention losses only).
    pub q_raw: Option<Tensor<3>>,
    /// Query positions.
    pub q_pos: Vec<usize>,
    /// Raw keys at positions `0..n`, `[L, n, kv_heads · head_dim]`.
    pub k: Tensor<3>,
    /// Raw values, `[L, n, kv_heads · head_dim]`.
    pub v: Tensor<3>,
    /// Attention outputs at `q_pos`, `[L, nq, hidden]` (attention losses only).
    pub o: Option<Tensor<3>>,
    /// Host constants of the targets.
    pub scales: TargetScales,
}

impl GroupTargets {
    /// One layer's targets as a group of one (reads them back to compute the constants).
    pub fn of_layer(tg: &LayerTargets, head_dim: usize) -> Self {
        let host = |t: &Tensor<2>| t.clone().into_data().convert::<f32>().try_to_vec::<f32>();
        let host = |t: &Tensor<2>| host(t).expect("f32 targets");
        let mut scales = TargetScales::default();
        let o = tg.o.as_ref().map(host);
        scales.push(&host(&tg.k), &host(&tg.v), o.as_deref(), head_dim);
        Self {
            q_raw: tg.q_raw.clone().map(|q| q.unsqueeze()),
            q_pos: tg.q_pos.clone(),
            k: tg.k.clone().unsqueeze(),
            v: tg.v.clone().unsqueeze(),
            o: tg.o.clone().map(|o| o.unsqueeze()),
            scales,
        }
    }
}

/// A group's loss terms, one entry per member layer (`[L]`, differentiable in K̂/V̂), and the
/// constants that normalise them.
#[derive(Debug, Clone)]
pub struct Terms {
    /// `mean((K̂−K)²)`.
    pub mse_k: Tensor<1>,
    /// `mean((V̂−V)²)`.
    pub mse_v: Tensor<1>,
    /// `mean(1 − cos(K̂_h, K_h))`.
    pub cos_k: Tensor<1>,
    /// `mean(1 − cos(V̂_h, V_h))`.
    pub cos_v: Tensor<1>,
    /// `mean((|K̂_h| − |K_h|)²)`.
    pub mag_k: Tensor<1>,
    /// `mean((|V̂_h| − |V_h|)²)`.
    pub mag_v: Tensor<1>,
    /// `mean(1 − cos(k_norm K̂_h, k_norm K_h))`.
    pub kdir: Tensor<1>,
    /// `mean(1 − cos(v_norm V̂_h, v_norm V_h))` (`cos_v` without a v_norm).
    pub vdir: Tensor<1>,
    /// `mag_k / mean(|K_h|²)`.
    pub kmag: Tensor<1>,
    /// `mag_v / mean(|V_h|²)`.
    pub vmag: Tensor<1>,
    /// `mean((O − O_tgt)²)` (attention losses only).
    pub mse_o: Option<Tensor<1>>,
    /// The targets' constants.
    pub scales: TargetScales,
}

/// Each layer's mean of `x` (`[L, ...]` → `[L]`).
fn per_layer_mean<const D: usize>(x: Tensor<D>) -> Tensor<1> {
    let l = x.dims()[0];
    let rest = x.shape().num_elements() / l.max(1);
    x.reshape([l, rest]).mean_dim(1).reshape([l])
}

fn norms(x: Tensor<4>) -> Tensor<4> {
    x.square().sum_dim(3).add_scalar(NORM_EPS).sqrt()
}

fn one_minus_cos(a: Tensor<4>, b: Tensor<4>) -> Tensor<1> {
    let dot = (a.clone() * b.clone()).sum_dim(3);
    let c = dot / (norms(a) * norms(b));
    per_layer_mean(c.neg().add_scalar(1.0))
}

/// `x / c` per layer for host constants `c` (floored at 1e-30).
fn per_layer_div(x: Tensor<1>, c: &[f64]) -> Tensor<1> {
    let inv: Vec<f32> = c.iter().map(|&v| (1.0 / v.max(1e-30)) as f32).collect();
    let n = inv.len();
    let device = x.device();
    x * Tensor::<1>::from_data(TensorData::new(inv, [n]), &device)
}

/// The loss terms of a group's layers from predicted raw `k_hat`, `v_hat`
/// (`[L, n, kv_heads · head_dim]`).
pub fn group_terms(
    fr: &GroupFrozen,
    tg: &GroupTargets,
    k_hat: Tensor<3>,
    v_hat: Tensor<3>,
) -> Terms {
    let kvh = fr.first().kv_heads;
    let hk = fr.head_vectors(k_hat.clone(), kvh);
    let hv = fr.head_vectors(v_hat.clone(), kvh);
    let tk = fr.head_vectors(tg.k.clone(), kvh);
    let tv = fr.head_vectors(tg.v.clone(), kvh);
    let mse_k = per_layer_mean((k_hat.clone() - tg.k.clone()).square());
    let mse_v = per_layer_mean((v_hat.clone() - tg.v.clone()).square());
    let cos_k = one_minus_cos(hk.clone(), tk.clone());
    let cos_v = one_minus_cos(hv.clone(), tv.clone());
    let mag_k = per_layer_mean((norms(hk.clone()) - norms(tk.clone())).square());
    let mag_v = per_layer_mean((norms(hv.clone()) - norms(tv.clone())).square());
    let kdir = one_minus_cos(fr.keys_normed(hk), fr.keys_normed(tk));
    let vdir = match fr.v_scale {
        Some(_) => one_minus_cos(fr.values(hv), fr.values(tv)),
        None => cos_v.clone(),
    };
    let kmag = per_layer_div(mag_k.clone(), &tg.scales.k_hsq);
    let vmag = per_layer_div(mag_v.clone(), &tg.scales.v_hsq);
    let mse_o = match (&tg.q_raw, &tg.o) {
        (Some(q), Some(o)) => {
            let out = fr.attention(q.clone(), &tg.q_pos, k_hat, v_hat);
            Some(per_layer_mean((out - o.clone()).square()))
        }
        _ => None,
    };
    Terms {
        mse_k,
        mse_v,
        cos_k,
        cos_v,
        mag_k,
        mag_v,
        kdir,
        vdir,
        kmag,
        vmag,
        mse_o,
        scales: tg.scales.clone(),
    }
}

/// The loss terms of one layer ([`group_terms`] over a group of one).
pub fn layer_terms(
    fr: &LayerFrozen,
    tg: &LayerTargets,
    k_hat: Tensor<2>,
    v_hat: Tensor<2>,
) -> Terms {
    let group = GroupFrozen::new(vec![0], vec![fr.clone()]);
    let targets = GroupTargets::of_layer(tg, fr.head_dim);
    group_terms(&group, &targets, k_hat.unsqueeze(), v_hat.unsqueeze())
}

/// Each layer's loss (`[L]`). With `normalize_attention`, `mse_o` is divided by the layer's
/// `mean(O_tgt²)` (a constant of the data) so that every layer's attention term is its
/// relative error — otherwise layers with large outputs dominate (Gemma 3 270M: RMS of O is
/// ~8 at layer 0, ~0.5 at layer 17).
///
/// # Panics
/// When an attention loss is asked of terms computed without attention targets (the trainer
/// checks the dataset's columns before it starts).
pub fn layer_loss(kind: LossKind, l: &Lambdas, normalize_attention: bool, t: &Terms) -> Tensor<1> {
    let mse = || t.mse_k.clone() + t.mse_v.clone();
    let cos_mag = || t.cos_k.clone() + t.mag_k.clone() + t.cos_v.clone() + t.mag_v.clone();
    let mse_o = || {
        let m = t.mse_o.clone().expect("attention terms were computed");
        if normalize_attention {
            per_layer_div(m, &t.scales.o_sq)
        } else {
            m
        }
    };
    match kind {
        LossKind::Mse => mse(),
        LossKind::CosMag => cos_mag(),
        LossKind::Combined => cos_mag() + mse().mul_scalar(0.1),
        LossKind::AttnDistill => mse_o(),
        LossKind::AttnDistillHybrid => {
            mse_o()
                + t.kdir.clone().mul_scalar(l.kdir)
                + t.vdir.clone().mul_scalar(l.vdir)
                + t.kmag.clone().mul_scalar(l.kmag)
                + t.vmag.clone().mul_scalar(l.vmag)
        }
    }
}

/// Host values of one layer's diagnostics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Diagnostics {
    /// `mse_o / mean(O_tgt²)`.
    pub mse_o_ratio: f64,
    /// Key direction error after k_norm.
    pub kdir: f64,
    /// Value direction error.
    pub vdir: f64,
    /// Key relative magnitude error.
    pub kmag: f64,
    /// Value relative magnitude error.
    pub vmag: f64,
    /// `mean((K̂−K)²) / mean(K²)`.
    pub k_rel_mse: f64,
    /// `mean((V̂−V)²) / mean(V²)`.
    pub v_rel_mse: f64,
}

fn host(t: &Tensor<1>) -> Vec<f64> {
    t.clone()
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 terms")
        .into_iter()
        .map(f64::from)
        .collect()
}

impl Terms {
    /// Each member layer's diagnostics (`mse_o_ratio` is 0 without attention targets).
    pub fn diagnostics(&self) -> Vec<Diagnostics> {
        let (kdir, vdir) = (host(&self.kdir), host(&self.vdir));
        let (kmag, vmag) = (host(&self.kmag), host(&self.vmag));
        let (mse_k, mse_v) = (host(&self.mse_k), host(&self.mse_v));
        let mse_o = self.mse_o.as_ref().map(host);
        let s = &self.scales;
        (0..kdir.len())
            .map(|i| Diagnostics {
                mse_o_ratio: mse_o.as_ref().map_or(0.0, |m| m[i] / s.o_sq[i].max(1e-30)),
                kdir: kdir[i],
                vdir: vdir[i],
                kmag: kmag[i],
                vmag: vmag[i],
                k_rel_mse: mse_k[i] / s.k_sq[i].max(1e-30),
                v_rel_mse: mse_v[i] / s.v_sq[i].max(1e-30),
            })
            .collect()
    }
}
