#!/usr/bin/env bash
# The tiny-model equivalences on the wgpu device over Mesa's lavapipe (a Vulkan driver that runs
# on the CPU): no GPU needed. Installs the driver when missing (Debian/Ubuntu, as root), then
# runs kakeya-runtime's `tests/wgpu_device.rs` (inference, speculative decoding, KV modes),
# `tests/wgpu_replay.rs` (recorded forwards against the forwards issued kernel by kernel) and
# `tests/wgpu_sampling.rs` (sampling on the device), the
# trainer tests of kakeya-train with training on the device, `kakeya serve --device wgpu`
# (kakeya-cli's `tests/serve_device.rs`), kakeya-capture's capture tests with the verifier
# on the device (`KAKEYA_TEST_DEVICE=wgpu`), weights held in row blocks (`tests/wgpu_blocks.rs`)
# and the real default model's golden test against transformers on the device (≈ 7 min: its
# 640 MiB embedding in row blocks, lavapipe holding 128 MiB a buffer),
# both built with `--features wgpu`, writing the output to runs/wgpu/lavapipe-<date>.log. Not
# part of scripts/test.sh (the wgpu builds take ≈ 20 min; CI keeps `cargo check --features
# wgpu`).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y mesa-vulkan-drivers libvulkan1
    else
        echo "test_wgpu: Mesa's lavapipe is missing: apt-get install mesa-vulkan-drivers libvulkan1" >&2
        exit 1
    fi
fi
# lavapipe only, even where a GPU driver is installed too.
export VK_ICD_FILENAMES
VK_ICD_FILENAMES=$(ls /usr/share/vulkan/icd.d/lvp_icd*.json | head -n 1)
python3 scripts/fetch_default_model.py >/dev/null
mkdir -p runs/wgpu
log="runs/wgpu/lavapipe-$(date -u +%Y%m%dT%H%M%SZ).log"
{
    echo "# $(date -u) $(uname -m); VK_ICD_FILENAMES=$VK_ICD_FILENAMES"
    grep -m1 "model name" /proc/cpuinfo || true
    # The GPU decode kernels one by one (kakeya_models::gpu), then the whole model on the device.
    KAKEYA_TEST_DEVICE=wgpu cargo test -p kakeya-models --features wgpu --locked --test gpu_kernels --test gpu_attention --test gpu_sample
    cargo test -p kakeya-runtime --features wgpu --locked --test wgpu_device --test wgpu_replay -- --nocapture --test-threads 1
    # Sampling at a temperature on the device: draws against the host's, speculative against plain.
    KAKEYA_TEST_DEVICE=wgpu cargo test -p kakeya-runtime --features wgpu --locked --test wgpu_sampling
    # Weights larger than one buffer, in row blocks; then the real model on the device.
    KAKEYA_TEST_DEVICE=wgpu cargo test -p kakeya-runtime --features wgpu --locked --test wgpu_blocks -- --nocapture
    KAKEYA_TEST_DEVICE=wgpu cargo test -p kakeya-runtime --features wgpu --locked --test golden -- \
        --include-ignored --exact logits_and_greedy_match_transformers --nocapture
    KAKEYA_TEST_DEVICE=wgpu cargo test -p kakeya-train --features wgpu --locked \
        --test train_f_theta --test gemma4_f_theta --test train_drafter --test gemma4_drafter \
        --test f_theta_steps --test drafter_blocks \
        -- --test-threads 1
    # `kakeya serve --device wgpu`: requests alone and together equal `kakeya infer` on wgpu.
    KAKEYA_TEST_DEVICE=wgpu cargo test -p kakeya-cli --features wgpu --locked --test serve_device
    # Capture with the verifier on the device (the batch-invariance tests stay on the CPU).
    KAKEYA_TEST_DEVICE=wgpu cargo test -p kakeya-capture --features wgpu --locked \
        --test gemma4 --test roundtrip -- --test-threads 1 values_read_back sampled_positions gemma4
} 2>&1 | tee "$log"
echo "test_wgpu: log in $log"
