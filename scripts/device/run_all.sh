#!/bin/bash
# Device side of `scripts/device/pack.sh all`: in one call, what a GPU session measures on the
# default model, most important first, each step under its own time limit (the whole stays
# under BUDGET seconds, default 470: later steps are skipped when it is spent). Output in $OUT:
#   ft-cuda.json, ft-fused.json  f_θ training steps on CUDA (the 270M config on the small
#                                capture), the build with Burn's fusion too when it came along
#   golden.log                   the golden test with the model on CUDA
#   bench-ar.json                `kakeya bench --device cuda`: pp512, tg128
#   bench-spec.json              AR vs speculative, 20 built-in prompts × 128 tokens, the default
#                                settings (v3 drafter, n-gram table)
#   serve.json                   scripts/load_test.py on `kakeya serve --device cuda`: 1 vs 8
#                                streams, one round of 64 clients, the plain single stream
#   drafter.json                 the drafter's capture on CUDA (64 prompts) and training steps
#   hf.json                      transformers on the same GGUF and GPU
# (KAKEYA_DEVICE=cpu dry-runs it on a machine without a GPU.)
source .xfer/unpack.sh
dev=${KAKEYA_DEVICE:-cuda}
budget=${BUDGET:-470}
root=$(sed -n 's/^root_at_build=//p' $X/build-root 2>/dev/null); root=${root:-/work/main}
if [ "$root" != "$R" ] && [ ! -e "$root" ]; then mkdir -p "$(dirname "$root")" && ln -s "$R" "$root"; fi
mkdir -p checkpoints && rm -rf checkpoints/drafter-gemma3-270m-v2 && mv $X/drafter checkpoints/drafter-gemma3-270m-v2
rm -rf checkpoints/drafter-gemma3-270m-v3 && mv $X/drafter-v3 checkpoints/drafter-gemma3-270m-v3
mv $X/ngram.bin checkpoints/ngram-gemma3-270m.bin
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $X/whl/*.whl \
    && export PYTHONPATH=/tmp/site
# step NAME LIMIT OUT ERR COMMAND...: runs COMMAND under `timeout LIMIT` (cut to what the budget
# has left), stdout to OUT and stderr to ERR (to OUT too when ERR is -), and reports its exit
# status and time; skipped when under 20 s are left.
step() {
    local name=$1 limit=$2 out=$3 err=$4 t=$SECONDS rc; shift 4
    local left=$((budget - SECONDS))
    if [ $left -lt 20 ]; then echo "== $name: skipped (budget spent)"; return; fi
    [ $limit -gt $left ] && limit=$left
    echo "== $name (limit ${limit}s)"
    if [ "$err" = - ]; then timeout "$limit" "$@" > "$out" 2>&1; else timeout "$limit" "$@" > "$out" 2> "$err"; fi
    rc=$?; echo "== $name: rc=$rc in $((SECONDS - t)) s"
}
summary() { python3 - "$@" <<'PY'
import json, sys
kind, path = sys.argv[1], sys.argv[2]
try:
    d = json.load(open(path))
except Exception as e:
    print(f"   ({path}: {e})"); sys.exit()
if kind == 'train':
    st = d.get('steps', [])
    print('   secs_per_step', d.get('secs_per_step'), 'steps', len(st), 'first', [round(s['secs'], 3) for s in st[:3]],
          'last losses', [round(s['loss'], 5) for s in st[-3:]])
elif kind == 'bench':
    print('  ', [(r.get('name'), r.get('median_tok_s')) for r in d.get('results', [])])
elif kind == 'spec':
    print('  ', {k: d.get(k) for k in ('drafts', 'ar_decode_tok_s', 'spec_decode_tok_s', 'speedup', 'mean_acceptance_length', 'all_identical', 'blocks_by_length')})
    print('   divergences', [p['divergence'] for p in d.get('prompts', []) if 'divergence' in p])
PY
}
# f_θ step time: the plain build, then the fused one.
step ft-cuda 100 $OUT/ft-cuda.log - $X/kakeya-cuda train f-theta --config $X/ft.toml --device $dev
cp /tmp/x/ft-run/report.json $OUT/ft-cuda.json 2>/dev/null; summary train $OUT/ft-cuda.json; tail -2 $OUT/ft-cuda.log
if [ -x $X/kakeya-alt ]; then
    rm -rf /tmp/x/ft-run /tmp/x/ft-export
    step ft-fused 100 $OUT/ft-fused.log - $X/kakeya-alt train f-theta --config $X/ft.toml --device $dev
    cp /tmp/x/ft-run/report.json $OUT/ft-fused.json 2>/dev/null; summary train $OUT/ft-fused.json; tail -2 $OUT/ft-fused.log
fi
step golden 90 $OUT/golden.log - env KAKEYA_TEST_DEVICE=$dev $X/golden-cuda --include-ignored --nocapture \
    --test-threads 1 logits_and_greedy_match_transformers
grep -E "max \||logit|diverg|test result" $OUT/golden.log | tail -12
step bench-ar 100 $OUT/bench-ar.json $OUT/bench-ar.log $X/kakeya-cuda bench --device $dev --runs 3 --warmup 1 --json
summary bench $OUT/bench-ar.json
step bench-spec 150 $OUT/bench-spec.json $OUT/bench-spec.log $X/kakeya-cuda bench --device $dev \
    --drafter checkpoints/drafter-gemma3-270m-v3 --runs 1 --warmup 1 --json
summary spec $OUT/bench-spec.json
# The server on the GPU (issue 17's batching, issue 18's engine on the device).
step serve 150 $OUT/serve.log - python3 $X/load_test.py --kakeya $X/kakeya-cuda --server-args "--device $dev" \
    --rounds 1 --json $OUT/serve.json
grep -E "medians|round|reference|errors" $OUT/serve.log
# The drafter on the GPU: capture 64 prompts' continuations and hidden states, then train.
step drafter-capture 60 $OUT/drafter-capture.log - $X/kakeya-cuda capture --config $X/dcap.toml --device $dev
tail -1 $OUT/drafter-capture.log
step drafter-train 80 $OUT/drafter-train.log - $X/kakeya-cuda train drafter --config $X/dtrain.toml --device $dev
cp /tmp/x/dr-run/report.json $OUT/drafter.json 2>/dev/null; summary train $OUT/drafter.json; tail -2 $OUT/drafter-train.log
step hf 150 $OUT/hf.log - env PYTHONUNBUFFERED=1 python3 scripts/device/hf_bench.py models/gemma-3-270m --json $OUT/hf.json
tail -3 $OUT/hf.log
echo "== done in $SECONDS s"
