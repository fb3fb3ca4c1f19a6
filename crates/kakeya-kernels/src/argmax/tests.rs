use super::*;
use crate::dequant::{GgmlType, dequantize};
use crate::quant::tests::blocks;

/// The reference: the first largest of `matmul`'s products.
fn exact_argmax(m: &QuantMatrix, x: &[f32], t: usize) -> Vec<u32> {
    let y = m.matmul(x, t);
    y.chunks_exact(m.rows())
        .map(|row| first_max(row).unwrap() as u32)
        .collect()
}

/// Inputs of three kinds: flat noise, noise with a few large channels (Gemma's residual
/// stream has some), and a scaled copy of one weight row plus noise (a peaked choice).
fn inputs(m: &QuantMatrix, t: usize, seed: u32) -> Vec<f32> {
    let cols = m.cols();
    let dense = m.to_dense();
    let mut z = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let mut rnd = move || {
        z = z.wrapping_mul(1_103_515_245).wrapping_add(12345);
        ((z >> 8) & 0xffff) as f32 / 65536.0 - 0.5
    };
    let mut x = Vec::with_capacity(t * cols);
    for j in 0..t {
        let pick = (j * 37 + seed as usize * 11) % m.rows();
        for c in 0..cols {
            let v = match j % 3 {
                0 => rnd() * 2.0,
                1 => rnd() + if c % 97 == 5 { 40.0 * rnd() } else { 0.0 },
                _ => 300.0 * dense[pick * cols + c] + 0.3 * rnd(),
            };
            x.push(v);
        }
    }
    x
}

#[test]
fn every_rows_approximation_is_within_its_bound() {
    if !simd::available() {
        return;
    }
    for (ty, rows, cols) in [
        (GgmlType::Q8_0, 403, 640),
        (GgmlType::Q4_0, 257, 512),
        (GgmlType::Q5_0, 130, 512),
    ] {
        let m = QuantMatrix::new(ty, rows, cols, &blocks(ty, rows, cols)).unwrap();
        let t = 6;
        let x = inputs(&m, t, 3);
        let xr = round_inputs(&x, t, cols);
        let mut approx = vec![0.0f32; rows * t];
        approx_rows(m.layout(), m.data(), &xr, t, rows, &mut approx);
        // Both passes: AVX2's (`[r, t]`) and, with VNNI, the int8 panels' (`[t, rows]`).
        let mut passes = vec![("avx2", approx)];
        let p = m.panels();
        let mut by_row = vec![0.0f32; rows * t];
        approx_panel_rows(&(p, p.rounded_from(&xr.q, &xr.s)), t, 0, rows, &mut by_row);
        passes.push(("int8 panels", by_row));
        let exact = m.matmul(&x, t);
        let norms = m.norms();
        for (name, approx) in passes {
            let mut worst = 0.0f64;
            for r in 0..rows {
                for j in 0..t {
                    let (a, f) = (approx[r * t + j], exact[j * rows + r]);
                    let bound = f64::from(norms[r]) * f64::from(xr.radius[j]);
                    let err = (f64::from(a) - f64::from(f)).abs();
                    assert!(
                        err <= bound,
                        "{ty:?} {name} [{r},{j}]: |{a} - {f}| > {bound}"
                    );
                    worst = worst.max(err / bound);
                }
            }
            // The bound is not vacuous: some rows come within a few times of it.
            assert!(
                worst > 0.01,
                "{ty:?} {name}: error at most {worst} of the bound"
            );
        }
    }
}

#[test]
fn the_certified_argmax_is_the_exact_products_argmax() {
    if !simd::available() {
        return;
    }
    for (ty, rows, cols) in [
        (GgmlType::Q8_0, 1003, 640),
        (GgmlType::Q8_0, 9, 512),
        (GgmlType::Q4_0, 600, 512),
        (GgmlType::Q5_0, 515, 640),
    ] {
        let m = QuantMatrix::new(ty, rows, cols, &blocks(ty, rows, cols)).unwrap();
        for t in [1, 2, 3, 4, 5, 8, 9, 16] {
            for seed in 0..3 {
                let x = inputs(&m, t, seed);
                // Both approximate passes: the int8 panels' and AVX2's.
                for panels in [true, false] {
                    let got = m
                        .certified_argmax(&x, t, panels)
                        .expect("the certified path applies");
                    let what = format!("{ty:?} t={t} seed={seed} panels={panels}");
                    assert_eq!(got.ids, exact_argmax(&m, &x, t), "{what}");
                    assert!(got.candidates.iter().all(|&c| c >= 1 && c <= rows));
                }
            }
        }
    }
}

#[test]
fn tasks_and_chunks_share_bounds_and_still_choose_exactly() {
    if !simd::available() {
        return;
    }
    // Three tasks (the last one a partial chunk), the largest product in the first, a
    // middle or the last one, several input rows at once.
    let (ty, rows, cols) = (GgmlType::Q8_0, 2 * ROWS_PER_TASK + 300, 256);
    let m = QuantMatrix::new(ty, rows, cols, &blocks(ty, rows, cols)).unwrap();
    let dense = m.to_dense();
    let picks = [10, ROWS_PER_TASK + 7, rows - 3, ROWS_PER_CHUNK + 1];
    let mut x = Vec::new();
    for (j, &p) in picks.iter().enumerate() {
        let noise = inputs(&m, 1, j as u32 + 5);
        x.extend(
            dense[p * cols..(p + 1) * cols]
                .iter()
                .zip(&noise)
                .map(|(w, n)| 300.0 * w + 0.1 * n),
        );
    }
    for panels in [true, false] {
        let got = m.certified_argmax(&x, picks.len(), panels).unwrap();
        assert_eq!(
            got.ids,
            exact_argmax(&m, &x, picks.len()),
            "panels={panels}"
        );
        assert_eq!(got.ids, picks.map(|p| p as u32), "panels={panels}");
        assert!(
            got.candidates.iter().all(|&c| (1..30).contains(&c)),
            "{:?}",
            got.candidates
        );
    }
}

#[test]
fn flat_inputs_take_one_full_pass_and_still_choose_exactly() {
    if !simd::available() {
        return;
    }
    let (ty, rows, cols) = (GgmlType::Q8_0, 403, 512);
    let m = QuantMatrix::new(ty, rows, cols, &blocks(ty, rows, cols)).unwrap();
    // Row 0: every product is 0 (all rows tie: the first wins); row 1: tiny values, so
    // the rounding radius dwarfs the spread and nearly every row stays a candidate; row
    // 2: ordinary, few candidates. Each takes its own path within one call.
    let mut x = vec![0.0f32; 3 * cols];
    for (c, v) in x[cols..2 * cols].iter_mut().enumerate() {
        *v = if c == 5 { 1e-30 } else { 0.0 };
    }
    x[2 * cols..].copy_from_slice(&inputs(&m, 1, 7));
    let got = m.argmax(&x, 3).unwrap();
    assert_eq!(got.ids, exact_argmax(&m, &x, 3));
    assert_eq!(got.ids[0], 0);
    assert!(
        got.candidates[0] > rows / FULL_ROW_SHARE,
        "{:?}",
        got.candidates
    );
}

#[test]
fn ties_go_to_the_first_row_and_peaked_inputs_need_few_exact_products() {
    if !simd::available() {
        return;
    }
    let (ty, rows, cols) = (GgmlType::Q8_0, 300, 512);
    let mut data = blocks(ty, rows, cols);
    let rb = ty.bytes_for(cols).unwrap();
    // Row 250 is a copy of row 17.
    let src = data[17 * rb..18 * rb].to_vec();
    data[250 * rb..251 * rb].copy_from_slice(&src);
    let m = QuantMatrix::new(ty, rows, cols, &data).unwrap();
    let dense = dequantize(ty, &data, rows * cols);
    let x: Vec<f32> = dense[17 * cols..18 * cols]
        .iter()
        .map(|v| v * 500.0)
        .collect();
    let got = m.argmax(&x, 1).unwrap();
    assert_eq!(got.ids, vec![17]);
    assert_eq!(exact_argmax(&m, &x, 1), vec![17]);
    // Both copies tie, so both stay candidates; the bound excludes nearly all the rest.
    assert!(
        got.candidates[0] >= 2 && got.candidates[0] < 30,
        "{:?}",
        got.candidates
    );
}

#[test]
fn other_formats_and_non_finite_inputs_take_the_exact_path() {
    for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q5_1] {
        let m = QuantMatrix::new(ty, 8, 512, &blocks(ty, 8, 512)).unwrap();
        assert!(m.argmax(&vec![0.5; 512], 1).is_none(), "{ty:?}");
    }
    let m = QuantMatrix::new(GgmlType::Q8_0, 8, 512, &blocks(GgmlType::Q8_0, 8, 512)).unwrap();
    let mut x = vec![0.5f32; 512];
    x[3] = f32::NAN;
    assert!(m.argmax(&x, 1).is_none());
    x[3] = f32::INFINITY;
    assert!(m.argmax(&x, 1).is_none());
}
