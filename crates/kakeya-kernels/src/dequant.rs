//! GGML block formats and their dequantisation to f32.
//!
//! The layouts follow ggml's `ggml-common.h` (block structs) and the reference
//! `dequantize_row_*` routines of `ggml-quants.c`; the PyPI `gguf` package's
//! `gguf/quants.py` implements the same formulas and is the oracle of this module's tests
//! (`tests/fixtures/dequant/`).

/// A GGML tensor element type, as stored in a GGUF tensor info.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    Bf16,
    /// 32 weights: f16 scale + 4-bit values, offset -8.
    Q4_0,
    /// 32 weights: f16 scale and min + 4-bit values.
    Q4_1,
    /// 32 weights: f16 scale + 5-bit values, offset -16.
    Q5_0,
    /// 32 weights: f16 scale and min + 5-bit values.
    Q5_1,
    /// 32 weights: f16 scale + 8-bit signed values.
    Q8_0,
    /// 256-weight super-block: 8 sub-blocks of 32 with 6-bit scales and mins, 4-bit values.
    Q4K,
    /// 256-weight super-block: as Q4_K with a fifth bit per value.
    Q5K,
    /// 256-weight super-block: 16 sub-blocks of 16 with 8-bit scales, 6-bit values.
    Q6K,
}

impl GgmlType {
    /// The type for a raw GGML type id, or `None` when this crate cannot decode it.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::Bf16,
            _ => return None,
        })
    }

    /// The name ggml gives a raw type id (for error messages), also for types we cannot decode.
    pub fn name_of_id(id: u32) -> &'static str {
        const NAMES: [&str; 42] = [
            "F32",
            "F16",
            "Q4_0",
            "Q4_1",
            "Q4_2",
            "Q4_3",
            "Q5_0",
            "Q5_1",
            "Q8_0",
            "Q8_1",
            "Q2_K",
            "Q3_K",
            "Q4_K",
            "Q5_K",
            "Q6_K",
            "Q8_K",
            "IQ2_XXS",
            "IQ2_XS",
            "IQ3_XXS",
            "IQ1_S",
            "IQ4_NL",
            "IQ3_S",
            "IQ2_S",
            "IQ4_XS",
            "I8",
            "I16",
            "I32",
            "I64",
            "F64",
            "IQ1_M",
            "BF16",
            "Q4_0_4_4",
            "Q4_0_4_8",
            "Q4_0_8_8",
            "TQ1_0",
            "TQ2_0",
            "IQ4_NL_4_4",
            "IQ4_NL_4_8",
            "IQ4_NL_8_8",
            "MXFP4",
            "NVFP4",
            "Q1_0",
        ];
        NAMES.get(id as usize).copied().unwrap_or("unknown")
    }

    /// The raw GGML type id.
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::Bf16 => 30,
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::Bf16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// Bytes that `n` elements occupy, or `None` when `n` is not a whole number of blocks or
    /// the byte count overflows (a corrupt header's dims).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        let be = self.block_elems();
        if !n.is_multiple_of(be) {
            return None;
        }
        (n / be).checked_mul(self.block_bytes())
    }
}

/// Exact IEEE half → f32, inlinable into the SIMD kernels (the `half` crate's conversion is an
/// out-of-line, runtime-dispatched call, too costly once per 32 weights).
#[inline(always)]
fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let mant = (h & 0x3ff) as u32;
    match exp {
        0 => {
            // Zero or subnormal: mant · 2^-24, exact in f32.
            let v = mant as f32 * (1.0 / 16_777_216.0);
            if sign != 0 { -v } else { v }
        }
        31 => f32::from_bits(sign | 0x7f80_0000 | (mant << 13)),
        _ => f32::from_bits(sign | ((exp + 112) << 23) | (mant << 13)),
    }
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// Runs a block decoder over whole blocks: `$bb` bytes → `$be` values. Fixed-size arrays let
/// the compiler drop bounds checks, and direct calls (not function values) let the decoders
/// inline into the SIMD-enabled kernels of [`crate::quant`].
macro_rules! decode_blocks {
    ($data:expr, $out:expr, $bb:literal, $be:literal, |$b:ident, $y:ident| $body:expr) => {{
        let (bs, _) = $data.as_chunks::<$bb>();
        let (ys, _) = $out.as_chunks_mut::<$be>();
        for ($b, $y) in bs.iter().zip(ys) {
            $body;
        }
    }};
}

/// Dequantises `data` (exactly `ty.bytes_for(out.len())` bytes) into `out`.
///
/// # Panics
/// If the lengths disagree; callers check them against the tensor info first.
#[inline(always)]
pub fn dequantize_into(ty: GgmlType, data: &[u8], out: &mut [f32]) {
    assert_eq!(
        Some(data.len()),
        ty.bytes_for(out.len()),
        "dequantize_into: length mismatch"
    );
    match ty {
        GgmlType::F32 => decode_blocks!(data, out, 4, 1, |b, y| y[0] = f32::from_le_bytes(*b)),
        GgmlType::F16 => decode_blocks!(data, out, 2, 1, |b, y| y[0] =
            f16_bits_to_f32(u16::from_le_bytes(*b))),
        GgmlType::Bf16 => decode_blocks!(data, out, 2, 1, |b, y| y[0] =
            half::bf16::from_le_bytes(*b).to_f32()),
        GgmlType::Q4_0 => decode_blocks!(data, out, 18, 32, |b, y| block_q4_0(b, y)),
        GgmlType::Q4_1 => decode_blocks!(data, out, 20, 32, |b, y| block_q4_1(b, y)),
        GgmlType::Q5_0 => decode_blocks!(data, out, 22, 32, |b, y| block_q5_0(b, y)),
        GgmlType::Q5_1 => decode_blocks!(data, out, 24, 32, |b, y| block_q5_1(b, y)),
        GgmlType::Q8_0 => decode_blocks!(data, out, 34, 32, |b, y| block_q8_0(b, y)),
        GgmlType::Q4K => decode_blocks!(data, out, 144, 256, |b, y| block_q4_k(b, y)),
        GgmlType::Q5K => decode_blocks!(data, out, 176, 256, |b, y| block_q5_k(b, y)),
        GgmlType::Q6K => decode_blocks!(data, out, 210, 256, |b, y| block_q6_k(b, y)),
    }
}

/// Dequantises `data` holding `n` elements of type `ty`.
pub fn dequantize(ty: GgmlType, data: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    dequantize_into(ty, data, &mut out);
    out
}

// Layout: d: f16, qs: [u8; 16]; low nibbles are elements 0..16, high nibbles 16..32.
#[inline(always)]
fn block_q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

// Layout: d: f16, m: f16, qs: [u8; 16].
#[inline(always)]
fn block_q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0f) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

/// The fifth bits of a Q5 block: bit j of `qh` is the high bit of element j.
#[inline(always)]
fn q5_high(qh: u32, j: usize) -> (u8, u8) {
    let h0 = (((qh >> j) << 4) & 0x10) as u8;
    let h1 = ((qh >> (j + 12)) & 0x10) as u8;
    (h0, h1)
}

// Layout: d: f16, qh: u32 (LE), qs: [u8; 16].
#[inline(always)]
fn block_q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let (h0, h1) = q5_high(qh, j);
        y[j] = (((qs[j] & 0x0f) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

// Layout: d: f16, m: f16, qh: u32 (LE), qs: [u8; 16].
#[inline(always)]
fn block_q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let (h0, h1) = q5_high(qh, j);
        y[j] = ((qs[j] & 0x0f) | h0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) | h1) as f32 * d + m;
    }
}

// Layout: d: f16, qs: [i8; 32].
#[inline(always)]
fn block_q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for (j, yj) in y.iter_mut().enumerate() {
        *yj = (b[2 + j] as i8) as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) packed in the 12 `scales` bytes of a
/// Q4_K / Q5_K super-block.
#[inline(always)]
pub(crate) fn k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

// Layout: d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128].
#[inline(always)]
fn block_q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for chunk in 0..4 {
        let (sc0, m0) = k_scale_min(2 * chunk, scales);
        let (sc1, m1) = k_scale_min(2 * chunk + 1, scales);
        let (d0, min0) = (d * sc0 as f32, dmin * m0 as f32);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let q = &qs[32 * chunk..32 * chunk + 32];
        let out = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            out[l] = d0 * (q[l] & 0x0f) as f32 - min0;
            out[l + 32] = d1 * (q[l] >> 4) as f32 - min1;
        }
    }
}

// Layout: d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128].
#[inline(always)]
fn block_q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for chunk in 0..4 {
        let (sc0, m0) = k_scale_min(2 * chunk, scales);
        let (sc1, m1) = k_scale_min(2 * chunk + 1, scales);
        let (d0, min0) = (d * sc0 as f32, dmin * m0 as f32);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (u0, u1) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
        let q = &qs[32 * chunk..32 * chunk + 32];
        let out = &mut y[64 * chunk..64 * chunk + 64];
        for l in 0..32 {
            let h0 = if qh[l] & u0 != 0 { 16 } else { 0 };
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            out[l] = d0 * ((q[l] & 0x0f) + h0) as f32 - min0;
            out[l + 32] = d1 * ((q[l] >> 4) + h1) as f32 - min1;
        }
    }
}

// Layout: ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16.
#[inline(always)]
fn block_q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let out = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * (sc[is + k] as i8) as f32;
            out[l] = s(0) * q1 as f32;
            out[l + 32] = s(2) * q2 as f32;
            out[l + 64] = s(4) * q3 as f32;
            out[l + 96] = s(6) * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_is_exact_for_every_bit_pattern() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_bits_to_f32(h);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{h:#06x}: {got} vs {want}"
            );
        }
    }
}
