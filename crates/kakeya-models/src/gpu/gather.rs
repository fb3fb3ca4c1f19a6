//! Rows of a table picked by indices held on the device ([`super::DecodeKernels::gather_rows`]):
//! the token embeddings and the RoPE rows of a forward's stacked inputs, read from the one
//! buffer of token ids and positions the forward uploads. A recorded decode step reads them
//! there too, so its replays pick up whatever ids and positions were written into that buffer.
//! And the other way ([`super::DecodeKernels::put_rows`]): rows written into a buffer from a
//! row index held on the device (the drafter's store rows, appended by a recorded step).

use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::kernels::{ELEMENT_UNITS, dense_output, f32_only, grid, sequence};

/// `out[p, i, e] = table[p, idx[offset + i] − first, e] · scale`, or 0 where that index is
/// not among the table's rows `first..first + held` (one block of a table held in row
/// blocks); one unit per output element; the table read through its strides (the tied
/// embedding may be a view of the head's weight: a dense copy of 262k rows would cost 640 MiB).
#[cube(launch)]
fn gather_rows_kernel(
    table: &[f32],
    idx: &[f32],
    out: &mut [f32],
    dims: Sequence<usize>,
    scale: f32,
) {
    // dims: planes, gathered rows, row width, first index read; the table's strides of a
    // plane, a row and an element; the index of its first row, its rows.
    let (planes, t, width) = (*dims.index(0), *dims.index(1), *dims.index(2));
    let offset = *dims.index(3);
    let (sp, sr, se) = (*dims.index(4), *dims.index(5), *dims.index(6));
    let (first, held) = (*dims.index(7), *dims.index(8));
    let i = CUBE_POS * CUBE_DIM as usize + UNIT_POS as usize;
    if i < planes * t * width {
        let e = i % width;
        let r = (i / width) % t;
        let p = i / (width * t);
        let row = usize::cast_from(u32::cast_from(idx[offset + r]));
        if row >= first && row < first + held {
            out[i] = table[p * sp + (row - first) * sr + e * se] * scale;
        } else {
            out[i] = 0.0;
        }
    }
}

/// See [`super::DecodeKernels::gather_rows`].
pub(super) fn gather_rows(
    table: CubeTensor,
    idx: CubeTensor,
    offset: usize,
    t: usize,
    scale: f32,
    first: usize,
) -> CubeTensor {
    f32_only(&table, "gather_rows");
    f32_only(&idx, "gather_rows");
    let idx = into_contiguous(idx);
    let dims = table.meta.shape().clone();
    let st = table.meta.strides();
    let (planes, held, width, strides) = match dims.num_dims() {
        2 => (1, dims[0], dims[1], [0, st[0], st[1]]),
        3 => (dims[0], dims[1], dims[2], [st[0], st[1], st[2]]),
        n => panic!("gather_rows: a table of 2 or 3 dimensions, not {n}"),
    };
    assert!(
        offset + t <= idx.meta.shape().num_elements(),
        "gather_rows: indices {offset}..{} past the {} held",
        offset + t,
        idx.meta.shape().num_elements()
    );
    let shape = match dims.num_dims() {
        2 => Shape::new([t, width]),
        _ => Shape::new([planes, t, width]),
    };
    let out = dense_output(&table, shape);
    let n = planes * t * width;
    if n > 0 {
        gather_rows_kernel::launch(
            &table.client.clone(),
            grid(n.div_ceil(ELEMENT_UNITS)),
            CubeDim::new_1d(ELEMENT_UNITS as u32),
            table.into_buffer_arg(),
            idx.into_buffer_arg(),
            out.clone().into_buffer_arg(),
            sequence(&[
                planes, t, width, offset, strides[0], strides[1], strides[2], first, held,
            ]),
            scale,
        );
    }
    out
}

/// `dst[(idx[at] + r) · width + e] = src[r · width + e]` for the rows that fit in `dst`; one
/// unit per element of `src`.
#[cube(launch)]
fn put_rows_kernel(src: &[f32], idx: &[f32], dst: &mut [f32], dims: Sequence<usize>) {
    // dims: elements of src, row width, where the first row's index is, rows of dst.
    let (n, width, at, rows) = (
        *dims.index(0),
        *dims.index(1),
        *dims.index(2),
        *dims.index(3),
    );
    let i = CUBE_POS * CUBE_DIM as usize + UNIT_POS as usize;
    if i < n {
        let row = usize::cast_from(u32::cast_from(idx[at])) + i / width;
        if row < rows {
            dst[row * width + i % width] = src[i];
        }
    }
}

/// See [`super::DecodeKernels::put_rows`].
pub(super) fn put_rows(dst: CubeTensor, src: CubeTensor, idx: CubeTensor, at: usize) -> CubeTensor {
    f32_only(&dst, "put_rows");
    f32_only(&src, "put_rows");
    f32_only(&idx, "put_rows");
    let (d, s) = (dst.meta.shape().clone(), src.meta.shape().clone());
    assert!(
        dst.is_contiguous() && d.num_dims() == 2 && s.num_dims() == 2 && d[1] == s[1],
        "put_rows: a dense destination [rows, w] {d:?} and a source [n, w] {s:?}"
    );
    assert!(
        at < idx.meta.shape().num_elements(),
        "put_rows: index {at} past the {} held",
        idx.meta.shape().num_elements()
    );
    let (rows, width) = (d[0], d[1]);
    let src = into_contiguous(src);
    let idx = into_contiguous(idx);
    let n = s.num_elements();
    if n > 0 {
        put_rows_kernel::launch(
            &dst.client.clone(),
            grid(n.div_ceil(ELEMENT_UNITS)),
            CubeDim::new_1d(ELEMENT_UNITS as u32),
            src.into_buffer_arg(),
            idx.into_buffer_arg(),
            dst.clone().into_buffer_arg(),
            sequence(&[n, width, at, rows]),
        );
    }
    dst
}
