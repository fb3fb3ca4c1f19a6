//! A linear map `x · Wᵀ` that can also run straight from GGUF blocks on the CPU.

use std::sync::Arc;

use burn::tensor::{Tensor, TensorData};
use kakeya_weights::QuantMatrix;

/// Inputs of at most this many rows (decode steps, small verify blocks) use the block kernel
/// when the model runs on the CPU; longer chunks (prefill) use the dense f32 matmul.
pub const QUANT_MAX_ROWS: usize = 16;

/// A weight `[out, in]` (PyTorch layout) applied as `x · Wᵀ`, with its GGUF blocks when the
/// checkpoint had them. Both hold the same values; the block kernel reads ~4× fewer bytes.
#[derive(Debug, Clone)]
pub struct Linear {
    /// Dense weight, `[out, in]`.
    pub weight: Tensor<2>,
    /// The same weight repacked from its GGML blocks, when quantised in the checkpoint and
    /// the weight lives on the CPU (the kernel reads host memory).
    pub quant: Option<Arc<QuantMatrix>>,
}

impl Linear {
    /// A dense-only linear map.
    pub fn dense(weight: Tensor<2>) -> Self {
        Self {
            weight,
            quant: None,
        }
    }

    /// # Shapes
    /// - `x`: `[T, in]` → `[T, out]`
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        if let Some(q) = &self.quant {
            let t = x.dims()[0];
            if t <= QUANT_MAX_ROWS {
                let device = x.device();
                let host = x
                    .into_data()
                    .try_into_vec::<f32>()
                    .expect("activations are f32");
                let y = q.matmul(&host, t);
                return Tensor::from_data(TensorData::new(y, [t, q.rows()]), &device);
            }
        }
        x.matmul(self.weight.clone().transpose())
    }
}
