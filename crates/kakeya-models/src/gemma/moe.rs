//! Gemma 4's mixture-of-experts branch (26B-A4B): beside the dense MLP of every layer, a
//! router picks `top_k` of `E` expert MLPs per token from the residual stream, and the two
//! outputs are normed and summed (`docs/gemma4.md` §5.2).

use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::activation::gelu_tanh;
use crate::linear::Linear;
use crate::norm::RmsNorm;

/// One expert MLP: `down(gelu(gate(x)) · up(x))`.
#[derive(Debug, Clone)]
pub struct Expert {
    /// `[2 · inner, hidden]`: the gate rows, then the up rows.
    pub gate_up: Linear,
    /// `[hidden, inner]`.
    pub down: Linear,
}

/// The router and the experts of one layer.
#[derive(Debug, Clone)]
pub struct Moe {
    /// Router projection, `[E, hidden]` (host: the routing runs per token on the host).
    pub router: Vec<f32>,
    /// Router input multiplier, `[hidden]`.
    pub router_scale: Vec<f32>,
    /// Multiplier of each expert's routing weight, `[E]`.
    pub per_expert_scale: Vec<f32>,
    /// The experts.
    pub experts: Vec<Expert>,
    /// Experts per token.
    pub top_k: usize,
    /// Norm of the experts' input.
    pub pre_norm: RmsNorm,
    /// Norm of the dense MLP's output.
    pub post_norm_dense: RmsNorm,
    /// Norm of the experts' output.
    pub post_norm_experts: RmsNorm,
}

impl Moe {
    /// Each token's experts and their weights: softmax of the router's logits over the
    /// weightless-normed, scaled residual, the `top_k` largest renormalised to sum 1, times
    /// the experts' scales.
    fn route(&self, h: &[f32], hidden: usize, eps: f64) -> Vec<Vec<(usize, f32)>> {
        let e = self.per_expert_scale.len();
        h.chunks_exact(hidden)
            .map(|row| {
                let ms = row.iter().map(|v| v * v).sum::<f32>() / hidden as f32;
                let inv = (ms + eps as f32).powf(-0.5);
                let s = (hidden as f32).powf(-0.5);
                let z: Vec<f32> = row
                    .iter()
                    .zip(&self.router_scale)
                    .map(|(v, sc)| v * inv * sc * s)
                    .collect();
                let logits: Vec<f32> = (0..e)
                    .map(|j| {
                        let w = &self.router[j * hidden..(j + 1) * hidden];
                        w.iter().zip(&z).map(|(a, b)| a * b).sum()
                    })
                    .collect();
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exp: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
                let total: f32 = exp.iter().sum();
                let mut order: Vec<usize> = (0..e).collect();
                // Largest probability first; the lower index first on ties.
                order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]).then(a.cmp(&b)));
                let top = &order[..self.top_k];
                let picked: f32 = top.iter().map(|&j| exp[j] / total).sum();
                top.iter()
                    .map(|&j| (j, exp[j] / total / picked * self.per_expert_scale[j]))
                    .collect()
            })
            .collect()
    }

    /// The branch's sum `post_norm_dense(dense) + post_norm_experts(experts(pre_norm(h)))`,
    /// before the layer's post-feed-forward norm.
    ///
    /// # Shapes
    /// - `h`: `[R, hidden]` (the residual stream before the feed-forward norms); `dense`:
    ///   `[R, hidden]` (the dense MLP's output) → `[R, hidden]`
    pub fn forward(&self, h: Tensor<2>, dense: Tensor<2>) -> Tensor<2> {
        let [rows, hidden] = h.dims();
        let device: Device = h.device();
        let x = self.pre_norm.forward(h.clone());
        let host = h
            .into_data()
            .try_into_vec::<f32>()
            .expect("f32 activations");
        // The router's weightless norm has the model's epsilon, as every norm here.
        let routes = self.route(&host, hidden, self.pre_norm.eps);
        let mut out = vec![0.0f32; rows * hidden];
        for (j, expert) in self.experts.iter().enumerate() {
            let picks: Vec<(usize, f32)> = routes
                .iter()
                .enumerate()
                .filter_map(|(r, ks)| ks.iter().find(|(e, _)| *e == j).map(|&(_, w)| (r, w)))
                .collect();
            if picks.is_empty() {
                continue;
            }
            let ids: Vec<i64> = picks.iter().map(|&(r, _)| r as i64).collect();
            let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [picks.len()]), &device);
            let xs = x.clone().select(0, ids);
            let gu = expert.gate_up.forward(xs);
            let inner = gu.dims()[1] / 2;
            let n = picks.len();
            let act =
                gelu_tanh(gu.clone().slice([0..n, 0..inner])) * gu.slice([0..n, inner..2 * inner]);
            let y = expert.down.forward(act);
            let y = y
                .into_data()
                .try_into_vec::<f32>()
                .expect("f32 activations");
            for ((r, w), row) in picks.iter().zip(y.chunks_exact(hidden)) {
                for (o, v) in out[r * hidden..(r + 1) * hidden].iter_mut().zip(row) {
                    *o += w * v;
                }
            }
        }
        let experts = Tensor::<2>::from_data(TensorData::new(out, [rows, hidden]), &device);
        self.post_norm_dense.forward(dense) + self.post_norm_experts.forward(experts)
    }
}
