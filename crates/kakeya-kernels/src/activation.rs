//! Activations over host rows: Gemma's gated GELU (tanh form) with a vectorising `e^x`.

/// `√(2/π)`.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

/// `g ← gelu_tanh(g) · u` elementwise over host rows (Gemma's gated MLP on the CPU): GELU's
/// tanh approximation `0.5·g·(1 + tanh(t))`, `t = √(2/π)·(g + 0.044715·g³)`, computed as
/// `g·σ(2t)` (the same function), with `e^x` from [`exp`] so that the loop vectorises
/// (libm's `expf` is one call per element). Elementwise, so a row's values never depend on
/// the other rows.
pub fn gelu_tanh_mul(g: &mut [f32], u: &[f32]) {
    assert_eq!(
        g.len(),
        u.len(),
        "gelu_tanh_mul: halves of different lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked just above), all the clone needs.
        #[allow(unsafe_code)]
        unsafe {
            gelu_tanh_mul_avx2(g, u)
        };
        return;
    }
    gelu_tanh_mul_any(g, u);
}

/// [`gelu_tanh_mul`] compiled for AVX2 + FMA: the same operations (every fused step is an
/// explicit `mul_add`), so the same bits, eight lanes at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(unsafe_code)]
unsafe fn gelu_tanh_mul_avx2(g: &mut [f32], u: &[f32]) {
    gelu_tanh_mul_any(g, u);
}

#[inline(always)]
fn gelu_tanh_mul_any(g: &mut [f32], u: &[f32]) {
    const C: f32 = (2.0 * SQRT_2_OVER_PI) as f32;
    for (x, &v) in g.iter_mut().zip(u) {
        let x3 = *x * *x * *x;
        let u2 = x3.mul_add(0.044_715, *x) * C;
        *x = *x / (1.0 + exp(-u2)) * v;
    }
}

/// `e^x` in f32 to about one ulp (Cephes' reduction and polynomial), in branch-free arithmetic
/// that vectorises; every fused step is an explicit `mul_add`, so every build computes the
/// same bits. Inputs are clamped to `[-87, 88]`: the result stays a normal float (so `e^x`
/// below `e^-87` reads as `e^-87`, which no caller here can tell from 0).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    /// 1.5 · 2²³: added to a float below 2²², it leaves the nearest integer in the mantissa.
    const SHIFT: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x.mul_add(std::f32::consts::LOG2_E, SHIFT);
    let k = shifted - SHIFT;
    // x − k·ln 2 in two steps (the first product is exact: 0.693359375 has 9 bits).
    let r = k.mul_add(-0.693_359_4, x);
    let r = k.mul_add(2.121_944_4e-4, r);
    let p = 1.987_569_1e-4_f32
        .mul_add(r, 1.398_199_9e-3)
        .mul_add(r, 8.333_452e-3)
        .mul_add(r, 4.166_579_6e-2)
        .mul_add(r, 1.666_666_5e-1)
        .mul_add(r, 0.5);
    let p = (p * r).mul_add(r, r) + 1.0;
    // 2^k from the integer left in `shifted`'s mantissa (k ∈ [-126, 127]: a normal float).
    let bits = (shifted.to_bits() as i32 - SHIFT.to_bits() as i32 + 127) << 23;
    p * f32::from_bits(bits as u32)
}

#[cfg(test)]
mod tests {
    use super::{exp, gelu_tanh_mul};

    #[test]
    fn exp_is_within_two_ulps_of_f64() {
        let mut worst = 0.0f64;
        for i in -870_000..=880_000 {
            let x = i as f32 * 1e-4;
            let (got, want) = (f64::from(exp(x)), f64::from(x).exp());
            let ulp = f64::from(f32::EPSILON) * want;
            worst = worst.max((got - want).abs() / ulp);
        }
        assert!(worst <= 2.0, "{worst} ulps");
        assert_eq!(exp(0.0), 1.0);
        // Clamped ends, and no NaN or infinity for huge inputs.
        assert!(exp(-1000.0) > 0.0 && exp(-1000.0) < 2e-38);
        assert!(exp(1000.0).is_finite());
    }

    #[test]
    fn the_host_gated_gelu_equals_the_tanh_form_to_rounding() {
        let xs: Vec<f32> = (-4000..=4000).map(|i| i as f32 * 0.005).collect();
        let us: Vec<f32> = xs.iter().map(|x| 0.5 - 0.25 * x).collect();
        let mut g = xs.clone();
        gelu_tanh_mul(&mut g, &us);
        for ((x, u), got) in xs.iter().zip(&us).zip(&g) {
            let xd = f64::from(*x);
            let t = 0.797_884_560_802_865_4 * (xd + 0.044_715 * xd * xd * xd);
            let exact = 0.5 * xd * (1.0 + t.tanh()) * f64::from(*u);
            let tol = 1e-6 * exact.abs().max(1.0);
            assert!(
                (f64::from(*got) - exact).abs() <= tol,
                "x = {x}: {got} vs {exact}"
            );
        }
        // Every path gives the same bits: the portable loop against the dispatched one.
        let mut any = xs.clone();
        super::gelu_tanh_mul_any(&mut any, &us);
        assert_eq!(any, g);
    }
}
