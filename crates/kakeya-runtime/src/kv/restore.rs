//! Restoration: rebuilding a verifier layer's raw K/V (k_proj / v_proj outputs, before k_norm and
//! RoPE) for evicted positions. [`Restorer`] is the seam; [`FThetaRestorer`] is f_θ on the
//! compact store, [`OracleRestorer`] hands back the verifier's own K/V (it checks the machinery
//! apart from f_θ's accuracy).

use std::ops::Range;

use burn::tensor::Tensor;
use kakeya_models::{DraftContext, FTheta, KvPart, ModelError};
use kakeya_weights::ftheta::FThetaInputs;

use super::store::CompactStore;
use crate::error::{Result, RuntimeError};

/// Rebuilds evicted K/V of a verifier layer.
pub trait Restorer: std::fmt::Debug + Send + Sync {
    /// Raw K or V (`part`) of verifier layer `layer` at `positions`, from the store's rows for
    /// those positions when the restorer reads the store.
    ///
    /// # Shapes
    /// - returns `[positions.len, kv_heads · head_dim]`
    fn restore(
        &self,
        layer: usize,
        positions: Range<usize>,
        part: KvPart,
        store: Option<&CompactStore>,
    ) -> kakeya_models::Result<Tensor<2>>;

    /// Whether [`Restorer::restore`] reads the compact store.
    fn reads_store(&self) -> bool;

    /// Bytes of the restorer's own weights (reported apart from the KV).
    fn nbytes(&self) -> usize;
}

/// One affine map `x · Wᵀ + b`, `W`: `[out, in]`, `b`: `[1, out]`.
#[derive(Debug, Clone)]
struct Folded {
    w_t: Tensor<2>,
    b: Tensor<2>,
}

impl Folded {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        x.matmul(self.w_t.clone()) + self.b.clone()
    }

    fn nbytes(&self) -> usize {
        (self.w_t.shape().num_elements() + self.b.shape().num_elements()) * 4
    }
}

/// f_θ as a restorer. Encoder and per-layer decoder are both linear, so each layer's map is
/// folded once at load into one affine map `in → verifier_kv_dim` (`Dec_ℓ · Enc`, bias
/// `Dec_ℓ · b_enc + b_dec`): per position and layer that is `in · kv` multiply-adds instead of
/// `(in + kv) · rank` (same function; f32 rounding differs from the unfolded product).
#[derive(Debug, Clone)]
pub struct FThetaRestorer {
    inputs: FThetaInputs,
    /// Store columns f_θ reads, in its input order.
    columns: Vec<Range<usize>>,
    k: Vec<Folded>,
    v: Vec<Folded>,
}

fn fold(f: &kakeya_models::ftheta::FThetaPath, layer: usize) -> Folded {
    let enc = &f.enc;
    let dec = &f.decoder(layer);
    // W = Dec · Enc: [out, rank] · [rank, in] → [out, in]; stored transposed for x · Wᵀ.
    let w = dec.weight.clone().matmul(enc.weight.clone());
    let out = w.dims()[0];
    let device = w.device();
    let mut b = match &enc.bias {
        Some(be) => be.clone().matmul(dec.weight.clone().transpose()),
        None => Tensor::zeros([1, out], &device),
    };
    if let Some(bd) = &dec.bias {
        b = b + bd.clone();
    }
    Folded {
        w_t: w.transpose(),
        b,
    }
}

impl FThetaRestorer {
    /// Folds f_θ for a store of `width`-value rows holding `drafter_layers` layers.
    pub fn new(f: &FTheta, drafter_layers: usize, width: usize) -> Result<Self> {
        let c = &f.config;
        let per = width / drafter_layers.max(1);
        if per != c.drafter_kv_dim || c.drafter_layers.iter().any(|&l| l >= drafter_layers) {
            return Err(RuntimeError::Input(format!(
                "f_θ reads drafter layers {:?} of width {}, but the drafter has {drafter_layers} layers of width {per}",
                c.drafter_layers, c.drafter_kv_dim
            )));
        }
        Ok(Self {
            inputs: c.inputs,
            columns: c
                .drafter_layers
                .iter()
                .map(|&l| l * per..(l + 1) * per)
                .collect(),
            k: (0..c.verifier_layers).map(|l| fold(&f.k, l)).collect(),
            v: (0..c.verifier_layers).map(|l| fold(&f.v, l)).collect(),
        })
    }

    fn select(&self, rows: Tensor<2>) -> Tensor<2> {
        let [n, w] = rows.dims();
        let contiguous = self.columns.windows(2).all(|p| p[0].end == p[1].start);
        if contiguous
            && self.columns.first().map(|c| c.start) == Some(0)
            && self.columns.last().map(|c| c.end) == Some(w)
        {
            return rows;
        }
        Tensor::cat(
            self.columns
                .iter()
                .map(|c| rows.clone().slice([0..n, c.clone()]))
                .collect(),
            1,
        )
    }
}

impl Restorer for FThetaRestorer {
    fn restore(
        &self,
        layer: usize,
        positions: Range<usize>,
        part: KvPart,
        store: Option<&CompactStore>,
    ) -> kakeya_models::Result<Tensor<2>> {
        let store = store.ok_or_else(|| {
            ModelError::Input("f_θ restoration needs the compact store (a drafter)".into())
        })?;
        if layer >= self.k.len() {
            return Err(ModelError::Input(format!(
                "f_θ has {} verifier layers, asked for layer {layer}",
                self.k.len()
            )));
        }
        let x = match (self.inputs, part) {
            (FThetaInputs::Own, KvPart::K) => self.select(store.read_part(positions, KvPart::K)?),
            (FThetaInputs::Own, KvPart::V) => self.select(store.read_part(positions, KvPart::V)?),
            (FThetaInputs::Both, _) => {
                let (dk, dv) = store.read(positions)?;
                Tensor::cat(vec![self.select(dk), self.select(dv)], 1)
            }
        };
        Ok(match part {
            KvPart::K => self.k[layer].forward(x),
            KvPart::V => self.v[layer].forward(x),
        })
    }

    fn reads_store(&self) -> bool {
        true
    }

    fn nbytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(Folded::nbytes).sum()
    }
}

/// Hands back known raw K/V (e.g. the verifier's own, captured from a full forward): restoration
/// without f_θ's error.
#[derive(Debug, Clone)]
pub struct OracleRestorer {
    /// Per layer: raw K and V of every position, `[n, kv_heads · head_dim]` each.
    pub layers: Vec<(Tensor<2>, Tensor<2>)>,
}

impl Restorer for OracleRestorer {
    fn restore(
        &self,
        layer: usize,
        positions: Range<usize>,
        part: KvPart,
        _store: Option<&CompactStore>,
    ) -> kakeya_models::Result<Tensor<2>> {
        let (k, v) = self
            .layers
            .get(layer)
            .ok_or_else(|| ModelError::Cache(format!("oracle has no layer {layer}")))?;
        let [n, w] = k.dims();
        if positions.end > n {
            return Err(ModelError::Input(format!(
                "oracle holds {n} positions, asked for {positions:?}"
            )));
        }
        let x = match part {
            KvPart::K => k,
            KvPart::V => v,
        };
        Ok(x.clone().slice([positions, 0..w]))
    }

    fn reads_store(&self) -> bool {
        false
    }

    fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(k, v)| (k.shape().num_elements() + v.shape().num_elements()) * 4)
            .sum()
    }
}
