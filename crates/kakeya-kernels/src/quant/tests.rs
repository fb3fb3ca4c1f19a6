use super::*;
use crate::dequant::dequantize;

/// Pseudo-random blocks with sane f16 scales at the type's scale fields.
pub(crate) fn blocks(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let n = ty.bytes_for(rows * cols).unwrap();
    let mut x: u32 = 12345;
    let mut data: Vec<u8> = (0..n)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (x >> 16) as u8
        })
        .collect();
    let scale_at: &[usize] = match ty {
        GgmlType::Q6K => &[208],
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q4_1 | GgmlType::Q5_1 => &[0, 2],
        _ => &[0],
    };
    for (k, b) in data.chunks_exact_mut(ty.block_bytes()).enumerate() {
        for &at in scale_at {
            b[at..at + 2]
                .copy_from_slice(&half::f16::from_f32(0.001 * (1 + k % 5) as f32).to_le_bytes());
        }
    }
    data
}

#[test]
fn repacked_values_equal_the_dequantiser_bit_for_bit() {
    use GgmlType::*;
    for ty in [Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4K, Q5K, Q6K] {
        let (rows, cols) = (3, 512);
        let data = blocks(ty, rows, cols);
        let q = QuantMatrix::new(ty, rows, cols, &data).unwrap();
        let want = dequantize(ty, &data, rows * cols);
        let got = q.to_dense();
        let bad = want
            .iter()
            .zip(&got)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(bad, None, "{ty:?}: element {bad:?} differs");
    }
}

#[test]
fn matmul_matches_dense_products() {
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ] {
        let (rows, cols, t) = (70, 512, 3);
        let data = blocks(ty, rows, cols);
        let dense = dequantize(ty, &data, rows * cols);
        let q = QuantMatrix::new(ty, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..t * cols)
            .map(|i| ((i * 31) % 17) as f32 * 0.1 - 0.8)
            .collect();
        // f32 rounding only, bounded against Σ|w·x|.
        {
            let tol = 1e-6;
            let y = q.matmul(&x, t);
            for tt in 0..t {
                for r in 0..rows {
                    let (mut want, mut scale) = (0.0f64, 0.0f64);
                    for c in 0..cols {
                        let p = dense[r * cols + c] as f64 * x[tt * cols + c] as f64;
                        want += p;
                        scale += p.abs();
                    }
                    let got = y[tt * rows + r] as f64;
                    assert!(
                        (got - want).abs() <= tol * scale,
                        "{ty:?} [{tt},{r}]: {got} vs {want} (Σ|w·x| {scale})"
                    );
                }
            }
        }
    }
}

#[test]
fn a_rows_result_does_not_depend_on_how_many_rows_run_together() {
    // Speculative verification runs a block of rows where decoding ran one: same bits.
    for ty in [GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::Q4K, GgmlType::Q6K] {
        let (rows, cols) = (9, 256);
        let data = blocks(ty, rows, cols);
        let q = QuantMatrix::new(ty, rows, cols, &data).unwrap();
        // 37 rows: three passes of the kernel (16 + 16 + 5).
        let n = 37;
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 37) % 23) as f32 * 0.07 - 0.7)
            .collect();
        let all = q.matmul(&x, n);
        let five = q.matmul(&x[..5 * cols], 5);
        assert_eq!(&all[..5 * rows], &five[..], "{ty:?}: 5 rows");
        for tt in 0..n {
            let one = q.matmul(&x[tt * cols..(tt + 1) * cols], 1);
            assert_eq!(
                &all[tt * rows..(tt + 1) * rows],
                &one[..],
                "{ty:?} row {tt}"
            );
        }
    }
}

#[test]
fn several_matrices_at_once_give_each_ones_own_products() {
    // A layer's q/k/v or gate/up in one parallel loop: formats and row counts differ
    // (tasks end mid-matrix), the input is shared.
    let cols = 256;
    let ms: Vec<QuantMatrix> = [
        (GgmlType::Q4K, 70),
        (GgmlType::Q6K, 9),
        (GgmlType::Q8_0, 33),
    ]
    .iter()
    .map(|&(ty, rows)| QuantMatrix::new(ty, rows, cols, &blocks(ty, rows, cols)).unwrap())
    .collect();
    let refs: Vec<&QuantMatrix> = ms.iter().collect();
    for t in [1, 5, 37] {
        let x: Vec<f32> = (0..t * cols)
            .map(|i| ((i * 41) % 29) as f32 * 0.05 - 0.6)
            .collect();
        let many = QuantMatrix::matmul_many(&refs, &x, t);
        assert_eq!(many.len(), ms.len());
        for (k, (m, y)) in ms.iter().zip(&many).enumerate() {
            // Each alone, one input row at a time: the reference.
            let mut want = Vec::new();
            for j in 0..t {
                want.extend(m.matmul(&x[j * cols..(j + 1) * cols], 1));
            }
            assert_eq!(y, &want, "matrix {k}, t = {t}");
        }
    }
}

#[test]
fn every_path_gives_the_canonical_bits() {
    // Whatever the layout, tile or path (decode, short block in one or two passes per
    // tile, long block, padded last tile), each output is
    // the canonical-order dot product of the dequantised row: the model's own numbers.
    use GgmlType::*;
    let cases = [Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4K, Q5K, Q6K]
        .map(|ty| (ty, 512))
        .into_iter()
        .chain([(Q8_0, 640), (Q5_1, 640)]);
    // 9 rows: a last tile with one row; 11: with three (the two-pass path's second half
    // partly used); 403 rows: many tasks.
    let long = [((Q8_0, 512), 403), ((Q4K, 512), 403)];
    // Each case on the best SIMD path this CPU has (AVX-512F or AVX2), then on AVX2.
    let cases: Vec<_> = cases.flat_map(|c| [(c, 9), (c, 11)]).chain(long).collect();
    for ((ty, cols), rows, avx2) in [false, true]
        .into_iter()
        .flat_map(|avx2| cases.iter().map(move |&(c, r)| (c, r, avx2)))
    {
        tiles::force_avx2(avx2);
        let data = blocks(ty, rows, cols);
        let dense = dequantize(ty, &data, rows * cols);
        let q = QuantMatrix::new(ty, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..17 * cols)
            .map(|i| ((i * 41) % 29) as f32 * 0.09 - 1.1)
            .collect();
        for t in [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17] {
            let y = q.matmul(&x[..t * cols], t);
            for tt in 0..t {
                for r in 0..rows {
                    let want = tiles::dot(
                        &dense[r * cols..(r + 1) * cols],
                        &x[tt * cols..(tt + 1) * cols],
                    );
                    assert_eq!(
                        y[tt * rows + r].to_bits(),
                        want.to_bits(),
                        "{ty:?} t={t} [{tt},{r}] (AVX2 forced: {avx2})"
                    );
                }
            }
        }
    }
    tiles::force_avx2(false);
}

#[test]
fn selected_rows_are_the_same_rows_bit_for_bit() {
    for ty in [GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K] {
        let (rows, cols) = (11, 256);
        let m = QuantMatrix::new(ty, rows, cols, &blocks(ty, rows, cols)).unwrap();
        let ids = [7u32, 0, 10, 3, 3, 9];
        let sel = m.select_rows(&ids).unwrap();
        let (full, part) = (m.to_dense(), sel.to_dense());
        for (r, &id) in ids.iter().enumerate() {
            let id = id as usize;
            assert_eq!(
                part[r * cols..(r + 1) * cols],
                full[id * cols..(id + 1) * cols]
            );
        }
        let x: Vec<f32> = (0..3 * cols)
            .map(|i| ((i * 13) % 29) as f32 * 0.1 - 1.4)
            .collect();
        let (y, ys) = (m.matmul(&x, 3), sel.matmul(&x, 3));
        for j in 0..3 {
            for (r, &id) in ids.iter().enumerate() {
                assert_eq!(
                    ys[j * ids.len() + r].to_bits(),
                    y[j * rows + id as usize].to_bits()
                );
            }
        }
        assert!(m.select_rows(&[11]).is_none() && m.select_rows(&[]).is_none());
    }
}

#[test]
fn refuses_empty_and_overflowing_shapes_before_sizing_anything() {
    // Found by examples/fuzz_loaders.rs: a corrupt GGUF's `0 × 2⁴⁰` tensor has no bytes
    // to contradict it, and sized a 2⁴⁰-byte row buffer.
    assert!(QuantMatrix::new(GgmlType::Q8_0, 0, 1 << 40, &[]).is_none());
    assert!(QuantMatrix::new(GgmlType::Q8_0, 3, 0, &[]).is_none());
    assert_eq!(GgmlType::Q8_0.bytes_for(usize::MAX / 32 * 32), None);
}

#[test]
fn refuses_partial_blocks() {
    assert!(QuantMatrix::new(GgmlType::Q4K, 2, 640, &[0; 2 * 360]).is_none());
}
