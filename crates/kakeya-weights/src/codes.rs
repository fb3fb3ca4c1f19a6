//! Packed integer codes back to values: the quantised KV tiers keep codes of 2 to 8 bits packed
//! low bits first (code `i` at bits `i·b .. (i+1)·b` of the little-endian run), with an affine
//! map per group (one scale and minimum) or per code (one per channel). This is the read side
//! of every decode step over a quantised tier, so it runs eight codes at a time with AVX2
//! where the CPU has it; each value is `code · scale + minimum` (a product, then a sum, not
//! fused), the same bits on every path.

/// How codes map to values.
#[derive(Debug, Clone, Copy)]
pub enum Affine<'a> {
    /// One scale and minimum for every code.
    Group {
        /// Step between codes.
        scale: f32,
        /// Value of code 0.
        min: f32,
    },
    /// Code `i`'s own scale and minimum (`scale[i]`, `min[i]`).
    PerCode {
        /// Steps, one per code.
        scale: &'a [f32],
        /// Values of code 0, one per code.
        min: &'a [f32],
    },
}

impl Affine<'_> {
    #[inline]
    fn at(&self, i: usize) -> (f32, f32) {
        match *self {
            Affine::Group { scale, min } => (scale, min),
            Affine::PerCode { scale, min } => (scale[i], min[i]),
        }
    }
}

/// Code `i` of a run of `bits`-bit codes packed low bits first.
#[inline]
pub fn code_at(packed: &[u8], bits: u32, i: usize) -> u8 {
    let bit = i * bits as usize;
    let (at, shift) = (bit / 8, bit % 8);
    let lo = u16::from(packed[at]);
    let hi = u16::from(packed.get(at + 1).copied().unwrap_or(0));
    ((((hi << 8) | lo) >> shift) & ((1u16 << bits) - 1)) as u8
}

/// `out[i] = code_i · scale_i + min_i` for the first `out.len()` codes of `packed`
/// (`bits` from 1 to 8).
///
/// # Panics
/// When `packed` holds fewer than `out.len()` codes, a per-code map is shorter than `out`, or
/// `bits` is outside 1..=8.
#[allow(unsafe_code)]
pub fn dequantize_codes(packed: &[u8], bits: u32, affine: Affine<'_>, out: &mut [f32]) {
    assert!((1..=8).contains(&bits), "codes of {bits} bits");
    assert!(
        packed.len() * 8 >= out.len() * bits as usize,
        "dequantize_codes: {} codes asked of {} bytes",
        out.len(),
        packed.len()
    );
    if let Affine::PerCode { scale, min } = affine {
        assert!(scale.len() >= out.len() && min.len() >= out.len());
    }
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::kernel::simd_available() {
        // SAFETY: AVX2 is available; the lengths were checked above.
        done = unsafe { simd::eights(packed, bits, affine, out) };
    }
    for (i, o) in out.iter_mut().enumerate().skip(done) {
        let (s, m) = affine.at(i);
        *o = f32::from(code_at(packed, bits, i)) * s + m;
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd {
    use std::arch::x86_64::{
        __m128i, _mm_loadl_epi64, _mm256_add_ps, _mm256_and_si256, _mm256_cvtepi32_ps,
        _mm256_cvtepu8_epi32, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_epi32, _mm256_set1_ps,
        _mm256_setr_epi32, _mm256_srlv_epi32, _mm256_storeu_ps,
    };

    use super::Affine;

    /// Codes `0..8k` of `out`'s length rounded down to eights; returns `8k`. Eight codes of
    /// `bits` bits are `bits` whole bytes.
    ///
    /// # Safety
    /// AVX2 is available; `packed` holds `out.len()` codes, a per-code map `out.len()` values;
    /// `bits` is 1 to 8.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn eights(
        packed: &[u8],
        bits: u32,
        affine: Affine<'_>,
        out: &mut [f32],
    ) -> usize {
        let n = out.len() / 8 * 8;
        let b = bits as usize;
        // Up to 4 bits, eight codes fit in one 32-bit word; from 5, the last four are read
        // from a second word starting at the byte that holds the fifth code's first bit.
        let wide = (5..8).contains(&bits);
        let (half_at, half_shift) = ((4 * b) / 8, (4 * bits) % 8);
        let shifts = if wide {
            let h = half_shift as i32;
            let bi = bits as i32;
            _mm256_setr_epi32(0, bi, 2 * bi, 3 * bi, h, h + bi, h + 2 * bi, h + 3 * bi)
        } else {
            let bi = bits as i32;
            _mm256_setr_epi32(0, bi, 2 * bi, 3 * bi, 4 * bi, 5 * bi, 6 * bi, 7 * bi)
        };
        // The four bytes from `at` (zero past the end of `packed`; bits past a group's codes
        // are masked off).
        let word = |at: usize| -> i32 {
            match packed.get(at..at + 4) {
                Some(w) => i32::from_le_bytes(w.try_into().expect("four bytes")),
                None => {
                    let mut w = [0u8; 4];
                    let n = packed.len().saturating_sub(at).min(4);
                    w[..n].copy_from_slice(&packed[at..at + n]);
                    i32::from_le_bytes(w)
                }
            }
        };
        let mask = _mm256_set1_epi32((1i32 << bits) - 1);
        let po = out.as_mut_ptr();
        // Codes `i..i + 8` as f32: their `b` bytes (four read at once where the run has them,
        // the bytes past the eighth code masked off).
        let codes = |i: usize| {
            let at = i / 8 * b;
            let c = if bits == 8 {
                let bytes: &[u8; 8] = packed[at..at + 8].try_into().expect("eight bytes");
                // SAFETY: `bytes` holds 8 bytes.
                _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(bytes.as_ptr().cast::<__m128i>()) })
            } else if wide {
                let (lo, hi) = (word(at), word(at + half_at));
                let words = _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi);
                _mm256_and_si256(_mm256_srlv_epi32(words, shifts), mask)
            } else {
                let w = word(at);
                _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), shifts), mask)
            };
            _mm256_cvtepi32_ps(c)
        };
        let mut i = 0;
        match affine {
            Affine::Group { scale, min } => {
                let (s, m) = (_mm256_set1_ps(scale), _mm256_set1_ps(min));
                while i < n {
                    // SAFETY: `i + 8 <= n <= out.len()`.
                    unsafe {
                        _mm256_storeu_ps(po.add(i), _mm256_add_ps(_mm256_mul_ps(codes(i), s), m))
                    };
                    i += 8;
                }
            }
            Affine::PerCode { scale, min } => {
                while i < n {
                    // SAFETY: the maps and `out` hold at least `n` values, `i + 8 <= n`.
                    unsafe {
                        let s = _mm256_loadu_ps(scale.as_ptr().add(i));
                        let m = _mm256_loadu_ps(min.as_ptr().add(i));
                        _mm256_storeu_ps(po.add(i), _mm256_add_ps(_mm256_mul_ps(codes(i), s), m));
                    }
                    i += 8;
                }
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Codes packed low bits first, as the tiers write them.
    fn pack(codes: &[u8], bits: u32) -> Vec<u8> {
        let mut out = vec![0u8; (codes.len() * bits as usize).div_ceil(8)];
        for (i, &c) in codes.iter().enumerate() {
            for j in 0..bits as usize {
                let bit = i * bits as usize + j;
                out[bit / 8] |= ((c >> j) & 1) << (bit % 8);
            }
        }
        out
    }

    #[test]
    fn every_path_gives_the_product_then_the_sum_bit_for_bit() {
        for bits in 1..=8u32 {
            for n in [0, 5, 8, 64, 77, 256] {
                let codes: Vec<u8> = (0..n)
                    .map(|i| ((i * 37 + 11) % (1 << bits)) as u8)
                    .collect();
                let packed = pack(&codes, bits);
                let scale: Vec<f32> = (0..n).map(|i| 0.013 * (i as f32 + 1.0).sqrt()).collect();
                let min: Vec<f32> = (0..n).map(|i| -0.7 + (i as f32 * 0.31).sin()).collect();
                for affine in [
                    Affine::Group {
                        scale: 0.0371,
                        min: -1.23,
                    },
                    Affine::PerCode {
                        scale: &scale,
                        min: &min,
                    },
                ] {
                    let mut out = vec![f32::NAN; n];
                    dequantize_codes(&packed, bits, affine, &mut out);
                    for (i, (&o, &c)) in out.iter().zip(&codes).enumerate() {
                        assert_eq!(code_at(&packed, bits, i), c, "{bits} bits, code {i}");
                        let (s, m) = affine.at(i);
                        let want = f32::from(c) * s + m;
                        assert_eq!(o.to_bits(), want.to_bits(), "{bits} bits, n {n}, {i}");
                    }
                }
            }
        }
    }
}
