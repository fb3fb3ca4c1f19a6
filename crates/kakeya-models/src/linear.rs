//! A linear map `x · Wᵀ` that can also run straight from GGUF blocks on the CPU.

use std::sync::Arc;

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_kernels::{DenseMatrix, QuantMatrix};

/// On the CPU, quantised weights take the block kernel at any row count, and their certified
/// argmax (the greedy choice of decode steps and verify blocks) searches this many rows at a
/// time; inputs of at most this many rows of non-quantised weights take the row-order
/// kernel, longer ones the dense f32 matmul.
pub const QUANT_MAX_ROWS: usize = 16;

/// A weight `[out, in]` (PyTorch layout) applied as `x · Wᵀ`, in the one form chosen for its
/// device and kernel when it is loaded (or moved): that form alone decides how
/// [`Self::forward`] multiplies.
#[derive(Debug, Clone)]
pub enum Linear {
    /// A tensor on its device: a GPU's few-row kernel ([`crate::gpu::linear_rows`]) or the
    /// device's matmul. Training (autodiff) and weights not prepared for a CPU kernel.
    Dense(Tensor<2>),
    /// On the CPU, a weight that was not quantised in the checkpoint (f32/bf16): inputs of up
    /// to [`QUANT_MAX_ROWS`] rows take the row-order kernel's copy `rows` (each row the same
    /// bits however many run together, as the block kernel gives), longer ones the dense
    /// matmul of `tensor`.
    HostRows {
        /// The weight, `[out, in]`.
        tensor: Tensor<2>,
        /// The same values for the row-order kernel (bf16 when every value is one).
        rows: Arc<DenseMatrix>,
    },
    /// On the CPU, the weight's GGUF blocks repacked for the block kernel, at any row count.
    /// No dense copy is held: [`Self::dense_values`] rebuilds it bit for bit when asked.
    Quant {
        /// The blocks.
        matrix: Arc<QuantMatrix>,
        /// Which products they take.
        kernel: Kernel,
    },
    /// On a GPU, a weight larger than the device's largest buffer
    /// ([`crate::gpu::max_buffer_bytes`]: 128 MiB on Mesa's lavapipe, against the 270M
    /// model's 640 MiB tied embedding): its rows in blocks on that device, in order, each
    /// within the limit, and the whole weight on the host (the CPU device) for what reads it
    /// whole (training, the reduced draft head's rows).
    RowBlocks {
        /// The row blocks, each `[rows_b, in]`, `Σ rows_b = out`.
        blocks: Vec<Tensor<2>>,
        /// The whole weight `[out, in]` on the host.
        host: Tensor<2>,
    },
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
    /// GGUF blocks for the block kernel (exact products).
    pub fn quant(matrix: QuantMatrix) -> Self {
        Self::Quant {
            matrix: Arc::new(matrix),
            kernel: Kernel::Exact,
        }
    }

    /// A weight `[out, in]` from host values in the form its device takes: on the CPU with
    /// the row-order kernel's copy ([`Self::HostRows`]); on a GPU whole, or in row blocks
    /// where it is larger than one buffer there ([`Self::RowBlocks`]).
    pub fn host(values: Vec<f32>, shape: [usize; 2], device: &Device) -> Self {
        if let Some(max) = crate::gpu::max_buffer_bytes(device)
            && (values.len() * 4) as u64 > max
        {
            return Self::blocked(values, shape, device, max);
        }
        let [r, c] = shape;
        if *device == Device::flex() {
            let rows = Arc::new(DenseMatrix::new(r, c, &values));
            return Self::HostRows {
                tensor: Tensor::from_data(TensorData::new(values, shape), device),
                rows,
            };
        }
        Self::Dense(Tensor::from_data(TensorData::new(values, shape), device))
    }

    /// This map in row blocks of at most `max_bytes` each on its GPU, its whole weight moved
    /// to the host, when the weight is larger than that; unchanged otherwise (and on the CPU).
    /// The products and the embedding lookups give the same values either way
    /// ([`Self::forward`], [`crate::gpu::StepInputs::embed`]).
    pub fn within(self, max_bytes: u64) -> Self {
        match self {
            Self::Dense(w)
                if crate::gpu::is_gpu(&w.device())
                    && (w.shape().num_elements() * 4) as u64 > max_bytes =>
            {
                let (shape, device) = (w.dims(), w.device());
                Self::blocked(host_rows(w), shape, &device, max_bytes)
            }
            other => other,
        }
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
        Self::RowBlocks {
            blocks,
            host: Tensor::from_data(TensorData::new(values, [out, cols]), &Device::flex()),
        }
    }

    /// `[out, in]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            Self::Dense(w) | Self::HostRows { tensor: w, .. } | Self::RowBlocks { host: w, .. } => {
                w.dims()
            }
            Self::Quant { matrix, .. } => [matrix.rows(), matrix.cols()],
        }
    }

    /// The device the products run on (the blocks' where the weight is held in blocks).
    pub fn device(&self) -> Device {
        match self {
            Self::Dense(w) | Self::HostRows { tensor: w, .. } => w.device(),
            Self::Quant { .. } => Device::flex(),
            Self::RowBlocks { blocks, host } => blocks.first().unwrap_or(host).device(),
        }
    }

    /// The GGUF blocks, when the block kernel takes this map.
    pub fn quant_matrix(&self) -> Option<&Arc<QuantMatrix>> {
        match self {
            Self::Quant { matrix, .. } => Some(matrix),
            _ => None,
        }
    }

    /// The row blocks on a GPU ([`Self::RowBlocks`]); empty when the weight is held whole.
    pub fn row_blocks(&self) -> &[Tensor<2>] {
        match self {
            Self::RowBlocks { blocks, .. } => blocks,
            _ => &[],
        }
    }

    /// The whole weight `[out, in]` as a tensor: the one held (on the host where it is held
    /// in row blocks), or, for GGUF blocks, their values rebuilt bit for bit on the CPU (a
    /// copy: for training and fitting, not for the products).
    pub fn dense_weight(&self) -> Tensor<2> {
        match self {
            Self::Dense(w) | Self::HostRows { tensor: w, .. } | Self::RowBlocks { host: w, .. } => {
                w.clone()
            }
            Self::Quant { matrix, .. } => Tensor::from_data(
                TensorData::new(matrix.to_dense(), [matrix.rows(), matrix.cols()]),
                &Device::flex(),
            ),
        }
    }

    /// This map's weight on `device` as [`Self::host`] places it there; unchanged where it
    /// runs there already. GGUF blocks stay behind: the copy is dense.
    pub fn to_device(self, device: &Device) -> Self {
        if self.device() == *device {
            return self;
        }
        let shape = self.dims();
        Self::host(host_rows(self.dense_weight()), shape, device)
    }

    /// This map with the row-order kernel's copy when it is a dense weight on the CPU
    /// ([`Self::HostRows`]): inputs of up to [`QUANT_MAX_ROWS`] rows then skip the dense
    /// matmul, whose per-call packing of the weight dominates a few-row product. Any other
    /// form is unchanged.
    pub fn with_host_rows(self) -> Self {
        match self {
            Self::Dense(w) if w.device() == Device::flex() => {
                let shape = w.dims();
                Self::host(host_rows(w), shape, &Device::flex())
            }
            other => other,
        }
    }

    /// Bytes held: the weight in its form (f32 tensors, GGUF blocks with their norms and
    /// panels, the row-order copy beside its tensor, the row blocks beside the host copy).
    pub fn nbytes(&self) -> usize {
        let f32s = |w: &Tensor<2>| w.shape().num_elements() * 4;
        match self {
            Self::Dense(w) => f32s(w),
            Self::HostRows { tensor, rows } => f32s(tensor) + rows.nbytes(),
            Self::Quant { matrix, .. } => matrix.nbytes(),
            Self::RowBlocks { blocks, host } => f32s(host) + blocks.iter().map(f32s).sum::<usize>(),
        }
    }

    /// # Shapes
    /// - `x`: `[T, in]` → `[T, out]`
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let t = x.dims()[0];
        let on_host = |y: Vec<f32>, out: usize, x: &Tensor<2>| {
            Tensor::from_data(TensorData::new(y, [t, out]), &x.device())
        };
        match self {
            Self::RowBlocks { blocks, .. } => forward_blocks(blocks, x),
            // Prefill too: a short prompt's rows cost the dense matmul a copy of every weight,
            // and a long one's run as fast either way.
            Self::Quant { matrix, kernel } => {
                let y = match kernel {
                    Kernel::Exact => matrix.matmul(&host_rows(x.clone()), t),
                    Kernel::Int8 => matrix.matmul_int8(&host_rows(x.clone()), t),
                };
                on_host(y, matrix.rows(), &x)
            }
            Self::HostRows { rows, .. } if t <= QUANT_MAX_ROWS => {
                on_host(rows.matmul(&host_rows(x.clone()), t), rows.rows(), &x)
            }
            Self::HostRows { tensor: w, .. } => crate::gpu::matmul(x, w.clone().transpose()),
            Self::Dense(w) => crate::gpu::linear_rows(&x, &[w])
                .unwrap_or_else(|| crate::gpu::matmul(x, w.clone().transpose())),
        }
    }

    /// [`Self::forward`] of each of `maps` (1 to 3) on the same input: on the CPU with GGUF
    /// blocks, one host copy of the input and one parallel loop for all of them; on a GPU, a
    /// few rows take one launch for all of them ([`crate::gpu::linear_rows`]).
    ///
    /// # Shapes
    /// - `x`: `[T, in]` → per map `[T, out_i]`
    pub fn forward_many(maps: &[&Self], x: Tensor<2>) -> Vec<Tensor<2>> {
        let (t, device) = (x.dims()[0], x.device());
        if let Some(qs) = exact_quants(maps) {
            return QuantMatrix::matmul_many(&qs, &host_rows(x), t)
                .into_iter()
                .zip(&qs)
                .map(|(y, q)| Tensor::from_data(TensorData::new(y, [t, q.rows()]), &device))
                .collect();
        }
        let Some(y) = dense_tensors(maps).and_then(|w| crate::gpu::linear_rows(&x, &w)) else {
            return maps.iter().map(|m| m.forward(x.clone())).collect();
        };
        let mut at = 0;
        maps.iter()
            .map(|m| {
                let n = m.dims()[0];
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
            return Tensor::from_data(TensorData::new(y, [t, down.dims()[0]]), &device);
        }
        let gu = dense_tensors(&[gate, up]).and_then(|w| crate::gpu::linear_rows(&x, &w));
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
        let q = self.quant_matrix()?;
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

/// [`Linear::forward`] over row blocks: each block's outputs side by side, a few rows taking
/// one launch for up to three blocks.
///
/// # Shapes
/// - `x`: `[T, in]`, blocks `[rows_b, in]` → `[T, Σ rows_b]`
fn forward_blocks(blocks: &[Tensor<2>], x: Tensor<2>) -> Tensor<2> {
    let parts = blocks
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

/// The tensors of `maps` when every one is held whole as a plain tensor ([`Linear::Dense`]).
fn dense_tensors<'a>(maps: &[&'a Linear]) -> Option<Vec<&'a Tensor<2>>> {
    maps.iter()
        .map(|m| match m {
            Linear::Dense(w) => Some(w),
            _ => None,
        })
        .collect()
}

/// The block kernel's matrices of `maps` when every one takes the exact block kernel (their
/// weights quantised, on the CPU), else `None`.
fn exact_quants<'a>(maps: &[&'a Linear]) -> Option<Vec<&'a QuantMatrix>> {
    maps.iter()
        .map(|m| match m {
            Linear::Quant {
                matrix,
                kernel: Kernel::Exact,
            } => Some(&**matrix),
            _ => None,
        })
        .collect()
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
