#!/bin/bash
# Device side of `scripts/device/pack.sh infer`: inference on CUDA, end to end, on the
# default model. In order, each step with its own time limit, output in $OUT:
#   golden.log        the golden test (logits vs transformers' f32 fixture, greedy continuations)
#                     with the model on `--device cuda` (KAKEYA_TEST_DEVICE=cuda);
#   bench-ar.json     `kakeya bench --device cuda`: pp512 and tg128, median of 3 after warm-up;
#   bench-ar-alt.json the same with a second build (e.g. `--features cuda,fusion`: Burn's kernel
#                     fusion), when the payload has one;
#   hf.json           transformers on the same GGUF and GPU (scripts/device/hf_bench.py): pp512
#                     and tg128 with `generate`, f32 and bf16;
#   bench-spec.json   `kakeya bench --device cuda --drafter`: AR vs speculative on the 20
#                     built-in prompts, 128 tokens, alternating, with token identity per prompt,
#                     with whichever build decoded faster (named in the log).
source .xfer/unpack.sh
# The device (KAKEYA_DEVICE=cpu dry-runs this script on a machine without a GPU).
dev=${KAKEYA_DEVICE:-cuda}
# The golden test finds its fixture and the model from the workspace path it was built in.
root=$(sed -n 's/^root_at_build=//p' $X/build-root 2>/dev/null); root=${root:-/work/main}
if [ "$root" != "$R" ] && [ ! -e "$root" ]; then mkdir -p "$(dirname "$root")" && ln -s "$R" "$root"; fi
mkdir -p crates/kakeya-runtime checkpoints && rm -rf checkpoints/drafter-gemma3-270m-v2 \
    && mv $X/drafter checkpoints/drafter-gemma3-270m-v2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $X/whl/*.whl \
    && export PYTHONPATH=/tmp/site
# step NAME LIMIT OUT ERR COMMAND...: runs COMMAND under `timeout LIMIT`, stdout to OUT and stderr
# to ERR (to OUT too when ERR is -), and reports its exit status and time.
step() {
    local name=$1 limit=$2 out=$3 err=$4 t=$SECONDS rc; shift 4
    echo "== $name (limit ${limit}s)"
    if [ "$err" = - ]; then timeout "$limit" "$@" > "$out" 2>&1; else timeout "$limit" "$@" > "$out" 2> "$err"; fi
    rc=$?; echo "== $name: rc=$rc in $((SECONDS - t)) s"
}
step golden 150 $OUT/golden.log - env KAKEYA_TEST_DEVICE=$dev $X/golden-cuda --include-ignored --nocapture \
    --test-threads 1 logits_and_greedy_match_transformers
tail -4 $OUT/golden.log
step bench-ar 150 $OUT/bench-ar.json $OUT/bench-ar.log $X/kakeya-cuda bench --device $dev --runs 3 --warmup 1 --json
cat $OUT/bench-ar.json
best=$X/kakeya-cuda
if [ -x $X/kakeya-alt ]; then
    step bench-ar-alt 150 $OUT/bench-ar-alt.json $OUT/bench-ar-alt.log \
        $X/kakeya-alt bench --device $dev --runs 3 --warmup 1 --json
    cat $OUT/bench-ar-alt.json
    faster=$(python3 -c "import json,sys; tg=lambda p: json.load(open(p))['results'][1]['median_tok_s']
print(int(tg(sys.argv[2]) > tg(sys.argv[1])))" $OUT/bench-ar.json $OUT/bench-ar-alt.json)
    [ "$faster" = 1 ] && best=$X/kakeya-alt
fi
step hf 180 $OUT/hf.log - env PYTHONUNBUFFERED=1 python3 scripts/device/hf_bench.py models/gemma-3-270m \
    --json $OUT/hf.json
tail -3 $OUT/hf.log
echo "== speculative decoding with $best"
step bench-spec 240 $OUT/bench-spec.json $OUT/bench-spec.log $best bench --device $dev \
    --drafter checkpoints/drafter-gemma3-270m-v2 --runs 1 --warmup 1 --json
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('drafts','ar_decode_tok_s','spec_decode_tok_s','speedup','mean_acceptance_length','all_identical','blocks_by_length')}); print([p['divergence'] for p in d['prompts'] if 'divergence' in p])" $OUT/bench-spec.json
