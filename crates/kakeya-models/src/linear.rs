//! A linear map `x · Wᵀ` that can also run straight from GGUF blocks on the CPU.

use std::sync::Arc;

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_kernels::{DenseMatrix, QuantMatrix};

/// On the CPU, quantised weights take the block kernel at any row count, and their certified
/// argmax (the greedy choice of decode steps and verify blocks) searches this many rows at a
/// time; inputs of at most this many rows of non-quantised weights take the row-order
/// kernel, longer ones the dense f32 matmul.
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
    /// The same weight for the row-order kernel, when not quantised and on the CPU (the
    /// verifier's f32/bf16 weights): inputs of up to [`QUANT_MAX_ROWS`] rows then give each
    /// row the same bits however many run together, as the block kernel does.
    pub rows: Option<Arc<DenseMatrix>>,
    /// Which products the quantised weight takes ([`Kernel`]).
    pub kernel: Kernel,
    /// Where the weight is larger than the GPU's largest buffer
    /// ([`crate::gpu::max_buffer_bytes`]: 128 MiB on Mesa's lavapipe, against the 270M
    /// model's 640 MiB tied embedding), its rows in blocks on that device, in order, each
    /// within the limit; `weight` then stays on the host (the CPU device) for what reads it
    /// whole (training, the reduced draft head's rows). Empty: `weight` is on its device.
    pub blocks: Vec<Tensor<2>>,
}

/// How a linear map with quantised weights multiplies on the CPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Kernel {
    /// The exact f32 products (the weights rebuilt bit for bit) through the block kernel, at
    /// any number of input rows, each row's result independent of the count. Greedy choices
    /// are the f32 model's.
    #[default]
    Exact,
    /// Every input row rounded to int8 per weight group, integer dot products
    /// ([`QuantMatrix::matmul_int8`]), for any number of rows. Faster where several rows run
    /// together; each output moves by ≈ 1 % of its scale, so greedy choices can differ from
    /// the f32 model's at near-ties. Still batch-invariant (lossless speculation holds).
    Int8,
}

impl Linear {
    /// A dense-only linear map.
    pub fn dense(weight: Tensor<2>) -> Self {
        Self {
            weight,
            quant: None,
            rows: None,
            kernel: Kernel::Exact,
            blocks: Vec::new(),
        }
    }

    /// A dense weight `[out, in]` from host values, with the row-order kernel's copy (bf16
    /// when every value is one) when it lives on the CPU; on a GPU held in row blocks when it
    /// is larger than one buffer there ([`Self::within`]).
    pub fn host(values: Vec<f32>, shape: [usize; 2], device: &Device) -> Self {
        if let Some(max) = crate::gpu::max_buffer_bytes(device)
            && (values.len() * 4) as u64 > max
        {
            return Self::blocked(values, shape, device, max);
        }
        let rows = row_copy(&values, shape, device);
        Self {
            rows,
            ..Self::dense(Tensor::from_data(TensorData::new(values, shape), device))
        }
    }

    /// This map held in row blocks of at most `max_bytes` each on its GPU, its whole weight
    /// moved to the host, when the weight is larger than that; unchanged otherwise (and on the
    /// CPU). The products and the embedding lookups give the same values either way
    /// ([`Self::forward`], [`crate::gpu::StepInputs::embed`]).
    pub fn within(self, max_bytes: u64) -> Self {
        let device = self.device();
        let shape = self.weight.dims();
        if !self.blocks.is_empty()
            || !crate::gpu::is_gpu(&device)
            || (shape[0] * shape[1] * 4) as u64 <= max_bytes
        {
            return self;
        }
        Self::blocked(host_rows(self.weight), shape, &device, max_bytes)
    }

    /// `values` `[out, in]` in even row blocks of at most `max_bytes` on `device`, the whole
    /// weight on the host.
    fn blocked(values: Vec<f32>, [out, cols]: [usize; 2], device: &Device, max_bytes: u64) -> Self {
        let fit = usize::try_from(max_bytes / (cols as u64 * 4))
            .unwrap_or(usize::MAX)
            .max(1);
        let per = out.div_ceil(out.div_ceil(fit));
        let blocks = values
            .chunks(per * cols)
            .map(|b| Tensor::from_data(TensorData::new(b.to_vec(), [b.len() / cols, cols]), device))
            .collect();
        tracing::debug!(
            rows = out,
            cols,
            blocks = out.div_ceil(per),
            max_bytes,
            "weight held in row blocks: larger than one buffer on the device"
        );
        Self {
            blocks,
            ..Self::dense(Tensor::from_data(
                TensorData::new(values, [out, cols]),
                &Device::flex(),
            ))
        }
    }

    /// The device the products run on (the blocks' where the weight is held in blocks).
    pub fn device(&self) -> Device {
        self.blocks
            .first()
            .map_or_else(|| self.weight.device(), Tensor::device)
    }

    /// This map's dense weight on `device` as [`Self::host`] places it there (in row blocks
    /// where it is larger than one buffer there); unchanged where it runs there already. Any
    /// GGUF blocks stay behind: the copy is dense.
    pub fn to_device(self, device: &Device) -> Self {
        if self.device() == *device {
            return self;
        }
        let shape = self.weight.dims();
        Self::host(host_rows(self.weight), shape, device)
    }

    /// This map with the row-order kernel's copy of its dense weight when it lives on the CPU
    /// ([`Self::host`]): inputs of up to [`QUANT_MAX_ROWS`] rows then skip the dense matmul,
    /// whose per-call packing of the weight dominates a few-row product. Unchanged when it
    /// has GGUF blocks or a copy already, or lives on another device.
    pub fn with_host_rows(self) -> Self {
        let device = self.weight.device();
        if self.quant.is_some()
            || self.rows.is_some()
            || !self.blocks.is_empty()
            || device != Device::flex()
        {
            return self;
        }
        let values = host_rows(self.weight.clone());
        Self {
            rows: row_copy(&values, self.weight.dims(), &device),
            ..self
        }
    }

    /// Bytes held: the dense weight (f32), its row blocks on a GPU, and every kernel copy
    /// (GGUF blocks with their norms and panels, the row-order copy).
    pub fn nbytes(&self) -> usize {
        self.weight.shape().num_elements() * 4
            + self
                .blocks
                .iter()
                .map(|b| b.shape().num_elements() * 4)
                .sum::<usize>()
            + self.quant.as_deref().map_or(0, QuantMatrix::nbytes)
            + self.rows.as_deref().map_or(0, DenseMatrix::nbytes)
    }

    /// # Shapes
    /// - `x`: `[T, in]` → `[T, out]`
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let t = x.dims()[0];
        if !self.blocks.is_empty() {
            return self.forward_blocks(x);
        }
        if let (Some(q), Kernel::Int8) = (self.quant.as_deref(), self.kernel) {
            let device = x.device();
            let y = q.matmul_int8(&host_rows(x), t);
            return Tensor::from_data(TensorData::new(y, [t, q.rows()]), &device);
        }
        if let Some(q) = self.quant.as_deref() {
            // Prefill too: a short prompt's rows cost the dense matmul a copy of every weight,
            // and a long one's run as fast either way.
            let device = x.device();
            let y = q.matmul(&host_rows(x), t);
            return Tensor::from_data(TensorData::new(y, [t, q.rows()]), &device);
        }
        if let Some(d) = self.rows.as_deref().filter(|_| t <= QUANT_MAX_ROWS) {
            let device = x.device();
            let y = d.matmul(&host_rows(x), t);
            return Tensor::from_data(TensorData::new(y, [t, d.rows()]), &device);
        }
        if let Some(y) = crate::gpu::linear_rows(&x, &[&self.weight]) {
            return y;
        }
        crate::gpu::matmul(x, self.weight.clone().transpose())
    }

    /// [`Self::forward`] over the row blocks: each block's outputs side by side, a few rows
    /// taking one launch for up to three blocks.
    ///
    /// # Shapes
    /// - `x`: `[T, in]` → `[T, out]`
    fn forward_blocks(&self, x: Tensor<2>) -> Tensor<2> {
        let parts = self
            .blocks
            .chunks(3)
            .flat_map(|group| {
                let group: Vec<&Tensor<2>> = group.iter().collect();
                match crate::gpu::linear_rows(&x, &group) {
                    Some(y) => vec![y],
                    None => group
                        .into_iter()
                        .map(|b| crate::gpu::matmul(x.clone(), b.clone().transpose()))
                        .collect(),
                }
            })
            .collect();
        Tensor::cat(parts, 1)
    }

    /// [`Self::forward`] of each of `maps` (1 to 3) on the same input: on a GPU, a few rows take
    /// one launch for all of them ([`crate::gpu::linear_rows`]).
    ///
    /// # Shapes
    /// - `x`: `[T, in]` → per map `[T, out_i]`
    pub fn forward_many(maps: &[&Self], x: Tensor<2>) -> Vec<Tensor<2>> {
        if let Some(qs) = exact_quants(maps) {
            // On the CPU: one host copy of the input, one parallel loop for all the maps.
            let (t, device) = (x.dims()[0], x.device());
            return QuantMatrix::matmul_many(&qs, &host_rows(x), t)
                .into_iter()
                .zip(&qs)
                .map(|(y, q)| Tensor::from_data(TensorData::new(y, [t, q.rows()]), &device))
                .collect();
        }
        let weights: Vec<&Tensor<2>> = maps.iter().map(|m| &m.weight).collect();
        let whole = maps.iter().all(|m| m.blocks.is_empty());
        let Some(y) = whole
            .then(|| crate::gpu::linear_rows(&x, &weights))
            .flatten()
        else {
            return maps.iter().map(|m| m.forward(x.clone())).collect();
        };
        let t = x.dims()[0];
        let mut at = 0;
        weights
            .iter()
            .map(|w| {
                let n = w.dims()[0];
                at += n;
                y.clone().slice([0..t, at - n..at])
            })
            .collect()
    }

    /// Gemma's gated MLP, `down(gelu_tanh(gate(x)) · up(x))`. On a GPU, gate and up take
    /// one launch and the gated GELU one kernel; on the CPU with quantised weights, gate and up
    /// take one parallel loop and the gated GELU runs over the host rows
    /// ([`kakeya_kernels::activation::gelu_tanh_mul`]), with no tensor between the three products.
    ///
    /// # Shapes
    /// - `x`: `[T, in]` → `[T, down's out]`
    pub fn gelu_mlp(gate: &Self, up: &Self, down: &Self, x: Tensor<2>) -> Tensor<2> {
        if Self::gelu_mlp_on_host(gate, up, down) {
            let (t, device) = (x.dims()[0], x.device());
            let y = Self::gelu_mlp_host(gate, up, down, &host_rows(x), t);
            return Tensor::from_data(TensorData::new(y, [t, down.weight.dims()[0]]), &device);
        }
        let gu = (gate.blocks.is_empty() && up.blocks.is_empty())
            .then(|| crate::gpu::linear_rows(&x, &[&gate.weight, &up.weight]))
            .flatten();
        let m = match gu.and_then(|gu| crate::gpu::gelu_mul_halves(&gu)) {
            Some(m) => m,
            None => crate::activation::gelu_tanh(gate.forward(x.clone())) * up.forward(x),
        };
        down.forward(m)
    }

    /// Whether [`Self::gelu_mlp_host`] takes these maps (all three quantised, on the CPU).
    pub fn gelu_mlp_on_host(gate: &Self, up: &Self, down: &Self) -> bool {
        exact_quants(&[gate, up, down]).is_some()
    }

    /// [`Self::gelu_mlp`] over host rows when [`Self::gelu_mlp_on_host`].
    ///
    /// # Shapes
    /// - `x`: `[t, in]` row-major → `[t, down's out]` row-major
    pub fn gelu_mlp_host(gate: &Self, up: &Self, down: &Self, x: &[f32], t: usize) -> Vec<f32> {
        let q = exact_quants(&[gate, up, down]).expect("gelu_mlp_host: quantised maps");
        let mut gu = QuantMatrix::matmul_many(&q[..2], x, t).into_iter();
        let (mut g, u) = (gu.next().expect("gate's"), gu.next().expect("up's"));
        kakeya_kernels::activation::gelu_tanh_mul(&mut g, &u);
        q[2].matmul(&g, t)
    }

    /// Per input row, the index of its largest output (first on ties) — exactly the argmax
    /// of [`Self::forward`]'s rows — when the block kernel takes this input and the certified
    /// search applies and pays at this row count ([`QuantMatrix::argmax_pays`]); `None`
    /// otherwise (compute the outputs).
    ///
    /// # Shapes
    /// - `x`: `[T, in]` → `T` ids
    pub fn argmax(&self, x: &Tensor<2>) -> Option<Vec<u32>> {
        let [t, cols] = x.dims();
        let q = self.quant.as_deref()?;
        if !q.argmax_pays(t) {
            return None;
        }
        // More rows than one search takes (a batch of several sequences' blocks): searches of
        // at most `QUANT_MAX_ROWS` rows each, split evenly (so none has fewer than eight).
        // Each row's answer is exact, so the split changes nothing.
        let xs = host_rows(x.clone());
        let per = t.div_ceil(t.div_ceil(QUANT_MAX_ROWS));
        let mut ids = Vec::with_capacity(t);
        for rows in xs.chunks(per * cols) {
            ids.extend(q.argmax(rows, rows.len() / cols)?.ids);
        }
        Some(ids)
    }
}

/// The block kernel's matrices of `maps` when every one takes the exact block kernel (their
/// weights quantised, on the CPU), else `None`.
fn exact_quants<'a>(maps: &[&'a Linear]) -> Option<Vec<&'a QuantMatrix>> {
    maps.iter()
        .map(|m| m.quant.as_deref().filter(|_| m.kernel == Kernel::Exact))
        .collect()
}

/// The row-order kernel's copy of `values` (`[out, in]`) when they live on the CPU.
fn row_copy(values: &[f32], [r, c]: [usize; 2], device: &Device) -> Option<Arc<DenseMatrix>> {
    (*device == Device::flex()).then(|| Arc::new(DenseMatrix::new(r, c, values)))
}

/// The activations on the host, row-major.
pub(crate) fn host_rows(x: Tensor<2>) -> Vec<f32> {
    x.into_data()
        .try_into_vec::<f32>()
        .expect("activations are f32")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The certified argmax of more rows than one search takes equals the argmax of the exact
    /// products, row by row, however the rows are split.
    #[test]
    fn argmax_of_any_row_count_is_the_products_argmax() {
        let (vocab, hidden) = (300, 64);
        let dev = Device::flex();
        let head = crate::testing::random_q8_0_linear(vocab, hidden, 0.5, 11);
        for t in [2, 16, 17, 33, 40] {
            let x: Vec<f32> = (0..t * hidden)
                .map(|i| ((i * 37 + 11 * t) % 41) as f32 * 0.05 - 1.0)
                .collect();
            let x = Tensor::<2>::from_data(TensorData::new(x, [t, hidden]), &dev);
            let logits = host_rows(head.forward(x.clone()));
            let want: Vec<u32> = logits
                .chunks(vocab)
                .map(|r| {
                    let best = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    r.iter().position(|&v| v == best).unwrap() as u32
                })
                .collect();
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                assert_eq!(head.argmax(&x).as_deref(), Some(&want[..]), "{t} rows");
            }
            if let Some(ids) = head.argmax(&x) {
                assert_eq!(ids, want, "{t} rows");
            }
        }
    }
}
