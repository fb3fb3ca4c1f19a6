//! Activations the models use that Burn computes slowly on the CPU (the host rows' gated GELU
//! is `kakeya_kernels::activation::gelu_tanh_mul`).

use burn::tensor::Tensor;
use burn::tensor::activation::sigmoid;

/// `√(2/π)`.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

/// GELU, tanh approximation (PyTorch `gelu(approximate="tanh")`, Gemma's `gelu_pytorch_tanh`):
/// `0.5·x·(1 + tanh(u))` with `u = √(2/π)·(x + 0.044715·x³)`, computed as `x·σ(2u)` — the same
/// function, since `0.5·(1 + tanh(u)) = σ(2u)` — with `x³` as products. Burn's
/// `gelu_approximate` evaluates `powf` and `tanh` per element; this form needs one `exp` per
/// element. The two agree to float rounding
/// (tested).
///
/// # Shapes
/// - `x`: any → the same
pub fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let x3 = x.clone() * x.clone() * x.clone();
    let u2 = (x.clone() + x3.mul_scalar(0.044_715)).mul_scalar(2.0 * SQRT_2_OVER_PI);
    x * sigmoid(u2)
}

#[cfg(test)]
mod tests {
    use burn::tensor::activation::gelu_approximate;
    use burn::tensor::{Device, Tensor, TensorData};

    use super::gelu_tanh;

    #[test]
    fn equals_the_tanh_form_to_rounding() {
        let xs: Vec<f32> = (-4000..=4000).map(|i| i as f32 * 0.005).collect();
        let n = xs.len();
        let t = Tensor::<1>::from_data(TensorData::new(xs.clone(), [n]), &Device::flex());
        let got = gelu_tanh(t.clone())
            .into_data()
            .try_into_vec::<f32>()
            .unwrap();
        let want = gelu_approximate(t)
            .into_data()
            .try_into_vec::<f32>()
            .unwrap();
        for ((x, g), w) in xs.iter().zip(&got).zip(&want) {
            // f64 reference of the formula.
            let xd = f64::from(*x);
            let u = 0.797_884_560_802_865_4 * (xd + 0.044_715 * xd * xd * xd);
            let exact = 0.5 * xd * (1.0 + u.tanh());
            let tol = 4e-7 * exact.abs().max(1.0);
            assert!(
                (f64::from(*g) - exact).abs() <= tol,
                "x = {x}: {g} vs {exact}"
            );
            assert!(
                (f64::from(*w) - exact).abs() <= tol,
                "burn, x = {x}: {w} vs {exact}"
            );
        }
    }
}
