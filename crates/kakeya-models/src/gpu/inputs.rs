//! A forward's token ids and positions in one device buffer ([`StepInputs`]), and what is
//! read from it there: the token embeddings, the RoPE rows, each chunk's first position (in
//! [`super::span_attention`]). One upload a forward instead of one for the ids and two for
//! each RoPE table; and a decode step recorded once ([`super::DeviceGraph`]) replays with
//! whatever ids and positions were copied into the buffer it read.

use burn::tensor::{Device, Tensor, TensorData};

#[cfg(feature = "cube")]
use super::DecodeKernels;
#[cfg(feature = "cube")]
use burn::backend::Dispatch;

/// The stacked rows' token ids, then their positions, as f32 (exact below 2²⁴), then any
/// extra values ([`StepInputs::upload_with`]).
///
/// # Shapes
/// - `buf`: `[2 · rows + extra]`
#[derive(Debug, Clone)]
pub struct StepInputs {
    /// `[ids…, positions…]`.
    pub buf: Tensor<1>,
    /// Stacked rows.
    pub rows: usize,
}

impl StepInputs {
    /// `tokens` and their `positions` in one upload to `device`.
    pub fn upload(tokens: &[u32], positions: &[usize], device: &Device) -> Self {
        Self::upload_with(tokens, positions, &[], device)
    }

    /// [`Self::upload`] with `extra` values after the positions (a sampled forward's
    /// uniforms: [`Self::extra`]).
    pub fn upload_with(
        tokens: &[u32],
        positions: &[usize],
        extra: &[f32],
        device: &Device,
    ) -> Self {
        assert_eq!(tokens.len(), positions.len(), "one position per token");
        let exact = 1usize << 24;
        assert!(
            tokens.iter().all(|&t| (t as usize) < exact) && positions.iter().all(|&p| p < exact),
            "token ids and positions must stay below 2^24 to travel as f32"
        );
        let data: Vec<f32> = tokens
            .iter()
            .map(|&t| t as f32)
            .chain(positions.iter().map(|&p| p as f32))
            .chain(extra.iter().copied())
            .collect();
        let rows = tokens.len();
        let n = data.len();
        Self {
            buf: Tensor::from_data(TensorData::new(data, [n]), device),
            rows,
        }
    }

    /// `n` of the values uploaded after the positions, from the `from`-th on (a view of the
    /// buffer: a recording reads what each replay copied in).
    ///
    /// # Shapes
    /// → `[n]`
    pub fn extra(&self, from: usize, n: usize) -> Tensor<1> {
        let at = 2 * self.rows + from;
        self.buf.clone().narrow(0, at, n)
    }

    /// The buffer and where the positions start in it (what [`super::span_attention`] reads).
    pub fn positions(&self) -> (&Tensor<1>, usize) {
        (&self.buf, self.rows)
    }

    /// The rows' embeddings times `scale` (`table[id] · scale`, as `select` then
    /// `mul_scalar`), from a table held whole (one block) or in row blocks, in order (where
    /// the device's largest buffer cannot hold it: [`super::max_buffer_bytes`]). Each block
    /// gives its own rows and zeros elsewhere; their sum is exact. `None` off a GPU.
    ///
    /// # Shapes
    /// - `blocks`: `[rows_b, hidden]` each, `Σ rows_b = vocab` → `[rows, hidden]`
    pub fn embed(&self, blocks: &[Tensor<2>], scale: f32) -> Option<Tensor<2>> {
        let mut first = 0;
        let mut sum: Option<Tensor<2>> = None;
        for block in blocks {
            let rows = gather_rows(block, &self.buf, 0, self.rows, scale, first)?;
            first += block.dims()[0];
            sum = Some(match sum {
                Some(s) => s + rows,
                None => rows,
            });
        }
        sum
    }

    /// The rows' RoPE `(cos, sin)` from a device table of both (see
    /// [`crate::rope::Rope::device_table`]). `None` off a GPU.
    ///
    /// # Shapes
    /// - `table`: `[2, positions, d/2]` → two `[rows, d/2]`
    pub fn rope(&self, table: &Tensor<3>) -> Option<(Tensor<2>, Tensor<2>)> {
        let both = gather_rows(table, &self.buf, self.rows, self.rows, 1.0, 0)?;
        let [_, t, half] = both.dims();
        let plane = |p: usize| {
            both.clone()
                .slice([p..p + 1, 0..t, 0..half])
                .reshape([t, half])
        };
        Some((plane(0), plane(1)))
    }
}

/// Rows of `table` (of each plane of a 3-d one) picked by `idx[offset..offset + t]` (f32),
/// times `scale`; the table holds the rows `first..` of a larger one, and an index outside
/// them gives zeros. `None` off a GPU.
///
/// # Shapes
/// - `table`: `[rows, w]` → `[t, w]`; `[planes, rows, w]` → `[planes, t, w]`
#[cfg_attr(not(feature = "cube"), allow(unused_variables))]
pub fn gather_rows<const D: usize>(
    table: &Tensor<D>,
    idx: &Tensor<1>,
    offset: usize,
    t: usize,
    scale: f32,
    first: usize,
) -> Option<Tensor<D>> {
    on_gpu!(super::applies(table), {
        Tensor::from_dispatch(<Dispatch as DecodeKernels>::gather_rows(
            table.clone().into_dispatch(),
            idx.clone().into_dispatch(),
            offset,
            t,
            scale,
            first,
        ))
    })
}
