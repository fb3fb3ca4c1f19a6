#!/usr/bin/env bash
# Every engine feature on the real default model (Gemma 3 270M) on the wgpu device, each against
# the same run on the CPU (scripts/wgpu_compare.py): the bounded KV modes (`restored` through
# f_θ, `quant8`) with speculative decoding, the drafter's capture and the f_θ capture, the
# drafter's training (its draft vocabulary and the whole one) and f_θ's. On Mesa's lavapipe (no
# GPU needed; it holds at most 128 MiB a buffer, so the 640 MiB embedding is held in row blocks
# and the trainers keep it on the host), or on a GPU driver with KAKEYA_WGPU_ANY=1. Small on
# purpose (lavapipe decodes ≈ 0.5 token/s): prompts of a few sequences, 8–24 tokens, 3 training
# steps. ≈ 10 min on 2 cores. Needs a release kakeya built with `--features wgpu`, and pyarrow
# and numpy (`pip install pyarrow numpy`). Writes runs/wgpu/real-model-<date>.log; exits 1 when
# a comparison fails.
#
#   cargo build --release -p kakeya-cli --features wgpu --locked
#   scripts/wgpu_real_model.sh [path/to/kakeya]
set -euo pipefail
cd "$(dirname "$0")/.."
k=$(realpath "${1:-target/release/kakeya}")
python3 -c "import pyarrow, numpy" || { echo "wgpu_real_model: pip install pyarrow numpy" >&2; exit 2; }
if [ -z "${KAKEYA_WGPU_ANY:-}" ]; then
    # lavapipe only, even where a GPU driver is installed too.
    VK_ICD_FILENAMES=$(ls /usr/share/vulkan/icd.d/lvp_icd*.json | head -n 1)
    export VK_ICD_FILENAMES
fi
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp} RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2}
python3 scripts/fetch_default_model.py >/dev/null
w=$(mktemp -d); trap 'rm -rf "$w"' EXIT
mkdir -p runs/wgpu
log="runs/wgpu/real-model-$(date -u +%Y%m%dT%H%M%SZ).log"
fail=0
check() { python3 scripts/wgpu_compare.py "$@" || fail=1; }
# on NAME DEV ARGS...: kakeya ARGS --device DEV, its output in $w/NAME-DEV.out and .err, its
# time reported.
on() {
    local name=$1 dev=$2 t=$SECONDS; shift 2
    "$k" "$@" --device "$dev" > "$w/$name-$dev.out" 2> "$w/$name-$dev.err" \
        || { echo "$name on $dev failed:"; tail -5 "$w/$name-$dev.err"; fail=1; }
    echo "  $name on $dev: $((SECONDS - t)) s"
}
# cfg SRC DST SED...: a config with its paths pointed into $w.
cfg() { local src=$1 dst=$2; shift 2; sed "$@" "$src" > "$w/$dst"; }
{
    echo "# $(date -u) $(git rev-parse --short HEAD) $(uname -m); VK_ICD_FILENAMES=${VK_ICD_FILENAMES:-}"
    grep -m1 "model name" /proc/cpuinfo || true
    prompt="Write a Python function that returns the factorial of n."
    for mode in restored quant8; do
        for dev in cpu wgpu; do
            on "infer-$mode" $dev infer --prompt "$prompt" --max-tokens 24 --kv-mode $mode --kv-sink 4 \
                --kv-window 16 --json
        done
        check infer "$w/infer-$mode-cpu.out" "$w/infer-$mode-wgpu.out"
    done
    # The drafter's capture (4 prompts, 8 tokens each) and the f_θ capture (2 prompts, with
    # every verifier layer's Q/K/V/O and the drafter's K/V).
    for dev in cpu wgpu; do
        python3 - configs/capture/drafter-270m.toml "$w/dcap-$dev.toml" "$w/dcap-$dev" <<'PY'
import sys
s = open(sys.argv[1]).read().replace('data/capture-drafter-270m', sys.argv[3])
s = s.replace('gen_len = 128', 'gen_len = 8').replace('sequences_per_shard = 8', 'sequences_per_shard = 2')
s = s[:s.index('[[sources]]')] + '[[sources]]\nkind = "jsonl"\npath = "data/corpus/general.jsonl"\nlimit = 4\n'
open(sys.argv[2], 'w').write(s)
PY
        cfg configs/capture/f-theta-270m-s8.toml "fcap-$dev.toml" -e "s#data/capture-f-theta-270m-s8#$w/fcap-$dev#" \
            -e 's/^gen_len = 64/gen_len = 8/' -e 's/^limit = 8/limit = 2/'
        for c in dcap fcap; do on "$c" $dev capture --config "$w/$c-$dev.toml"; done
    done
    check capture "$w/dcap-cpu" "$w/dcap-wgpu"
    check capture "$w/fcap-cpu" "$w/fcap-wgpu"
    # The drafter trained for 3 steps on the CPU's capture, with a draft vocabulary of 1 024
    # tokens and with the whole vocabulary (its head in row blocks on lavapipe).
    for vocab in 1024 whole; do
        for dev in cpu wgpu; do
            cfg configs/train/drafter-270m.toml "dtrain-$vocab-$dev.toml" -e "s#data/capture-drafter-270m#$w/dcap-cpu#" \
                -e 's/^heldout_every = .*/heldout_every = 2/' -e 's/^steps = .*/steps = 3/' \
                -e 's/^warmup_steps = .*/warmup_steps = 1/' -e "s#runs/train-drafter-270m#$w/dr-$vocab-$dev#" \
                -e "s#checkpoints/drafter-gemma3-270m\"#$w/dr-export-$vocab-$dev\"#" \
                -e 's/^checkpoint_every = .*/checkpoint_every = 1000/' -e 's/^eval_every = .*/eval_every = 1000/' \
                -e 's/^eval_anchors = .*/eval_anchors = 8/' -e 's/^sequences_per_step = .*/sequences_per_step = 2/' \
                -e 's/^anchors_per_sequence = .*/anchors_per_sequence = 4/' \
                -e "$([ $vocab = whole ] && echo '/^draft_vocab/d' || echo "s/^draft_vocab = .*/draft_vocab = $vocab/")"
            on "dtrain-$vocab" $dev train drafter --config "$w/dtrain-$vocab-$dev.toml"
        done
        check train "$w/dr-$vocab-cpu" "$w/dr-$vocab-wgpu"
    done
    # f_θ trained for 3 steps on the small f_θ capture of the repository (the v2 drafter's).
    for dev in cpu wgpu; do
        cfg configs/train/f-theta-270m.toml "ft-$dev.toml" -e 's#data/capture-f-theta-270m#data/capture-f-theta-270m-s8#' \
            -e 's#checkpoints/drafter-gemma3-270m"#checkpoints/drafter-gemma3-270m-v2"#' -e 's/^steps = .*/steps = 3/' \
            -e 's/^warmup_steps = .*/warmup_steps = 1/' -e "s#runs/train-f-theta-270m#$w/ft-$dev#" \
            -e "s#runs/f-theta-gemma3-270m#$w/ft-export-$dev#" -e 's/^checkpoint_every = .*/checkpoint_every = 1000/' \
            -e 's/^eval_every = .*/eval_every = 1000/'
    done
    for dev in cpu wgpu; do on f-theta $dev train f-theta --config "$w/ft-$dev.toml"; done
    check train "$w/ft-cpu" "$w/ft-wgpu"
    echo "wgpu_real_model: $([ $fail = 0 ] && echo "all equal" || echo "FAILED")"
} 2>&1 | tee "$log"
echo "wgpu_real_model: log in $log"
grep -q "^wgpu_real_model: all equal" "$log"
