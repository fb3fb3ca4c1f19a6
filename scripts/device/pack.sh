#!/bin/bash
# Packs what a GPU run needs for the lent NVIDIA machine (`device` tool), whose working tree
# travels in at most 64 MiB per call. Writes .xfer/ (git-ignored through .git/info/exclude):
# parts of $PART bytes (default 41M; 62M once `scripts/device/slim.sh on` has shrunk the tree
# that travels), the payload's hash and the device-side script.
#
#   infer:   scripts/device/pack.sh infer <kakeya --features cuda> <golden test binary, cuda> \
#                [a second kakeya to compare, e.g. --features cuda,fusion]
#            a CUDA kakeya (and the second, when given), the golden
#            test (kakeya-runtime `--features cuda --test golden`),
#            the verifier GGUF + tokenizer, the default drafter and the `gguf` wheel that
#            transformers needs to read the GGUF; run_infer.sh runs the checks.
#   profile: scripts/device/pack.sh profile <kakeya --features cuda> [baseline kakeya] [test binaries...]
#            the default model's config and tensor shapes (no weights) and its tokenizer;
#            run_profile.sh times decode and prefill on random weights of those shapes (beside the
#            baseline build when given, alternating, and transformers on the same weights), runs
#            the test binaries (built with --features cuda) with KAKEYA_TEST_DEVICE=cuda, then
#            profiles decode steps.
#   all:     [ALT=<kakeya --features cuda,fusion>] scripts/device/pack.sh all \
#                <kakeya --features cuda> <golden test binary, cuda> [more test binaries, cuda...]
#            one run of everything a GPU session measures on the default model
#            (run_all.sh): f_θ step time (FTHETA_DATA, default data/capture-f-theta-270m-s8:
#            a capture of the first 8 prompts with the v2 drafter; with the fused build too),
#            the golden test, the further test binaries with KAKEYA_TEST_DEVICE=cuda (e.g.
#            kakeya-runtime's wgpu_device and wgpu_replay, kakeya-models' gpu_kernels and gpu_attention; the Gemma 4 fixtures go
#            along), AR and speculative decoding (the default settings: the v3 drafter
#            and the n-gram table), `kakeya serve`'s load test on the GPU, the drafter's capture
#            and step time, and transformers on the same GGUF.
#   f-theta: scripts/device/pack.sh f-theta <kakeya --features cuda> [kakeya --features cuda,fusion]
#            the small f_θ capture (FTHETA_DATA) and the step-time config (FTHETA_STEPS steps,
#            default 60); run.sh times f_θ training steps with each build.
#
# Build: cargo build --release -p kakeya-cli --features cuda (strip the binaries).
# Then one device call per part, within 30 s of each other (the machine stays warm that long):
#   mkdir -p /tmp/x && mv .xfer/parts/pN /tmp/x/     (carry .xfer/parts/pN)
# and last: bash .xfer/run.sh   (carry .xfer/parts/<last>, .xfer/run.sh, .xfer/unpack.sh, .xfer/payload.sha)
set -euo pipefail
mode=${1:?usage: pack.sh infer|profile|all|f-theta <kakeya built with --features cuda> [golden test binary]}
bin=${2:?usage: pack.sh infer|profile|all|f-theta <kakeya built with --features cuda> [golden test binary]}
bin=$(realpath "$bin")
case $mode in
infer) golden=$(realpath "${3:?$mode needs the golden test binary}"); alt=${4:+$(realpath "$4")};;
all) golden=$(realpath "${3:?$mode needs the golden test binary}"); alt=${ALT:+$(realpath "$ALT")}
    tests=(); for t in "${@:4}"; do tests+=("$(realpath "$t")"); done;;
profile) base=${3:+$(realpath "$3")}; tests=(); for t in "${@:4}"; do tests+=("$(realpath "$t")"); done;;
f-theta) alt=${3:+$(realpath "$3")};;
esac
# f_θ's step-time run: the small capture made with the v2 drafter (FTHETA_DATA), the drafter
# itself (its hash is checked against the capture's), and the 270M config pointed at them.
stage_f_theta() {
    local ds=${FTHETA_DATA:-data/capture-f-theta-270m-s8}
    [ -f "$ds/manifest.json" ] || { echo "pack.sh: no f_θ capture at $ds (make it: kakeya capture --config configs/capture/f-theta-270m-s8.toml)" >&2; exit 2; }
    cp -r "$ds" .xfer/stage/ds
    [ -d .xfer/stage/drafter ] || cp -r checkpoints/drafter-gemma3-270m-v2 .xfer/stage/drafter
    sed -e "s#data/capture-f-theta-270m#/tmp/x/ds#" -e 's#checkpoints/drafter-gemma3-270m"#checkpoints/drafter-gemma3-270m-v2"#' \
        -e "s#^steps = .*#steps = ${FTHETA_STEPS:-60}#" -e 's#^warmup_steps = .*#warmup_steps = 10#' \
        -e 's#runs/train-f-theta-270m#/tmp/x/ft-run#' -e 's#runs/f-theta-gemma3-270m#/tmp/x/ft-export#' \
        -e 's#^checkpoint_every = .*#checkpoint_every = 1000#' -e 's#^eval_every = .*#eval_every = 1000#' \
        configs/train/f-theta-270m.toml > .xfer/stage/ft.toml
}
# Test binaries built with --features cuda, run on the device with KAKEYA_TEST_DEVICE=cuda; the
# device equivalences (tests/wgpu_device.rs) read the Gemma 4 fixtures.
stage_tests() {
    for t in "${tests[@]}"; do xz -T2 -6 -c "$t" > ".xfer/stage/test-$(basename "$t" | sed 's/-[0-9a-f]*$//').xz"; done
    [ ${#tests[@]} -eq 0 ] || cp -r tests/fixtures/gemma4 .xfer/stage/fixtures-gemma4
}
cd "$(dirname "$0")/../.."
mkdir -p .git/info && grep -qx '/.xfer/' .git/info/exclude 2>/dev/null || echo '/.xfer/' >> .git/info/exclude
rm -rf .xfer && mkdir -p .xfer/stage .xfer/parts
xz -T2 -6 -c "$bin" > .xfer/stage/kakeya-cuda.xz
case $mode in
infer)
    cp models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf .xfer/stage/verifier.gguf
    xz -T2 -6 -c "$golden" > .xfer/stage/golden-cuda.xz
    [ -z "$alt" ] || xz -T2 -6 -c "$alt" > .xfer/stage/kakeya-alt.xz
    xz -T2 -6 -c models/gemma-3-270m/tokenizer.json > .xfer/stage/tokenizer.json.xz
    cp -r checkpoints/drafter-gemma3-270m-v2 .xfer/stage/drafter
    python3 -m pip download -q --no-deps --only-binary=:all: -d .xfer/stage/whl gguf==0.19.0
    echo "root_at_build=$(pwd)" > .xfer/stage/build-root
    cp scripts/device/run_infer.sh .xfer/run.sh
    ;;
profile)
    # The default model's config and tensor shapes (random weights are drawn on the device).
    tmp=$(mktemp -d)
    "$bin" convert --model models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf --out "$tmp/hf" --tokenizer /dev/null
    cp "$tmp/hf/config.json" .xfer/stage/
    python3 - "$tmp/hf/model.safetensors" .xfer/stage/spec.json <<'PY'
import json, struct, sys
f = open(sys.argv[1], 'rb'); n = struct.unpack('<Q', f.read(8))[0]; h = json.loads(f.read(n))
json.dump({k: v['shape'] for k, v in h.items() if k != '__metadata__'}, open(sys.argv[2], 'w'))
PY
    rm -rf "$tmp"
    xz -T2 -6 -c models/gemma-3-270m/tokenizer.json > .xfer/stage/tokenizer.json.xz
    [ -z "$base" ] || xz -T2 -6 -c "$base" > .xfer/stage/kakeya-base.xz
    stage_tests
    cp scripts/device/run_profile.sh .xfer/run.sh
    ;;
all)
    cp models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf .xfer/stage/verifier.gguf
    stage_f_theta
    xz -T2 -6 -c "$golden" > .xfer/stage/golden-cuda.xz
    [ -z "$alt" ] || xz -T2 -6 -c "$alt" > .xfer/stage/kakeya-alt.xz
    stage_tests
    xz -T2 -6 -c models/gemma-3-270m/tokenizer.json > .xfer/stage/tokenizer.json.xz
    python3 -m pip download -q --no-deps --only-binary=:all: -d .xfer/stage/whl gguf==0.19.0
    echo "root_at_build=$(pwd)" > .xfer/stage/build-root
    # The drafter: a capture of 64 prompts' greedy continuations with the 10x set's layers, then
    # training steps of the 10x config.
    mkdir -p .xfer/stage/corpus && cp data/corpus/general.jsonl .xfer/stage/corpus/
    python3 - configs/capture/drafter-270m-large.toml .xfer/stage/dcap.toml <<'PY'
import re, sys
s = open(sys.argv[1]).read()
s = re.sub(r'(?m)^continuations = .*\n', '', s)
s = s.replace('data/capture-drafter-270m-large', '/tmp/x/dcap')
s = s[:s.index('[[sources]]')] + '[[sources]]\nkind = "jsonl"\npath = "/tmp/x/corpus/general.jsonl"\nlimit = 64\n'
open(sys.argv[2], 'w').write(s)
PY
    sed -e 's#data/capture-drafter-270m-large#/tmp/x/dcap#' -e 's#^heldout_every = .*#heldout_every = 8#' \
        -e 's#^steps = .*#steps = 60#' -e 's#^warmup_steps = .*#warmup_steps = 10#' \
        -e 's#runs/train-drafter-270m-large#/tmp/x/dr-run#' -e 's#runs/drafter-270m-large#/tmp/x/dr-export#' \
        -e 's#^checkpoint_every = .*#checkpoint_every = 1000#' -e 's#^eval_every = .*#eval_every = 1000#' \
        -e 's#^eval_anchors = .*#eval_anchors = 64#' \
        configs/train/drafter-270m-large.toml > .xfer/stage/dtrain.toml
    # The default settings' speculation (the v3 drafter and the n-gram table), and the load test
    # for `kakeya serve` on the GPU.
    cp -r checkpoints/drafter-gemma3-270m-v3 .xfer/stage/drafter-v3
    cp checkpoints/ngram-gemma3-270m.bin .xfer/stage/ngram.bin
    cp scripts/load_test.py .xfer/stage/
    cp scripts/device/run_all.sh .xfer/run.sh
    ;;
f-theta)
    cp models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf .xfer/stage/verifier.gguf
    [ -z "$alt" ] || xz -T2 -6 -c "$alt" > .xfer/stage/kakeya-alt.xz
    stage_f_theta
    cp scripts/device/run.sh .xfer/run.sh
    ;;
*) echo "pack.sh: unknown mode $mode (infer, profile, all or f-theta)" >&2; exit 2;;
esac
(cd .xfer/stage && tar cf ../payload.tar .)
rm -rf .xfer/stage
(cd .xfer && sha256sum payload.tar | cut -d' ' -f1 > payload.sha && cd parts && split -b "${PART:-41M}" -d -a 1 ../payload.tar p)
rm .xfer/payload.tar
cp scripts/device/unpack.sh .xfer/unpack.sh
ls -l .xfer/parts
