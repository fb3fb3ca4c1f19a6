#!/usr/bin/env bash
# Kernels a GPU device launches, with and without Burn's kernel fusion, counted on wgpu over
# Mesa's lavapipe (no GPU needed; the launches are Burn's and Kakeya's, the same on CUDA) with
# CubeCL's kernel log on (cubecl.toml, level "minimal": one line per launch, no timing).
#   scripts/kernel_count.sh [decode]   one decode step of the tiny Gemma 3 (6 layers):
#       `decode_steps_for_the_kernel_count` (kakeya-runtime's tests/wgpu_replay.rs) at 4 and 12
#       tokens; the difference over 8 is one step's launches.
#   scripts/kernel_count.sh batch      one batched decode step of 8 sequences (the server's
#       stacked forward): `batched_decode_steps_for_the_kernel_count` (same test file) at 4 and
#       12 tokens each, KAKEYA_DECODE_SEQS sequences (default 8).
#   scripts/kernel_count.sh draft      one draft of the drafter (2 layers, a block of 8 over a
#       store of 40 rows): `drafts_for_the_kernel_count` (same test file) at 4 and 12 drafts.
#   scripts/kernel_count.sh spec       one speculative block (fixed blocks of 8 whose drafts
#       are all rejected: a block a token): `speculative_blocks_for_the_kernel_count` at 12 and
#       20 tokens.
#   scripts/kernel_count.sh f-theta    one f_θ training step (tiny verifier, the trainer's
#       layout: stacked layers, the step's sequences in one padded pass, AdamW):
#       `f_theta_steps_for_the_kernel_count` (kakeya-train's tests/train_f_theta.rs) at 6 and 10
#       steps; the difference over 4.
# KAKEYA_FEATURES picks the builds (default "wgpu wgpu,fusion"); KAKEYA_DECODE_GRAPH=0 counts
# decode steps and drafts issued kernel by kernel instead of replayed; KAKEYA_DRAFT_GRAPH=0 the
# drafter's alone (spec).
# Needs: apt-get install mesa-vulkan-drivers libvulkan1. Writes runs/kernel-count/<what>-<features>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-decode}
case $what in
decode) pkg=kakeya-runtime; test=wgpu_replay; probe=decode_steps_for_the_kernel_count
    var=KAKEYA_DECODE_STEPS; lo=4; hi=12; unit="decode step (6 layers)";;
batch) pkg=kakeya-runtime; test=wgpu_replay; probe=batched_decode_steps_for_the_kernel_count
    var=KAKEYA_DECODE_STEPS; lo=4; hi=12; unit="batched decode step (${KAKEYA_DECODE_SEQS:=8} sequences, 6 layers)"
    export KAKEYA_DECODE_SEQS;;
draft) pkg=kakeya-runtime; test=wgpu_replay; probe=drafts_for_the_kernel_count
    var=KAKEYA_DECODE_STEPS; lo=4; hi=12; unit="draft (block of 8, 2 drafter layers)";;
spec) pkg=kakeya-runtime; test=wgpu_replay; probe=speculative_blocks_for_the_kernel_count
    var=KAKEYA_DECODE_STEPS; lo=12; hi=20; unit="speculative block (verify, draft, store row; 6 + 2 layers)";;
f-theta) pkg=kakeya-train; test=train_f_theta; probe=f_theta_steps_for_the_kernel_count
    var=KAKEYA_FTHETA_STEPS; lo=6; hi=10; unit="f_θ training step";;
*) echo "kernel_count.sh: decode, batch, draft, spec or f-theta, not $what" >&2; exit 2;;
esac
export VK_ICD_FILENAMES
VK_ICD_FILENAMES=$(ls /usr/share/vulkan/icd.d/lvp_icd*.json | head -n 1)
mkdir -p runs/kernel-count
for features in ${KAKEYA_FEATURES:-wgpu wgpu,fusion}; do
    bin=$(cargo test -p $pkg --features "$features" --locked --test $test --no-run 2>&1 \
        | sed -n "s/.*Executable tests\/$test.rs (\(.*\))/\1/p")
    declare -A launches=()
    for steps in $lo $hi; do
        dir=$(mktemp -d)
        printf '[profiling.logger]\nlevel = "minimal"\nfile = "%s/kernels.log"\n' "$dir" > "$dir/cubecl.toml"
        (cd "$dir" && env KAKEYA_TEST_DEVICE=wgpu $var=$steps "$OLDPWD/$bin" --ignored --exact $probe -q >/dev/null)
        launches[$steps]=$(grep -c "Executing" "$dir/kernels.log" || true)
        rm -rf "$dir"
    done
    per_step=$(( (launches[$hi] - launches[$lo]) / (hi - lo) ))
    suffix=${features/,/-}
    [ "$what" = decode ] || suffix="$what-$suffix"
    [ "$what" != batch ] || suffix="$suffix-$KAKEYA_DECODE_SEQS"
    [ "${KAKEYA_DECODE_GRAPH:-1}" != 0 ] || suffix="$suffix-nograph"
    [ "${KAKEYA_DRAFT_GRAPH:-1}" != 0 ] || suffix="$suffix-nodraftgraph"
    echo "$features: ${launches[$lo]} launches for $lo, ${launches[$hi]} for $hi: $per_step per $unit" \
        | tee "runs/kernel-count/$suffix.txt"
done
