//! Tests of [`super`]: the codec's bound, packing at every width, truncation, dropping and paging.

use super::*;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            (u - 0.5) * 8.0 + if i % 97 == 0 { 40.0 } else { 0.0 }
        })
        .collect()
}

#[test]
fn dequantised_values_are_within_half_a_step() {
    for bits in (2..=8).map(|b| Bits::new(b).unwrap()) {
        let width = 256;
        let x = values(width * 7, 3);
        let mut q = QuantRows::new(bits, width);
        q.push(&x[..width * 3]);
        q.push(&x[width * 3..]);
        assert_eq!(q.len(), 7);
        let y = q.dequantize(0, 7);
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            let s = q.scale(i / width, (i % width) / GROUP);
            assert!(
                (a - b).abs() <= s / 2.0 * (1.0 + 1e-3) + 1e-6,
                "{bits:?}: value {i}: {a} came back {b}, step {s}"
            );
        }
        // The step is what the format promises: range / (2^bits − 1), rounded up to f16.
        let g0 = &x[..GROUP];
        let range = g0.iter().cloned().fold(f32::MIN, f32::max)
            - g0.iter().cloned().fold(f32::MAX, f32::min);
        let want = range / f32::from(bits.max_code());
        assert!(q.scale(0, 0) >= want && q.scale(0, 0) <= want * 1.002 + 1e-6);
    }
}

#[test]
fn constant_groups_and_extremes_come_back() {
    let width = 64;
    let mut x = vec![1.5f32; 64];
    x.extend(vec![-3.25f32; 64]);
    x.extend((0..64).map(|i| if i == 0 { -1e4 } else { 1e4 }));
    for bits in (2..=8).map(|b| Bits::new(b).unwrap()) {
        let mut q = QuantRows::new(bits, width);
        q.push(&x);
        let y = q.dequantize(0, 3);
        assert_eq!(&y[..128], &x[..128], "{bits:?}: constant groups are exact");
        assert_eq!(y[128], -1e4);
        assert!((y[129] - 1e4).abs() <= q.scale(2, 0) / 2.0 + 1e-3);
    }
}

#[test]
fn truncate_drop_front_and_bytes() {
    let width = 128;
    let x = values(width * 10, 9);
    for bits in [
        None,
        Some(Bits::B8),
        Some(Bits::B4),
        Bits::new(3),
        Bits::new(2),
    ] {
        let mut r = Rows::new(width, bits);
        r.push(&x);
        let all = r.read(0, 10);
        r.truncate(6);
        assert_eq!(r.len(), 6);
        assert_eq!(r.read(0, 6), all[..6 * width]);
        r.drop_front(2);
        assert_eq!(r.len(), 4);
        assert_eq!(r.read(0, 4), all[2 * width..6 * width]);
        // Re-appending after a truncate gives the same rows as the first time.
        r.push(&x[6 * width..]);
        assert_eq!(r.read(4, 8), all[6 * width..]);
        let per_value = match bits {
            None => 4.0,
            Some(b) => f64::from(b.count()) / 8.0 + 4.0 / 64.0,
        };
        let used = (8 * width) as f64 * per_value;
        let held = r.nbytes() as f64;
        // f32 rows grow by an eighth; quantised rows hold whole pages (here one).
        let most = match bits {
            None => used * 1.5,
            Some(_) => (PAGE_ROWS * width) as f64 * per_value,
        };
        assert!(
            held >= used && held <= most + 1024.0,
            "{bits:?}: {held} for {used}"
        );
    }
}

#[test]
fn pages_keep_what_is_held_within_a_page_at_each_end() {
    let width = 64;
    let x = values(width * 1000, 11);
    let mut whole = QuantRows::new(Bits::B4, width);
    whole.push(&x);
    let mut r = QuantRows::new(Bits::B4, width);
    for row in x.chunks_exact(width * 7) {
        r.push(row);
    }
    r.push(&x[width * 994..]);
    assert_eq!(r.len(), 1000);
    assert_eq!(r.dequantize(0, 1000), whole.dequantize(0, 1000));
    let row_bytes = width / 2 + 4;
    let page = PAGE_ROWS * row_bytes;
    for (drop, keep) in [(0, 1000), (130, 800), (1, 799), (64, 700), (0, 1), (700, 0)] {
        r.drop_front(drop);
        r.truncate(keep);
        let held = r.nbytes() - r.pages.capacity() * std::mem::size_of::<Page>();
        assert!(held >= r.len() * row_bytes, "{held} for {} rows", r.len());
        assert!(
            held <= r.len() * row_bytes + 2 * page,
            "{held} for {} rows",
            r.len()
        );
    }
    assert!(r.is_empty());
    // Refilled after emptying, rows come back as the first time.
    r.push(&x[..width * 100]);
    assert_eq!(r.dequantize(0, 100), whole.dequantize(0, 100));
    let mut s = QuantRows::new(Bits::B4, width);
    s.push(&x[..width * 300]);
    s.drop_front(70);
    assert_eq!(s.dequantize(0, 230), whole.dequantize(70, 300));
    assert_eq!(s.scale(5, 0), whole.scale(75, 0));
}

#[test]
fn packed_codes_come_back_for_every_width() {
    for b in 2..=8 {
        let bits = Bits::new(b).unwrap();
        for n in [1, 7, 8, 64, 65, 256] {
            let codes: Vec<u8> = (0..n).map(|i| ((i * 37 + 11) % (1 << b)) as u8).collect();
            let mut packed = Vec::new();
            pack_codes(&codes, bits, &mut packed);
            assert_eq!(
                packed.len(),
                (n * b as usize).div_ceil(8),
                "{b} bits, {n} codes"
            );
            // The reader of every quantised tier: codes back, then as values.
            let back: Vec<u8> = (0..n)
                .map(|i| kakeya_kernels::codes::code_at(&packed, b, i))
                .collect();
            assert_eq!(back, codes, "{b} bits");
            let mut run = vec![0.0f32; n];
            let affine = kakeya_kernels::codes::Affine::Group {
                scale: 1.0,
                min: 0.0,
            };
            kakeya_kernels::codes::dequantize_codes(&packed, b, affine, &mut run);
            let want: Vec<f32> = codes.iter().map(|&c| f32::from(c)).collect();
            assert_eq!(run, want, "{b} bits, read as a run");
        }
    }
    assert!(Bits::new(1).is_none() && Bits::new(9).is_none());
}

/// Near-Gaussian values (each the sum of four uniforms), as rotated rows are.
fn bell(n: usize, seed: u64) -> Vec<f32> {
    let u = values(4 * n, seed);
    u.chunks_exact(4)
        .map(|c| c.iter().map(|x| x.min(4.0)).sum::<f32>())
        .collect()
}

#[test]
fn fitted_ranges_err_less_than_min_max_and_keep_their_stated_bound() {
    let (width, rows) = (256, 24);
    let x = bell(width * rows, 17);
    for bits in (2..=8).map(|b| Bits::new(b).unwrap()) {
        let mut plain = QuantRows::with_group(bits, width, width);
        let mut fit = QuantRows::with_group(bits, width, width).fitted();
        assert!(fit.is_fitted() && !plain.is_fitted());
        plain.push(&x);
        fit.push(&x);
        let (a, b) = (plain.dequantize(0, rows), fit.dequantize(0, rows));
        let sq = |y: &[f32], x: &[f32]| -> f64 {
            y.iter().zip(x).map(|(y, x)| f64::from(y - x).powi(2)).sum()
        };
        let top = f32::from(bits.max_code());
        let (mut total_plain, mut total_fit) = (0.0, 0.0);
        for r in 0..rows {
            let span = r * width..(r + 1) * width;
            let (ep, ef) = (
                sq(&a[span.clone()], &x[span.clone()]),
                sq(&b[span.clone()], &x[span.clone()]),
            );
            assert!(
                ef <= ep * (1.0 + 1e-4) + 1e-9,
                "{bits:?} row {r}: fitted {ef} > min–max {ep}"
            );
            (total_plain, total_fit) = (total_plain + ep, total_fit + ef);
            // Inside [m, m + top·s] within half a step; outside, within the distance to it.
            let [s, m] = fit.params(r, 0);
            for (x, y) in x[span.clone()].iter().zip(&b[span]) {
                let bound = (s / 2.0).max(m - x).max(x - (m + top * s));
                assert!(
                    (x - y).abs() <= bound * (1.0 + 1e-3) + 1e-5,
                    "{bits:?} row {r}: {x} came back {y} (step {s}, minimum {m})"
                );
            }
        }
        if bits.count() <= 3 {
            // A min–max range spreads few levels over the rare tails of a bell.
            assert!(
                total_fit < 0.8 * total_plain,
                "{bits:?}: fitted {total_fit} against min–max {total_plain}"
            );
        }
    }
    // Constant groups stay exact.
    let mut c = QuantRows::with_group(Bits::B2, 64, 64).fitted();
    c.push(&[1.5f32; 64]);
    assert_eq!(c.dequantize(0, 1), vec![1.5f32; 64]);
}
