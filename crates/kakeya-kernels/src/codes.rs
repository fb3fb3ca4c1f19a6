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

/// The four bytes of `packed` from byte `at` as a little-endian word, bytes past its end read
/// as zero (a code's bits past its width are masked off by the reader).
#[inline(always)]
fn le_word(packed: &[u8], at: usize) -> u32 {
    match packed.get(at..at + 4) {
        Some(w) => u32::from_le_bytes(w.try_into().expect("four bytes")),
        None => {
            let mut w = [0u8; 4];
            let n = packed.len().saturating_sub(at).min(4);
            w[..n].copy_from_slice(&packed[at..at + n]);
            u32::from_le_bytes(w)
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
    if crate::tiles::simd_available() {
        // SAFETY: AVX2 is available; the lengths were checked above.
        done = unsafe { simd::eights(packed, bits, affine, out) };
    }
    for (i, o) in out.iter_mut().enumerate().skip(done) {
        let (s, m) = affine.at(i);
        *o = f32::from(code_at(packed, bits, i)) * s + m;
    }
}

/// Where the codes of one row sit when its values have codes of different widths (a block
/// of keys whose bits are mixed per channel): value `i`'s code starts at bit `bit[i]` of the
/// row and is `mask[i]` wide (`mask = 2^bits − 1`; 0 for a value with no code, which comes
/// back as its minimum), and maps back by `scale[i]`, `min[i]`. Made once per block, read
/// for each of its rows by [`dequantize_mixed`].
#[derive(Debug, Clone, Default)]
pub struct MixedCodes {
    bit: Vec<u32>,
    mask: Vec<u32>,
    scale: Vec<f32>,
    min: Vec<f32>,
    /// Bytes a row must hold for every code's four-byte window to lie inside it.
    reach: usize,
}

impl MixedCodes {
    /// Empty; filled by [`Self::set`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Clears the map for `n` values (reusing its buffers); [`Self::set`] each of them.
    pub fn reset(&mut self, n: usize) {
        for v in [&mut self.bit, &mut self.mask] {
            v.clear();
            v.resize(n, 0);
        }
        for v in [&mut self.scale, &mut self.min] {
            v.clear();
            v.resize(n, 0.0);
        }
        self.reach = 0;
    }

    /// Value `i`'s code: `bits` wide (0 to 8; 0: the value is `min`) at bit `bit` of the row.
    ///
    /// # Panics
    /// When `bits` is over 8 or `i` past the length given to [`Self::reset`].
    pub fn set(&mut self, i: usize, (bit, bits): (usize, u32), scale: f32, min: f32) {
        assert!(bits <= 8, "codes of {bits} bits");
        let bit = if bits == 0 { 0 } else { bit };
        self.bit[i] = u32::try_from(bit).expect("a row's bit offset fits in 32 bits");
        self.mask[i] = (1u32 << bits) - 1;
        self.scale[i] = scale;
        self.min[i] = min;
        self.reach = self.reach.max(bit / 8 + 4);
    }

    /// Values mapped.
    pub fn len(&self) -> usize {
        self.bit.len()
    }

    /// True when no value is mapped.
    pub fn is_empty(&self) -> bool {
        self.bit.is_empty()
    }

    /// Value `i` of `row`: `code · scale + min` (a product, then a sum), or `min` without a
    /// code; bytes past the row's end read as zero.
    #[inline]
    fn value(&self, row: &[u8], i: usize) -> f32 {
        if self.mask[i] == 0 {
            return self.min[i];
        }
        let word = le_word(row, self.bit[i] as usize / 8);
        let code = (word >> (self.bit[i] % 8)) & self.mask[i];
        code as f32 * self.scale[i] + self.min[i]
    }
}

/// `out[i]` = value `i` of a row of mixed-width codes (`codes` says where each sits and how
/// it maps back), in value order: the same bits as dequantising each width's codes with
/// [`dequantize_codes`] and putting them in place. Eight values at a time with AVX2 when
/// `row` holds [`MixedCodes`]'s reach (a row followed by three more bytes always does).
///
/// # Panics
/// When `out` is longer than the map, or a code lies past the end of `row`.
#[allow(unsafe_code)]
pub fn dequantize_mixed(row: &[u8], codes: &MixedCodes, out: &mut [f32]) {
    assert!(out.len() <= codes.len(), "dequantize_mixed: map too short");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::tiles::simd_available() && row.len() >= codes.reach {
        // SAFETY: AVX2 is available; every code's four-byte window lies inside `row`.
        done = unsafe { simd::mixed_eights(row, codes, out) };
    }
    for (i, o) in out.iter_mut().enumerate().skip(done) {
        let bits = 32 - codes.mask[i].leading_zeros() as usize;
        assert!(
            bits == 0 || (codes.bit[i] as usize + bits - 1) / 8 < row.len(),
            "dequantize_mixed: code {i} lies past the row's {} bytes",
            row.len()
        );
        *o = codes.value(row, i);
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd {
    use std::arch::x86_64::{
        __m128i, __m256, __m256i, _mm_loadl_epi64, _mm256_add_ps, _mm256_and_si256,
        _mm256_blendv_ps, _mm256_castsi256_ps, _mm256_cmpeq_epi32, _mm256_cvtepi32_ps,
        _mm256_cvtepu8_epi32, _mm256_i32gather_epi32, _mm256_loadu_ps, _mm256_loadu_si256,
        _mm256_mul_ps, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setr_epi32, _mm256_setzero_si256,
        _mm256_srli_epi32, _mm256_srlv_epi32, _mm256_storeu_ps,
    };

    use super::{Affine, MixedCodes};

    /// Values `0..8k` of `out`'s length rounded down to eights of a row of mixed-width codes;
    /// returns `8k`. Each lane gathers the four bytes from its code's first byte, shifts and
    /// masks its code out, and maps it back; a lane without a code takes its minimum.
    ///
    /// # Safety
    /// AVX2 is available; `row` holds `codes.reach` bytes; `out` is no longer than the map.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn mixed_eights(row: &[u8], codes: &MixedCodes, out: &mut [f32]) -> usize {
        let n = out.len() / 8 * 8;
        let (po, base) = (out.as_mut_ptr(), row.as_ptr().cast::<i32>());
        let seven = _mm256_set1_epi32(7);
        let mut i = 0;
        while i < n {
            // SAFETY: the map and `out` hold at least `n` values, `i + 8 <= n`; every lane's
            // byte offset plus four is within `codes.reach <= row.len()` (lanes without a code
            // read from offset 0).
            unsafe {
                let bit = _mm256_loadu_si256(codes.bit.as_ptr().add(i).cast::<__m256i>());
                let mask = _mm256_loadu_si256(codes.mask.as_ptr().add(i).cast::<__m256i>());
                let words = _mm256_i32gather_epi32::<1>(base, _mm256_srli_epi32::<3>(bit));
                let shift = _mm256_and_si256(bit, seven);
                let code = _mm256_and_si256(_mm256_srlv_epi32(words, shift), mask);
                let s = _mm256_loadu_ps(codes.scale.as_ptr().add(i));
                let m = _mm256_loadu_ps(codes.min.as_ptr().add(i));
                let v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(code), s), m);
                let none = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mask, _mm256_setzero_si256()));
                _mm256_storeu_ps(po.add(i), _mm256_blendv_ps(v, m, none));
            }
            i += 8;
        }
        n
    }

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
        // SAFETY: (every arm) as the caller's; the width is the arm's.
        unsafe {
            match bits {
                1 => eights_of::<1>(packed, affine, out),
                2 => eights_of::<2>(packed, affine, out),
                3 => eights_of::<3>(packed, affine, out),
                4 => eights_of::<4>(packed, affine, out),
                5 => eights_of::<5>(packed, affine, out),
                6 => eights_of::<6>(packed, affine, out),
                7 => eights_of::<7>(packed, affine, out),
                _ => eights_of::<8>(packed, affine, out),
            }
        }
    }

    /// [`super::le_word`] as the signed lane type the shifts take (the same bits).
    #[inline(always)]
    fn word(packed: &[u8], at: usize) -> i32 {
        super::le_word(packed, at) as i32
    }

    /// Codes `i..i + 8` of `B` bits each (`i` a multiple of 8) as f32 lanes: their `B` bytes,
    /// four read at once where the run has them; from 5 bits the last four codes come from a
    /// second word starting at the byte that holds the fifth code's first bit.
    ///
    /// # Safety
    /// AVX2 is available; `packed` holds codes `i..i + 8`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn codes_of<const B: u32>(packed: &[u8], i: usize) -> __m256 {
        let b = B as usize;
        let at = i / 8 * b;
        let mask = _mm256_set1_epi32((1i32 << B) - 1);
        let bi = B as i32;
        let c = if B == 8 {
            let bytes: &[u8; 8] = packed[at..at + 8].try_into().expect("eight bytes");
            // SAFETY: `bytes` holds 8 bytes.
            _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(bytes.as_ptr().cast::<__m128i>()) })
        } else if B >= 5 {
            let (half_at, h) = ((4 * b) / 8, ((4 * B) % 8) as i32);
            let shifts =
                _mm256_setr_epi32(0, bi, 2 * bi, 3 * bi, h, h + bi, h + 2 * bi, h + 3 * bi);
            let (lo, hi) = (word(packed, at), word(packed, at + half_at));
            let words = _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi);
            _mm256_and_si256(_mm256_srlv_epi32(words, shifts), mask)
        } else {
            let shifts = _mm256_setr_epi32(0, bi, 2 * bi, 3 * bi, 4 * bi, 5 * bi, 6 * bi, 7 * bi);
            let w = word(packed, at);
            _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), shifts), mask)
        };
        _mm256_cvtepi32_ps(c)
    }

    /// [`eights`] for codes of `B` bits.
    ///
    /// # Safety
    /// As [`eights`]'s.
    #[target_feature(enable = "avx2")]
    unsafe fn eights_of<const B: u32>(packed: &[u8], affine: Affine<'_>, out: &mut [f32]) -> usize {
        let n = out.len() / 8 * 8;
        let po = out.as_mut_ptr();
        let mut i = 0;
        match affine {
            Affine::Group { scale, min } => {
                let (s, m) = (_mm256_set1_ps(scale), _mm256_set1_ps(min));
                while i < n {
                    // SAFETY: `i + 8 <= n <= out.len()`, and `packed` holds those codes.
                    unsafe {
                        let c = codes_of::<B>(packed, i);
                        _mm256_storeu_ps(po.add(i), _mm256_add_ps(_mm256_mul_ps(c, s), m));
                    }
                    i += 8;
                }
            }
            Affine::PerCode { scale, min } => {
                while i < n {
                    // SAFETY: the maps and `out` hold at least `n` values, `i + 8 <= n`.
                    unsafe {
                        let c = codes_of::<B>(packed, i);
                        let s = _mm256_loadu_ps(scale.as_ptr().add(i));
                        let m = _mm256_loadu_ps(min.as_ptr().add(i));
                        _mm256_storeu_ps(po.add(i), _mm256_add_ps(_mm256_mul_ps(c, s), m));
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
    fn mixed_widths_give_each_width_s_codes_bit_for_bit() {
        // Widths 8 down to 0 in groups, each group from a byte boundary, values in an order
        // that is not the groups' (as a mixed block of keys lays them out).
        let widths: Vec<u32> = (0..61)
            .map(|i| [3, 8, 0, 1, 5, 2, 7, 4, 6][i % 9])
            .collect();
        let rows = 3;
        let mut packed = Vec::new();
        let mut map = MixedCodes::new();
        map.reset(widths.len());
        let code = |r: usize, i: usize, b: u32| ((r * 53 + i * 29 + 7) % (1 << b)) as u8;
        let scale: Vec<f32> = (0..61).map(|i| 0.02 * (i as f32 + 1.0).sqrt()).collect();
        let min: Vec<f32> = (0..61)
            .map(|i| if i == 2 { -0.0 } else { (i as f32 * 0.7).cos() })
            .collect();
        let row_bytes: usize = (0..=8u32)
            .map(|b| (widths.iter().filter(|&&w| w == b).count() * b as usize).div_ceil(8))
            .sum();
        for r in 0..rows {
            let mut at_bit = 0;
            for b in (1..=8u32).rev() {
                let members: Vec<usize> = (0..61).filter(|&i| widths[i] == b).collect();
                let codes: Vec<u8> = members.iter().map(|&i| code(r, i, b)).collect();
                if r == 0 {
                    for (k, &i) in members.iter().enumerate() {
                        map.set(i, (at_bit + k * b as usize, b), scale[i], min[i]);
                    }
                }
                packed.extend(pack(&codes, b));
                at_bit += (members.len() * b as usize).div_ceil(8) * 8;
            }
            for i in (0..61).filter(|&i| widths[i] == 0) {
                map.set(i, (0, 0), scale[i], min[i]);
            }
        }
        for tail in [3, 0] {
            let mut rows_buf = packed.clone();
            rows_buf.extend(std::iter::repeat_n(0, tail));
            for r in 0..rows {
                let row = &rows_buf[r * row_bytes..];
                let mut out = vec![f32::NAN; 61];
                dequantize_mixed(row, &map, &mut out);
                for (i, &o) in out.iter().enumerate() {
                    let want = if widths[i] == 0 {
                        min[i]
                    } else {
                        f32::from(code(r, i, widths[i])) * scale[i] + min[i]
                    };
                    assert_eq!(
                        o.to_bits(),
                        want.to_bits(),
                        "row {r}, value {i}, tail {tail}"
                    );
                }
            }
        }
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
