//! Helpers of the GPU kernel tests (`gpu_kernels.rs`, `gpu_attention.rs`).
#![allow(dead_code)]

use burn::tensor::{Device, Tensor, TensorData};
use kakeya_models::gpu;
use kakeya_models::testing::test_device;

/// Deterministic values in about [-2, 2].
pub fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h = (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503))
                .wrapping_mul(2_246_822_519);
            (h >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
        })
        .collect()
}

pub fn tensor<const D: usize>(v: Vec<f32>, shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::from_data(TensorData::new(v, shape), device)
}

pub fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec::<f32>().unwrap()
}

pub fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
        .fold(0.0, f32::max)
}

pub fn device() -> Device {
    let d = test_device();
    let probe = Tensor::<1>::zeros([1], &d);
    assert!(
        gpu::applies(&probe),
        "run with KAKEYA_TEST_DEVICE=wgpu (or cuda): the kernels only run on a GPU device"
    );
    d
}
