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

use burn::tensor::{Device, Tensor, TensorData};
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

    fn head_vectors(&self, x: Tensor<2>, heads: usize) -> Tensor<3> {
        let n = x.dims()[0];
        x.reshape([n, heads, self.head_dim])
    }

    /// Value head vectors as attention reads them (v_norm where the model has one).
    fn values(&self, v: Tensor<3>) -> Tensor<3> {
        match &self.v_norm {
            Some(n) => n.forward(v),
            None => v,
        }
    }

    /// The attention output (after o_proj) at `q_pos` over keys/values at positions
    /// `0..n`.
    ///
    /// # Shapes
    /// - `q_raw`: `[nq, heads · head_dim]`; `k_raw`, `v_raw`: `[n, kv_heads · head_dim]`
    /// - returns `[nq, hidden]`
    pub fn attention(
        &self,
        q_raw: Tensor<2>,
        q_pos: &[usize],
        k_raw: Tensor<2>,
        v_raw: Tensor<2>,
    ) -> Tensor<2> {
        let device = q_raw.device();
        let n = k_raw.dims()[0];
        let nq = q_pos.len();
        let k_pos: Vec<usize> = (0..n).collect();
        let (qc, qs) = self.rope.tables(q_pos, &device);
        let (kc, ks) = self.rope.tables(&k_pos, &device);
        let q = self
            .q_norm
            .forward(self.head_vectors(q_raw, self.heads))
            .swap_dims(0, 1);
        let k = self
            .k_norm
            .forward(self.head_vectors(k_raw, self.kv_heads))
            .swap_dims(0, 1);
        let v = self
            .values(self.head_vectors(v_raw, self.kv_heads))
            .swap_dims(0, 1);
        let q = Rope::apply(q, &qc, &qs);
        let k = Rope::apply(k, &kc, &ks);
        let groups = self.heads / self.kv_heads;
        let row: Vec<f32> = q_pos
            .iter()
            .flat_map(|&p| (0..n).map(move |j| (p, j)))
            .map(|(p, j)| if self.visible(p, j) { 0.0 } else { MASKED })
            .collect();
        let mut all = Vec::with_capacity(groups * row.len());
        for _ in 0..groups {
            all.extend_from_slice(&row);
        }
        let mask = Tensor::<3>::from_data(TensorData::new(all, [1, groups * nq, n]), &device);
        grouped_attention(q, k, v, self.scale, Some(mask)).matmul(self.o_proj.clone().transpose())
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

/// One layer's loss terms (scalars `[1]`, differentiable in K̂/V̂) and the constants that
/// normalise them.
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
    /// `mean(K²)`, `mean(V²)` and `mean(O_tgt²)` of the targets (host values).
    pub k_sq: f64,
    /// See `k_sq`.
    pub v_sq: f64,
    /// See `k_sq` (0 without attention).
    pub o_sq: f64,
}

fn scalar(t: &Tensor<1>) -> f64 {
    f64::from(t.clone().into_scalar::<f32>())
}

fn norms(x: Tensor<3>) -> Tensor<2> {
    x.square()
        .sum_dim(2)
        .add_scalar(NORM_EPS)
        .sqrt()
        .squeeze_dim::<2>(2)
}

fn one_minus_cos(a: Tensor<3>, b: Tensor<3>) -> Tensor<1> {
    let dot = (a.clone() * b.clone()).sum_dim(2).squeeze_dim::<2>(2);
    let c = dot / (norms(a) * norms(b));
    c.neg().add_scalar(1.0).mean()
}

/// The loss terms of one layer from predicted raw `k_hat`, `v_hat` (`[n, kv_heads · head_dim]`).
pub fn layer_terms(
    fr: &LayerFrozen,
    tg: &LayerTargets,
    k_hat: Tensor<2>,
    v_hat: Tensor<2>,
) -> Terms {
    let hk = fr.head_vectors(k_hat.clone(), fr.kv_heads);
    let hv = fr.head_vectors(v_hat.clone(), fr.kv_heads);
    let tk = fr.head_vectors(tg.k.clone(), fr.kv_heads);
    let tv = fr.head_vectors(tg.v.clone(), fr.kv_heads);
    let mse_k = (k_hat.clone() - tg.k.clone()).square().mean();
    let mse_v = (v_hat.clone() - tg.v.clone()).square().mean();
    let cos_k = one_minus_cos(hk.clone(), tk.clone());
    let cos_v = one_minus_cos(hv.clone(), tv.clone());
    let (nk, ntk) = (norms(hk.clone()), norms(tk.clone()));
    let (nv, ntv) = (norms(hv.clone()), norms(tv.clone()));
    let k_hsq = scalar(&ntk.clone().square().mean());
    let v_hsq = scalar(&ntv.clone().square().mean());
    let mag_k = (nk - ntk).square().mean();
    let mag_v = (nv - ntv).square().mean();
    let kdir = one_minus_cos(fr.k_norm.forward(hk), fr.k_norm.forward(tk));
    let vdir = match fr.v_norm {
        Some(_) => one_minus_cos(fr.values(hv), fr.values(tv)),
        None => cos_v.clone(),
    };
    let kmag = mag_k.clone().div_scalar(k_hsq.max(1e-30));
    let vmag = mag_v.clone().div_scalar(v_hsq.max(1e-30));
    let (mse_o, o_sq) = match (&tg.q_raw, &tg.o) {
        (Some(q), Some(o)) => {
            let out = fr.attention(q.clone(), &tg.q_pos, k_hat, v_hat);
            let o_sq = scalar(&o.clone().square().mean());
            (Some((out - o.clone()).square().mean()), o_sq)
        }
        _ => (None, 0.0),
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
        k_sq: scalar(&tg.k.clone().square().mean()),
        v_sq: scalar(&tg.v.clone().square().mean()),
        o_sq,
    }
}

/// The loss of one layer. With `normalize_attention`, `mse_o` is divided by `mean(O_tgt²)`
/// (a constant of the data) so that every layer's attention term is its relative error —
/// otherwise layers with large outputs dominate (Gemma 3 270M: RMS of O is ~8 at layer 0,
/// ~0.5 at layer 17).
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
            m.div_scalar(t.o_sq.max(1e-30))
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

impl Terms {
    /// The diagnostics' host values (`mse_o_ratio` is 0 without attention targets).
    pub fn diagnostics(&self) -> Diagnostics {
        Diagnostics {
            mse_o_ratio: self
                .mse_o
                .as_ref()
                .map_or(0.0, |m| scalar(m) / self.o_sq.max(1e-30)),
            kdir: scalar(&self.kdir),
            vdir: scalar(&self.vdir),
            kmag: scalar(&self.kmag),
            vmag: scalar(&self.vmag),
            k_rel_mse: scalar(&self.mse_k) / self.k_sq.max(1e-30),
            v_rel_mse: scalar(&self.mse_v) / self.v_sq.max(1e-30),
        }
    }
}
