//! f_θ (DESIGN §7): from the drafter's per-position context K and V to the verifier's raw
//! k_proj / v_proj outputs, one linear path each: a shared encoder, then one decoder per
//! verifier layer — the decoders of one width stacked, so that one product runs them all
//! (training computes every layer at once). The same struct runs in the runtime (plain tensors) and in training (tensors
//! that track gradients, built by the trainer from its parameters).

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_weights::ftheta::FThetaInputs;
use kakeya_weights::{FThetaCheckpoint, FThetaConfig};

use crate::error::{ModelError, Result};

/// `x · Wᵀ + b`.
#[derive(Debug, Clone)]
pub struct Affine {
    /// `[out, in]`.
    pub weight: Tensor<2>,
    /// `[1, out]`, broadcast over rows.
    pub bias: Option<Tensor<2>>,
}

impl Affine {
    /// # Shapes
    /// - `x`: `[n, in]` → `[n, out]`
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let y = crate::gpu::matmul(x, self.weight.clone().transpose());
        match &self.bias {
            Some(b) => y + b.clone(),
            None => y,
        }
    }
}

/// The decoders of the verifier layers of one KV width, stacked: one product serves them all.
#[derive(Debug, Clone)]
pub struct DecoderGroup {
    /// Output width of each member.
    pub width: usize,
    /// The member layers, in order.
    pub layers: Vec<usize>,
    /// The members' `[width, rank]` weights one under the other: `[layers · width, rank]`,
    /// bias `[1, layers · width]`.
    pub stacked: Affine,
}

impl DecoderGroup {
    /// Every member's output.
    ///
    /// # Shapes
    /// - `z`: `[n, rank]` → `[layers, n, width]`
    pub fn forward(&self, z: Tensor<2>) -> Tensor<3> {
        let n = z.dims()[0];
        self.stacked
            .forward(z)
            .reshape([n, self.layers.len(), self.width])
            .swap_dims(0, 1)
    }

    /// Member `i`'s decoder alone (views of the stacked tensors).
    pub fn member(&self, i: usize) -> Affine {
        let (w, rank) = (self.width, self.stacked.weight.dims()[1]);
        Affine {
            weight: self
                .stacked
                .weight
                .clone()
                .slice([i * w..(i + 1) * w, 0..rank]),
            bias: self
                .stacked
                .bias
                .as_ref()
                .map(|b| b.clone().slice([0..1, i * w..(i + 1) * w])),
        }
    }
}

/// One path (K or V): shared encoder, per-layer decoders (stacked by width).
#[derive(Debug, Clone)]
pub struct FThetaPath {
    /// `in → rank`.
    pub enc: Affine,
    /// The decoders, grouped by output width ([`FThetaConfig::width_groups`]).
    pub dec: Vec<DecoderGroup>,
}

impl FThetaPath {
    /// The shared code of every position.
    ///
    /// # Shapes
    /// - `x`: `[n, drafter_layers · drafter_kv_dim]` → `[n, rank]`
    pub fn encode(&self, x: Tensor<2>) -> Tensor<2> {
        self.enc.forward(x)
    }

    /// Verifier layer `layer`'s decoder, `rank → verifier_kv_dim`.
    ///
    /// # Panics
    /// When no decoder predicts `layer`.
    pub fn decoder(&self, layer: usize) -> Affine {
        self.dec
            .iter()
            .find_map(|d| {
                d.layers
                    .iter()
                    .position(|&l| l == layer)
                    .map(|i| d.member(i))
            })
            .unwrap_or_else(|| panic!("f_θ has no decoder for verifier layer {layer}"))
    }

    /// Verifier layer `layer`'s raw vectors from codes.
    ///
    /// # Shapes
    /// - `z`: `[n, rank]` → `[n, verifier_kv_dim]`
    pub fn decode(&self, z: Tensor<2>, layer: usize) -> Tensor<2> {
        self.decoder(layer).forward(z)
    }
}

/// f_θ: K path and V path.
#[derive(Debug, Clone)]
pub struct FTheta {
    /// Shape and owners.
    pub config: FThetaConfig,
    /// Drafter K → verifier raw K.
    pub k: FThetaPath,
    /// Drafter V → verifier raw V.
    pub v: FThetaPath,
}

impl FTheta {
    /// Builds f_θ from tensors named as in [`FThetaConfig::stacked_tensors`] (2-D weights,
    /// biases `[1, out]`); `get` hands each name's tensor out.
    pub fn from_stacked(
        config: FThetaConfig,
        get: &mut dyn FnMut(&str) -> Option<Tensor<2>>,
    ) -> Result<Self> {
        let mut take = |n: String| {
            get(&n).ok_or_else(|| ModelError::Input(format!("f_θ tensor {n} is missing")))
        };
        let bias = config.bias;
        let mut affine = |stem: String| -> Result<Affine> {
            Ok(Affine {
                weight: take(format!("{stem}.weight"))?,
                bias: if bias {
                    Some(take(format!("{stem}.bias"))?)
                } else {
                    None
                },
            })
        };
        let groups = config.width_groups();
        let mut path = |p: &str| -> Result<FThetaPath> {
            let enc = affine(format!("{p}_enc"))?;
            let dec = groups
                .iter()
                .map(|(w, layers)| {
                    Ok(DecoderGroup {
                        width: *w,
                        layers: layers.clone(),
                        stacked: affine(format!("{p}_dec.w{w}"))?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(FThetaPath { enc, dec })
        };
        let k = path("k")?;
        let v = path("v")?;
        Ok(Self { config, k, v })
    }

    /// Puts a checkpoint on `device` (each width group's decoders stacked into one tensor).
    pub fn from_checkpoint(ck: &FThetaCheckpoint, device: &Device) -> Result<Self> {
        let mut layered = ck.tensors.clone();
        let stacked = ck
            .config
            .stack(&mut layered)
            .map_err(|m| ModelError::Input(format!("f_θ checkpoint: {m}")))?;
        Self::from_stacked(ck.config.clone(), &mut |n| {
            stacked.get(n).map(|t| {
                let dims = match t.shape[..] {
                    [r, c] => [r, c],
                    _ => [1, t.data.len()],
                };
                Tensor::from_data(TensorData::new(t.data.clone(), dims), device)
            })
        })
    }

    /// The two paths' inputs from the drafter's K and V (`[n, drafter_layers · kv]` each):
    /// the K path reads K and the V path V, or both read `[K ; V]`.
    pub fn inputs(&self, drafter_k: Tensor<2>, drafter_v: Tensor<2>) -> (Tensor<2>, Tensor<2>) {
        match self.config.inputs {
            FThetaInputs::Own => (drafter_k, drafter_v),
            FThetaInputs::Both => {
                let x = Tensor::cat(vec![drafter_k, drafter_v], 1);
                (x.clone(), x)
            }
        }
    }

    /// Verifier layer `layer`'s raw K and V at the positions whose drafter K/V are given.
    ///
    /// # Shapes
    /// - `drafter_k`, `drafter_v`: `[n, drafter_layers · drafter_kv_dim]`
    /// - returns `([n, verifier_kv_dim], [n, verifier_kv_dim])`
    pub fn forward(
        &self,
        drafter_k: Tensor<2>,
        drafter_v: Tensor<2>,
        layer: usize,
    ) -> (Tensor<2>, Tensor<2>) {
        let (xk, xv) = self.inputs(drafter_k, drafter_v);
        (
            self.k.decode(self.k.encode(xk), layer),
            self.v.decode(self.v.encode(xv), layer),
        )
    }
}
