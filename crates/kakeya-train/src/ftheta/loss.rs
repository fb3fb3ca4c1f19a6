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

use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

pub use super::frozen::{AttentionInputs, GroupFrozen, LayerFrozen};
use super::targets::Relative;
pub use super::targets::{GroupTargets, PAD, Rows, TargetScales};
use crate::optim::sum_all;

/// Added under square roots of squared norms.
pub(super) const NORM_EPS: f64 = 1e-12;

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

/// Per head vector, `cos(a, b)` given their norms `na`, `nb` ([`norms`]):
/// `[L, R, heads, d]` → `[L, R, heads, 1]`.
fn cosine(a: Tensor<4>, b: Tensor<4>, na: Tensor<4>, nb: Tensor<4>) -> Tensor<4> {
    (a * b).sum_dim(3) / (na * nb)
}

/// Per head vector, `1 − cos(a, b)` ([`cosine`]).
fn one_minus_cos(a: Tensor<4>, b: Tensor<4>, na: Tensor<4>, nb: Tensor<4>) -> Tensor<4> {
    cosine(a, b, na, nb).neg().add_scalar(1.0)
}

/// What the direction and magnitude terms are made of, per head vector of the predicted
/// keys `hk` and values `hv` (`[L, R, kv_heads, d]`), each `[L, R, kv_heads, 1]`: the norms'
/// squared differences from the targets' and the cosines after k_norm (and v_norm). A
/// direction after an RMSNorm is that of the vector times the norm's multiplier `m` — the
/// norm's own divisor is one positive number per vector — and `(x ⊙ m)·(t ⊙ m) = x·(t ⊙ m²)`,
/// the targets' side prepared ([`GroupTargets::dir`]).
struct Heads {
    norm_k: Tensor<4>,
    mag_k: Tensor<4>,
    mag_v: Tensor<4>,
    cos_kdir: Tensor<4>,
    /// Values compared as they are (`cos_vdir` without a v_norm).
    cos_v: Tensor<4>,
    cos_vdir: Tensor<4>,
}

impl Heads {
    fn of(
        fr: &GroupFrozen,
        tg: &GroupTargets,
        hk: &Tensor<4>,
        hv: &Tensor<4>,
        tv: Tensor<4>,
    ) -> Self {
        let l = hk.dims()[0];
        let (norm_k, norm_v) = (norms(hk.clone()), norms(hv.clone()));
        let mag_k = (norm_k.clone() - tg.k_norms.clone()).square();
        let mag_v = (norm_v.clone() - tg.v_norms.clone()).square();
        let dir = |i: usize| tg.dir.clone().narrow(0, i * l, l).reshape(hk.dims());
        // cos(h ⊙ m, t ⊙ m) = h·(t ⊙ m²) / (|h ⊙ m| |t ⊙ m|).
        let direction = |h: &Tensor<4>, m: &Tensor<4>, to: Tensor<4>, n: &Tensor<4>| {
            (h.clone() * to).sum_dim(3) / (norms(h.clone() * m.clone()) * n.clone())
        };
        let cos_kdir = direction(hk, &fr.k_scale, dir(0), &tg.k_dir_norms);
        let cos_v = cosine(hv.clone(), tv, norm_v, tg.v_norms.clone());
        let cos_vdir = match &fr.v_scale {
            Some(m) => direction(hv, m, dir(1), &tg.v_dir_norms),
            None => cos_v.clone(),
        };
        Self {
            norm_k,
            mag_k,
            mag_v,
            cos_kdir,
            cos_v,
            cos_vdir,
        }
    }
}

/// Every loss term of a group's layers from predicted raw `k_hat`, `v_hat` (`[L, R, kv_heads
/// · head_dim]`, the rows of `tg`); the targets' side (head norms, key directions after
/// k_norm, the queries as attention reads them) comes prepared with `tg`.
pub fn group_terms(
    fr: &GroupFrozen,
    tg: &GroupTargets,
    k_hat: Tensor<3>,
    v_hat: Tensor<3>,
) -> Terms {
    let kvh = fr.first().kv_heads;
    let rows = tg.weights(&tg.rows.k_seq, Relative::No, 1.0);
    let mean = |x: Tensor<4>| weighted(x, &rows);
    let one_minus = |c: Tensor<4>| mean(c.neg().add_scalar(1.0));
    let hk = fr.head_vectors(k_hat.clone(), kvh);
    let hv = fr.head_vectors(v_hat.clone(), kvh);
    let (tk, tv) = tg
        .kv
        .clone()
        .expect("the terms read the raw targets (HostTargets::new with raw)");
    let h = Heads::of(fr, tg, &hk, &hv, fr.head_vectors(tv.clone(), kvh));
    let tk3 = tk.clone();
    let tk = fr.head_vectors(tk, kvh);
    let relative = |c| tg.weights(&tg.rows.k_seq, c, 1.0);
    let (mse_o, mse_o_rel) = match (&tg.q, &tg.o, &tg.attention) {
        (Some(q), Some(o), Some(inputs)) => {
            let out = fr.attention(q.clone(), inputs, k_hat.clone(), v_hat.clone());
            let err = (out - o.clone()).square();
            let per_query = |c| tg.weights(&tg.rows.q_seq, c, 1.0);
            (
                Some(weighted(err.clone(), &per_query(Relative::No))),
                Some(weighted(err, &per_query(Relative::Outputs))),
            )
        }
        _ => (None, None),
    };
    Terms {
        mse_k: weighted((k_hat - tk3).square(), &rows),
        mse_v: weighted((v_hat - tv).square(), &rows),
        cos_k: mean(one_minus_cos(hk, tk, h.norm_k, tg.k_norms.clone())),
        cos_v: one_minus(h.cos_v),
        mag_k: mean(h.mag_k.clone()),
        mag_v: mean(h.mag_v.clone()),
        kdir: one_minus(h.cos_kdir),
        vdir: one_minus(h.cos_vdir),
        kmag: weighted(h.mag_k, &relative(Relative::KeyHeads)),
        vmag: weighted(h.mag_v, &relative(Relative::ValueHeads)),
        mse_o,
        mse_o_rel,
        scales: tg.scales.clone(),
    }
}

/// What [`group_loss`] weighs with, on the device ([`GroupTargets::loss_weights`]; a training
/// step uploads them before it launches anything: on a GPU an upload queued behind kernels
/// may wait for them).
#[derive(Debug, Clone, Default)]
pub struct LossWeights {
    /// Each query's attention error weight, `[L, Q, 1]` (attention losses).
    pub outputs: Option<Tensor<3>>,
    /// The head vectors' target norms, magnitude and direction weights, each `[2L, R ·
    /// kv_heads, 2]` (the hybrid loss; [`GroupTargets::head_weights`]).
    pub heads: Option<[Tensor<3>; 3]>,
}

impl LossWeights {
    /// Every device tensor, flattened (views), with its shape, onto `all`.
    pub fn tensors(&self, all: &mut Vec<(Vec<usize>, Tensor<1>)>) {
        for t in self.outputs.iter().chain(self.heads.iter().flatten()) {
            super::pass::push_flat(all, t);
        }
    }
}

/// The sum over a group's member layers of [`layer_loss`] — what a training step needs of
/// [`group_terms`], in fewer launches for the attention losses: their terms are weighted sums
/// over head vectors and queries, so each is weighed per row on the host (λ, `1/heads`, the
/// relative constants folded into the weights) and all are summed at once; the `1 −` of the
/// direction terms is a host constant. Other losses: through [`group_terms`]. `w`: this
/// loss's [`GroupTargets::loss_weights`]; the loss: its kind, λ and `normalize_attention`.
///
/// # Shapes
/// - `k_hat`, `v_hat`: `[L, R, kv_heads · head_dim]` → `[1]`
pub fn group_loss(
    fr: &GroupFrozen,
    tg: &GroupTargets,
    w: &LossWeights,
    k_hat: Tensor<3>,
    v_hat: Tensor<3>,
    (kind, lambdas, normalize_attention): (LossKind, &Lambdas, bool),
) -> Tensor<1> {
    let (Some(q), Some(o), Some(inputs), Some(w_o)) = (&tg.q, &tg.o, &tg.attention, &w.outputs)
    else {
        let terms = group_terms(fr, tg, k_hat, v_hat);
        return sum_all(layer_loss(kind, lambdas, normalize_attention, &terms));
    };
    let [l, r, _] = k_hat.dims();
    let out = fr.attention(q.clone(), inputs, k_hat.clone(), v_hat.clone());
    let loss = sum_all((out - o.clone()).square() * w_o.clone());
    let Some([norms, w_mag, w_dir]) = &w.heads else {
        return loss;
    };
    // Keys and values together, `[2L, R · kv_heads, d]`: each head vector's `Σx²` and
    // `Σ(x ⊙ m)²` in one product, its dot product with the target's direction, then every
    // term weighed on the host and summed.
    let (kvh, d) = (fr.first().kv_heads, fr.first().head_dim);
    let x = Tensor::cat(vec![k_hat, v_hat], 0).reshape([2 * l, r * kvh, d]);
    let n = x
        .clone()
        .square()
        .matmul(fr.square_mult.clone())
        .add_scalar(NORM_EPS)
        .sqrt();
    let dot = (x * tg.dir.clone()).sum_dim(2);
    let heads = (n.clone() - norms.clone()).square() * w_mag.clone() - dot / n * w_dir.clone();
    // Σ λ·mean(1 − cos) = λ · (sequences · layers) − Σ λ·w·cos: each sequence's row weights
    // sum to 1 per layer.
    let sequences = tg.scales.len() as f64;
    (loss + sum_all(heads)).add_scalar((lambdas.kdir + lambdas.vdir) * sequences * l as f64)
}

/// Every loss term of one layer ([`group_terms`] over a group of one).
pub fn layer_terms(
    fr: &LayerFrozen,
    tg: &LayerTargets,
    k_hat: Tensor<2>,
    v_hat: Tensor<2>,
) -> Terms {
    let group = GroupFrozen::new(vec![0], vec![fr.clone()]);
    let targets = GroupTargets::from_layers(&group, std::slice::from_ref(tg));
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
