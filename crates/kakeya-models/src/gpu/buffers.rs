//! How many bytes one buffer may hold on a device ([`max_buffer_bytes`]): a weight larger than
//! that is held in row blocks ([`crate::linear::Linear::within`]).

use burn::tensor::Device;

/// The largest buffer the device allocates (and binds to a kernel), in bytes: on a CubeCL
/// device without Burn's fusion, CubeCL's page limit (the smaller of the device's buffer and
/// storage-binding limits on wgpu: 128 MiB on Mesa's lavapipe, WebGPU's default; a GPU's
/// memory on CUDA), or less where `KAKEYA_GPU_MAX_BUFFER_BYTES` says so (to run the row
/// blocks on a device that would not need them). `None` elsewhere (the CPU, or under fusion,
/// which hides the client).
pub fn max_buffer_bytes(device: &Device) -> Option<u64> {
    let asked = std::env::var("KAKEYA_GPU_MAX_BUFFER_BYTES")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    device_max(device).map(|max| asked.map_or(max, |a| a.min(max)))
}

/// Whether `bytes` fit one buffer on `device` ([`max_buffer_bytes`]; always on the CPU).
pub fn fits_one_buffer(device: &Device, bytes: u64) -> bool {
    max_buffer_bytes(device).is_none_or(|max| bytes <= max)
}

/// The device's own limit ([`max_buffer_bytes`]).
fn device_max(device: &Device) -> Option<u64> {
    #[cfg(all(feature = "cube", not(feature = "fusion")))]
    {
        use burn::backend::{BackendTensor, DispatchTensorKind};
        if !super::is_gpu(device) {
            return None;
        }
        let probe = burn::tensor::Tensor::<1>::zeros([1], &device.clone().without_autodiff());
        if let DispatchTensorKind::Cube(BackendTensor::Float(t)) = probe.into_dispatch().kind {
            return Some(t.client.properties().memory.max_page_size);
        }
        None
    }
    #[cfg(not(all(feature = "cube", not(feature = "fusion"))))]
    {
        let _ = device;
        None
    }
}
