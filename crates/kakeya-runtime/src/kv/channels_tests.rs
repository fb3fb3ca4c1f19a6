//! Tests of [`super`]: the per-channel codec's bound, rotation, blocks fixed by absolute position, truncation.

use super::*;

fn values(n: usize, width: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    (0..n * width)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            // Channel 3 is an outlier channel, as real keys have.
            if i % width == 3 { 40.0 + u } else { u }
        })
        .collect()
}

#[test]
fn values_come_back_within_half_a_channel_step_and_chunking_does_not_matter() {
    let width = 16;
    let x = values(300, width, 5);
    for bits in (2..=8).map(|b| Bits::new(b).unwrap()) {
        // From position 4 (after the sinks), in one chunk and in chunks of 1..=37.
        let mut whole = ChannelRows::new(bits, width, 4);
        whole.push(&x[..(300 - 4) * width]);
        let mut parts = ChannelRows::new(bits, width, 4);
        let (mut at, mut step) = (4, 1);
        while at < 300 {
            let n = step.min(300 - at);
            parts.push(&x[(at - 4) * width..(at - 4 + n) * width]);
            at += n;
            step = step % 37 + 1;
        }
        // Complete blocks end at 256: positions 4..256 are quantised.
        let a = whole.read(4, 256).unwrap();
        assert_eq!(a, parts.read(4, 256).unwrap(), "{bits:?}: chunking");
        for (i, (got, want)) in a.iter().zip(&x).enumerate() {
            // Blocks are quantised from the f16 values the tail holds.
            let want = f16::from_f32(*want).to_f32();
            let (p, c) = (4 + i / width, i % width);
            let s = whole.scale(p, c).unwrap();
            assert!(
                (got - want).abs() <= s / 2.0 * (1.0 + 1e-3) + 1e-6,
                "{bits:?}: position {p} channel {c}: {want} came back {got} (step {s})"
            );
            // The outlier channel does not widen the others' steps (their range is < 1).
            if c != 3 {
                let top = ((1u32 << bits.count()) - 1) as f32;
                assert!(s <= 1.01 / top, "{bits:?}: channel {c} step {s}");
            }
        }
        assert!(
            whole.read(4, 257).is_err(),
            "an incomplete block is not read"
        );
    }
}

#[test]
fn fitted_channels_err_less_and_chunking_does_not_matter() {
    let width = 16;
    let x = values(300, width, 7);
    for bits in (2..=8).map(|b| Bits::new(b).unwrap()) {
        let mut plain = ChannelRows::new(bits, width, 0);
        plain.push(&x);
        let mut whole = ChannelRows::new(bits, width, 0).fitted();
        whole.push(&x);
        let mut parts = ChannelRows::new(bits, width, 0).fitted();
        for chunk in x.chunks(width * 23) {
            parts.push(chunk);
        }
        let (a, b) = (plain.read(0, 256).unwrap(), whole.read(0, 256).unwrap());
        assert_eq!(b, parts.read(0, 256).unwrap(), "{bits:?}: chunking");
        // Per block and channel, the fitted range errs no more than min–max.
        for block in 0..4 {
            for c in 0..width {
                let err = |y: &[f32]| -> f64 {
                    (block * 64..(block + 1) * 64)
                        .map(|p| {
                            let want = f16::from_f32(x[p * width + c]).to_f32();
                            f64::from(y[p * width + c] - want).powi(2)
                        })
                        .sum()
                };
                assert!(
                    err(&b) <= err(&a) * (1.0 + 1e-4) + 1e-9,
                    "{bits:?}: block {block} channel {c}"
                );
            }
        }
    }
}

/// Rows of a mixed block read group by group, each width's codes dequantised in row
/// order and then put in channel order: the reference for [`ChannelRows::read_mixed`].
fn read_mixed_by_groups(b: &Block, bits: &[u8], rows: std::ops::Range<usize>) -> Vec<f32> {
    let w = bits.len();
    let (order, groups) = layout(bits);
    let scale: Vec<f32> = order.iter().map(|&c| b.params[c][0].to_f32()).collect();
    let min: Vec<f32> = order.iter().map(|&c| b.params[c][1].to_f32()).collect();
    let rb: usize = groups
        .iter()
        .map(|&(bb, n)| (n * bb as usize).div_ceil(8))
        .sum();
    let mut out = vec![0.0f32; rows.len() * w];
    let mut tmp = vec![0.0f32; w];
    for (r, o) in rows.zip(out.chunks_exact_mut(w)) {
        let codes = &b.codes[r * rb..(r + 1) * rb];
        let (mut at, mut byte) = (0, 0);
        for &(bb, n) in &groups {
            let len = (n * bb as usize).div_ceil(8);
            if bb == 0 {
                tmp[at..at + n].copy_from_slice(&min[at..at + n]);
            } else {
                let affine = Affine::PerCode {
                    scale: &scale[at..at + n],
                    min: &min[at..at + n],
                };
                dequantize_codes(&codes[byte..byte + len], bb, affine, &mut tmp[at..at + n]);
            }
            at += n;
            byte += len;
        }
        for (&c, &x) in order.iter().zip(&tmp) {
            o[c] = x;
        }
    }
    out
}

#[test]
fn mixed_bits_keep_the_average_favour_wide_channels_and_err_less() {
    let ranges: Vec<f32> = (0..16).map(|c| if c == 3 { 40.0 } else { 1.0 }).collect();
    for bits in 2..=8 {
        let a = allot(&ranges, bits);
        assert_eq!(a.iter().map(|&b| u32::from(b)).sum::<u32>(), bits * 16);
        assert!(a.iter().all(|&b| b <= 8), "{a:?}");
        assert!(a.iter().all(|&b| b <= a[3]), "{bits}: {a:?}");
    }
    // log2(40) ≈ 5.3 bits more than the others': the outlier gets 8, the other 15
    // channels share the 40 bits left (2 or 3 each, the first ones 3).
    let a = allot(&ranges, 3);
    assert_eq!(a[3], 8, "the outlier channel gets the most bits");
    assert!(
        a.iter()
            .enumerate()
            .all(|(c, &b)| c == 3 || (2..=3).contains(&b)),
        "{a:?}"
    );
    assert!(a[0] >= a[15], "ties go to the lowest channel: {a:?}");
    let width = 16;
    // Channel 3 spans 40 times the others' range (not only an offset, as in `values`).
    let x: Vec<f32> = values(300, width, 11)
        .iter()
        .enumerate()
        .map(|(i, &v)| if i % width == 3 { (v - 40.0) * 40.0 } else { v })
        .collect();
    for bits in (2..=8).map(|b| Bits::new(b).unwrap()) {
        let mut uniform = ChannelRows::new(bits, width, 4);
        uniform.push(&x[..296 * width]);
        let mut whole = ChannelRows::new(bits, width, 4).mixed();
        whole.push(&x[..296 * width]);
        let mut parts = ChannelRows::new(bits, width, 4).mixed();
        for chunk in x[..296 * width].chunks(width * 29) {
            parts.push(chunk);
        }
        let a = whole.read(4, 256).unwrap();
        assert_eq!(a, parts.read(4, 256).unwrap(), "{bits:?}: chunking");
        // Each block bit for bit as read group by group (every row, and rows from the
        // middle of a block to its end).
        for (k, b) in whole.blocks.iter().enumerate() {
            let nib = unnibble(b.mixed.as_ref().unwrap(), width);
            let from = if k % 2 == 0 { 0 } else { 17 };
            let rows = from..b.end - b.start;
            let want = read_mixed_by_groups(b, &nib, rows.clone());
            let got = whole.read(b.start + from, b.end).unwrap();
            let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits_of(&got), bits_of(&want), "{bits:?}: block {k}");
        }
        let (mut err_mixed, mut err_uniform) = (0.0f64, 0.0f64);
        let u = uniform.read(4, 256).unwrap();
        for (i, ((got, flat), want)) in a.iter().zip(&u).zip(&x).enumerate() {
            let want = f16::from_f32(*want).to_f32();
            let (p, c) = (4 + i / width, i % width);
            let s = whole.scale(p, c).unwrap();
            let b = whole.bits_at(p, c).unwrap();
            // A channel of no bits comes back as its mean (the narrow channels span
            // under 1).
            let bound = if b == 0 {
                1.0
            } else {
                s / 2.0 * (1.0 + 1e-3) + 1e-6
            };
            assert!(
                (got - want).abs() <= bound,
                "{bits:?}: position {p} channel {c} ({b} bits): {want} came back {got} (step {s})"
            );
            assert!(b <= 8);
            err_mixed += f64::from(got - want).powi(2);
            err_uniform += f64::from(flat - want).powi(2);
        }
        // At 8 bits on average every channel has 8 (the most).
        if bits.count() < 8 {
            assert!(
                err_mixed < 0.5 * err_uniform,
                "{bits:?}: mixed {err_mixed} against uniform {err_uniform}"
            );
        }
    }
}

#[test]
fn a_rollback_into_the_last_block_rebuilds_it_from_the_same_values() {
    let width = 8;
    let x = values(200, width, 9);
    let bits = Bits::new(3).unwrap();
    let mut r = ChannelRows::new(bits, width, 0);
    r.push(&x[..130 * width]); // blocks 0..64, 64..128 complete
    r.truncate(120).unwrap(); // reopens 64..128
    assert!(r.read(64, 65).is_err());
    r.push(&x[120 * width..200 * width]);
    let mut straight = ChannelRows::new(bits, width, 0);
    straight.push(&x[..200 * width]);
    assert_eq!(r.read(0, 192).unwrap(), straight.read(0, 192).unwrap());
    // Two blocks back is refused: those rows are gone.
    assert!(r.truncate(60).is_err());
    r.drop_before(128);
    assert!(r.read(0, 1).is_err());
    assert_eq!(r.read(128, 192).unwrap(), straight.read(128, 192).unwrap());
}
