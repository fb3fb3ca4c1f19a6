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

use burn::tensor::{Tensor, TensorData};
use serde::{Deserialize, Serialize};

pub use super::frozen::{AttentionInputs, GroupFrozen, LayerFrozen};

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

/// The sequence index of padding rows and queries ([`Rows::pad`]).
pub const PAD: usize = usize::MAX;

/// Where the rows of a batch of sequences come from: each key row's sequence and position,
/// each query's.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rows {
    /// Sequence (index in the batch) of each key row.
    pub k_seq: Vec<usize>,
    /// Position of each key row in its sequence.
    pub k_pos: Vec<usize>,
    /// Sequence of each query.
    pub q_seq: Vec<usize>,
    /// Position of each query in its sequence.
    pub q_pos: Vec<usize>,
}

impl Rows {
    /// One sequence of `n` positions with queries at `q_pos`.
    pub fn one(n: usize, q_pos: &[usize]) -> Self {
        Self {
            k_seq: vec![0; n],
            k_pos: (0..n).collect(),
            q_seq: vec![0; q_pos.len()],
            q_pos: q_pos.to_vec(),
        }
    }

    /// Appends a sequence of `n` positions with queries at `q_pos`.
    pub fn push(&mut self, n: usize, q_pos: &[usize]) {
        let s = self.sequences();
        self.k_seq.extend(std::iter::repeat_n(s, n));
        self.k_pos.extend(0..n);
        self.q_seq.extend(std::iter::repeat_n(s, q_pos.len()));
        self.q_pos.extend_from_slice(q_pos);
    }

    /// Pads the key rows and the queries with [`PAD`] entries up to multiples of `multiple`
    /// (so that a GPU meets few distinct shapes); returns how many of each were added. Padding
    /// weighs nothing in any term, and no query of a sequence sees a padding key.
    pub fn pad(&mut self, multiple: usize) -> (usize, usize) {
        let up = |n: usize| n.div_ceil(multiple.max(1)) * multiple.max(1) - n;
        let (rows, queries) = (up(self.k_seq.len()), up(self.q_seq.len()));
        self.k_seq.extend(std::iter::repeat_n(PAD, rows));
        self.k_pos.extend(std::iter::repeat_n(0, rows));
        self.q_seq.extend(std::iter::repeat_n(PAD, queries));
        self.q_pos.extend(std::iter::repeat_n(0, queries));
        (rows, queries)
    }

    fn sequences(&self) -> usize {
        self.k_seq
            .iter()
            .rev()
            .find(|&&s| s != PAD)
            .map_or(0, |&s| s + 1)
    }
}

/// Which target constant a weighted mean is relative to.
#[derive(Debug, Clone, Copy)]
enum Relative {
    /// None: a plain mean.
    No,
    /// `mean(|K_h|²)`.
    KeyHeads,
    /// `mean(|V_h|²)`.
    ValueHeads,
    /// `mean(O_tgt²)`.
    Outputs,
}

/// The true tensors of a group's layers for a batch of sequences (their rows one after the
/// other), stacked by layer.
#[derive(Debug, Clone)]
pub struct GroupTargets {
    /// Raw queries, `[L, Q, heads · head_dim]` (attention losses only).
    pub q_raw: Option<Tensor<3>>,
    /// Raw keys, `[L, R, kv_heads · head_dim]`.
    pub k: Tensor<3>,
    /// Raw values, `[L, R, kv_heads · head_dim]`.
    pub v: Tensor<3>,
    /// Attention outputs at the queries, `[L, Q, hidden]` (attention losses only).
    pub o: Option<Tensor<3>>,
    /// Which sequence and position each row and query is.
    pub rows: Rows,
    /// Host constants of each sequence's targets.
    pub scales: Vec<TargetScales>,
    /// The rows' masks and RoPE tables when built ahead (attention losses; `None`: built
    /// when the loss runs).
    pub attention: Option<AttentionInputs>,
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
            k: tg.k.clone().unsqueeze(),
            v: tg.v.clone().unsqueeze(),
            o: tg.o.clone().map(|o| o.unsqueeze()),
            rows: Rows::one(tg.k.dims()[0], &tg.q_pos),
            scales: vec![scales],
            attention: None,
        }
    }

    /// Per row (`of`: each row's sequence), `1 / (rows of its sequence · c)` with `c` the
    /// sequence's constant of layer `l` that `relative` names (or 1): `[L, R]` weights that make a weighted
    /// sum over rows the sum over sequences of per-sequence means (of relative values).
    fn weights(&self, of: &[usize], c: Relative) -> Tensor<2> {
        let layers = self.k.dims()[0];
        let mut count = vec![0usize; self.rows.sequences()];
        for &s in of.iter().filter(|&&s| s != PAD) {
            count[s] += 1;
        }
        let count = &count;
        let w: Vec<f32> = (0..layers)
            .flat_map(|l| {
                of.iter().map(move |&s| {
                    if s == PAD {
                        return 0.0;
                    }
                    let sc = &self.scales[s];
                    let k = match c {
                        Relative::No => 1.0,
                        Relative::KeyHeads => sc.k_hsq[l],
                        Relative::ValueHeads => sc.v_hsq[l],
                        Relative::Outputs => sc.o_sq[l],
                    }
                    .max(1e-30);
                    (1.0 / (count[s] as f64 * k)) as f32
                })
            })
            .collect();
        Tensor::from_data(TensorData::new(w, [layers, of.len()]), &self.k.device())
    }
}

/// A group's loss terms, one entry per member layer (`[L]`, differentiable in K̂/V̂): each
/// the sum over the batch's sequences of the per-sequence mean (one sequence: the mean).
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
    /// `mse_o / mean(O_tgt²)` (attention losses only).
    pub mse_o_rel: Option<Tensor<1>>,
    /// Each sequence's target constants.
    pub scales: Vec<TargetScales>,
}

/// `Σ_r w[l, r] · mean(x[l, r, ...])`: `x` `[L, R, ...]`, `w` `[L, R]` → `[L]`.
fn weighted<const D: usize>(x: Tensor<D>, w: &Tensor<2>) -> Tensor<1> {
    let [l, r] = [x.dims()[0], x.dims()[1]];
    let rest = x.shape().num_elements() / (l * r).max(1);
    (x.reshape([l, r, rest]).mean_dim(2).reshape([l, r]) * w.clone())
        .sum_dim(1)
        .reshape([l])
}

/// Per head vector, `sqrt(Σx² + 1e-12)`: `[L, R, heads, d]` → `[L, R, heads, 1]`.
fn norms(x: Tensor<4>) -> Tensor<4> {
    x.square().sum_dim(3).add_scalar(NORM_EPS).sqrt()
}

/// Per head vector, `1 − cos(a, b)` given their norms `na`, `nb` ([`norms`]):
/// `[L, R, heads, d]` → `[L, R, heads, 1]`.
fn one_minus_cos_with(a: Tensor<4>, b: Tensor<4>, na: Tensor<4>, nb: Tensor<4>) -> Tensor<4> {
    let dot = (a * b).sum_dim(3);
    (dot / (na * nb)).neg().add_scalar(1.0)
}

/// Per head vector, `1 − cos(a, b)`: `[L, R, heads, d]` → `[L, R, heads, 1]`.
fn one_minus_cos(a: Tensor<4>, b: Tensor<4>) -> Tensor<4> {
    let (na, nb) = (norms(a.clone()), norms(b.clone()));
    one_minus_cos_with(a, b, na, nb)
}

/// The loss terms of a group's layers from predicted raw `k_hat`, `v_hat`
/// (`[L, R, kv_heads · head_dim]`, the rows of `tg`).
pub fn group_terms(
    fr: &GroupFrozen,
    tg: &GroupTargets,
    k_hat: Tensor<3>,
    v_hat: Tensor<3>,
) -> Terms {
    let kvh = fr.first().kv_heads;
    let rows = tg.weights(&tg.rows.k_seq, Relative::No);
    let mean = |x: Tensor<4>| weighted(x, &rows);
    let hk = fr.head_vectors(k_hat.clone(), kvh);
    let hv = fr.head_vectors(v_hat.clone(), kvh);
    let tk = fr.head_vectors(tg.k.clone(), kvh);
    let tv = fr.head_vectors(tg.v.clone(), kvh);
    let mse_k = weighted((k_hat.clone() - tg.k.clone()).square(), &rows);
    let mse_v = weighted((v_hat.clone() - tg.v.clone()).square(), &rows);
    // Each head vector's norm once: the direction and the magnitude terms share them.
    let (nhk, ntk) = (norms(hk.clone()), norms(tk.clone()));
    let (nhv, ntv) = (norms(hv.clone()), norms(tv.clone()));
    let cos_k = mean(one_minus_cos_with(
        hk.clone(),
        tk.clone(),
        nhk.clone(),
        ntk.clone(),
    ));
    let cos_v = mean(one_minus_cos_with(
        hv.clone(),
        tv.clone(),
        nhv.clone(),
        ntv.clone(),
    ));
    let dk = (nhk - ntk).square();
    let dv = (nhv - ntv).square();
    let kmag = weighted(dk.clone(), &tg.weights(&tg.rows.k_seq, Relative::KeyHeads));
    let vmag = weighted(
        dv.clone(),
        &tg.weights(&tg.rows.k_seq, Relative::ValueHeads),
    );
    let (mag_k, mag_v) = (mean(dk), mean(dv));
    let kdir = mean(one_minus_cos(fr.keys_normed(hk), fr.keys_normed(tk)));
    let vdir = match fr.v_scale {
        Some(_) => mean(one_minus_cos(fr.values(hv), fr.values(tv))),
        None => cos_v.clone(),
    };
    let (mse_o, mse_o_rel) = match (&tg.q_raw, &tg.o) {
        (Some(q), Some(o)) => {
            let out = fr.attention(q.clone(), &tg.rows, tg.attention.as_ref(), k_hat, v_hat);
            let err = (out - o.clone()).square();
            let per_query = tg.weights(&tg.rows.q_seq, Relative::No);
            let relative = tg.weights(&tg.rows.q_seq, Relative::Outputs);
            (
                Some(weighted(err.clone(), &per_query)),
                Some(weighted(err, &relative)),
            )
        }
        _ => (None, None),
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
        mse_o_rel,
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
        let m = if normalize_attention {
            &t.mse_o_rel
        } else {
            &t.mse_o
        };
        m.clone().expect("attention terms were computed")
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
    ///
    /// # Panics
    /// When the terms cover several sequences (the relative MSEs are per-sequence figures).
    pub fn diagnostics(&self) -> Vec<Diagnostics> {
        assert_eq!(
            self.scales.len(),
            1,
            "diagnostics are of one sequence's terms"
        );
        let (kdir, vdir) = (host(&self.kdir), host(&self.vdir));
        let (kmag, vmag) = (host(&self.kmag), host(&self.vmag));
        let (mse_k, mse_v) = (host(&self.mse_k), host(&self.mse_v));
        let mse_o_rel = self.mse_o_rel.as_ref().map(host);
        let s = &self.scales[0];
        (0..kdir.len())
            .map(|i| Diagnostics {
                mse_o_ratio: mse_o_rel.as_ref().map_or(0.0, |m| m[i]),
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
