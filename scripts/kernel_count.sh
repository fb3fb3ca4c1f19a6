#!/usr/bin/env bash
# Kernels one decode step launches on a GPU device, with and without Burn's kernel fusion: the
# tiny Gemma 3 (6 layers) decoding on wgpu over Mesa's lavapipe (no GPU needed; the launches are
# Burn's, the same on CUDA), with CubeCL's kernel log on (cubecl.toml, level "minimal": one line
# per launch, no timing). Each build runs `decode_steps_for_the_kernel_count` (kakeya-runtime's
# tests/wgpu_device.rs) at 4 and 12 tokens; the difference over 8 is one step's launches.
# KAKEYA_FEATURES picks the builds (default "wgpu wgpu,fusion").
# Needs: apt-get install mesa-vulkan-drivers libvulkan1. Writes runs/kernel-count/<features>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
export VK_ICD_FILENAMES
VK_ICD_FILENAMES=$(ls /usr/share/vulkan/icd.d/lvp_icd*.json | head -n 1)
mkdir -p runs/kernel-count
for features in ${KAKEYA_FEATURES:-wgpu wgpu,fusion}; do
    bin=$(cargo test -p kakeya-runtime --features "$features" --locked --test wgpu_device --no-run 2>&1 \
        | sed -n 's/.*Executable tests\/wgpu_device.rs (\(.*\))/\1/p')
    declare -A launches=()
    for steps in 4 12; do
        dir=$(mktemp -d)
        printf '[profiling.logger]\nlevel = "minimal"\nfile = "%s/kernels.log"\n' "$dir" > "$dir/cubecl.toml"
        (cd "$dir" && KAKEYA_DECODE_STEPS=$steps "$OLDPWD/$bin" --ignored --exact decode_steps_for_the_kernel_count -q >/dev/null)
        launches[$steps]=$(grep -c "Executing" "$dir/kernels.log" || true)
        rm -rf "$dir"
    done
    per_step=$(( (launches[12] - launches[4]) / 8 ))
    echo "$features: ${launches[4]} launches for 4 tokens, ${launches[12]} for 12: $per_step per decode step (6 layers)" \
        | tee "runs/kernel-count/${features/,/-}.txt"
done
