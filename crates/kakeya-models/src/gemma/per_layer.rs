//! Gemma 4's per-layer inputs: a second token embedding, `P` values per layer, mixed with a
//! projection of the main embedding, and a gated branch in every layer that adds them to the
//! residual stream (`docs/gemma4.md` §2, §5).

use burn::tensor::Tensor;

use crate::activation::gelu_tanh;
use crate::linear::Linear;
use crate::norm::RmsNorm;

/// The model-level part: the per-layer embedding table and the projection of the main one.
#[derive(Debug, Clone)]
pub struct PerLayerEmbed {
    /// `[per_layer_vocab, layers · P]`; on the host where it is larger than one buffer on
    /// the model's device.
    pub embed: Tensor<2>,
    /// `[layers · P, hidden]`.
    pub proj: Linear,
    /// RMSNorm over each layer's `P` values.
    pub norm: RmsNorm,
    /// Layers.
    pub layers: usize,
    /// Values per layer, `P`.
    pub size: usize,
}

impl PerLayerEmbed {
    /// Every layer's inputs for `tokens`: `(norm(proj(x0) / √hidden) + embed(tokens) · √P) / √2`.
    ///
    /// # Shapes
    /// - `tokens`: `T` ids; `x0`: `[T, hidden]` (the scaled main embedding) → `[T, layers · P]`
    ///   (layer `i`'s inputs are columns `i·P..(i+1)·P`)
    pub fn inputs(&self, tokens: &[u32], x0: Tensor<2>) -> Tensor<2> {
        let (t, hidden) = (tokens.len(), x0.dims()[1]);
        let device = x0.device();
        // The table may be on the host (larger than one buffer on the device: `load.rs`).
        let tok =
            super::model::embedding_rows(&self.embed, tokens, (self.size as f32).sqrt(), &device);
        let proj = self.proj.forward(x0).mul_scalar((hidden as f32).powf(-0.5));
        let proj = self
            .norm
            .forward(proj.reshape([t, self.layers, self.size]))
            .reshape([t, self.layers * self.size]);
        (proj + tok).mul_scalar(std::f32::consts::FRAC_1_SQRT_2)
    }

    /// Layer `i`'s columns of [`Self::inputs`].
    ///
    /// # Shapes
    /// - `all`: `[T, layers · P]` → `[T, P]`
    pub fn of_layer(&self, all: &Tensor<2>, i: usize) -> Tensor<2> {
        let t = all.dims()[0];
        all.clone()
            .slice([0..t, i * self.size..(i + 1) * self.size])
    }
}

/// A layer's gated branch: `x + norm(proj(gelu(gate(x)) · input))`.
#[derive(Debug, Clone)]
pub struct PerLayerGate {
    /// `[P, hidden]`.
    pub gate: Linear,
    /// `[hidden, P]`.
    pub proj: Linear,
    /// RMSNorm over `hidden`.
    pub norm: RmsNorm,
}

impl PerLayerGate {
    /// # Shapes
    /// - `x`: `[R, hidden]`; `input`: `[R, P]` → `[R, hidden]`
    pub fn forward(&self, x: Tensor<2>, input: Tensor<2>) -> Tensor<2> {
        let g = gelu_tanh(self.gate.forward(x.clone())) * input;
        x + self.norm.forward(self.proj.forward(g))
    }
}
