#!/bin/bash
# Device side of `scripts/device/pack.sh all`: in one call, what a GPU session measures on the
# default model, most important first, each step under its own time limit (the whole stays
# under BUDGET seconds, default 470: later steps are skipped when it is spent). Output in
# $OUT/all.tgz (at most 8 files come back; rewritten after each step, so a cut-off run keeps
# what it finished):
#   ft-cuda.json                 f_θ training steps on CUDA (the 270M config on the small
#                                capture; each step replayed from a recorded CUDA graph)
#   ft-nograph.json              the same with `[train] graph = false` (every step issued from
#                                the host), for the side-by-side
#   serve.json                   scripts/load_test.py on `kakeya serve --device cuda`: 1 vs 8
#                                streams, one round of 64 clients, the plain single stream
#   golden.log                   the golden test with the model on CUDA
#   bench-ar.json                `kakeya bench --device cuda`: pp512, tg128 (decode steps
#                                recorded once and replayed as CUDA graphs)
#   bench-ar-nograph.json        the same with `--no-graph` (every step issued kernel by kernel)
#   bench-sampled[-cut].json     tg128 sampled at T = 1 (then with top-k 40, top-p 0.95): the
#                                draw on the device, the steps replayed as CUDA graphs
#   bench-spec.json              AR vs speculative, 20 built-in prompts × 128 tokens, the default
#                                settings (v3 drafter, n-gram table)
#   hf.json                      transformers on the same GGUF and GPU
#   bench-batch-N.json           `kakeya bench --device cuda --batch N` (N = 1, 8, 16): decode of
#                                N sequences together (the server's batching on the GPU)
#   test-NAME.log                each further test binary carried, KAKEYA_TEST_DEVICE=cuda
#   ft-fused.json                the f_θ steps with the build with Burn's fusion, when it came
#   drafter.json                 the drafter's capture on CUDA (64 prompts) and training steps
# The open aims come first: the f_θ step and the server's 8 streams
# against one.
# (KAKEYA_DEVICE=cpu dry-runs it on a machine without a GPU; STEP_LIMIT=S caps every step at S s;
# SKIP="NAME ..." skips those steps.)
source .xfer/unpack.sh
O=/tmp/out; mkdir -p $O
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
    case " ${SKIP:-} " in *" $name "*) echo "== $name: skipped (SKIP)"; return;; esac
    if [ $left -lt 20 ]; then echo "== $name: skipped (budget spent)"; return; fi
    [ $limit -gt $left ] && limit=$left
    [ -n "${STEP_LIMIT:-}" ] && [ $limit -gt $STEP_LIMIT ] && limit=$STEP_LIMIT
    echo "== $name (limit ${limit}s)"
    if [ "$err" = - ]; then timeout "$limit" "$@" > "$out" 2>&1; else timeout "$limit" "$@" > "$out" 2> "$err"; fi
    rc=$?; echo "== $name: rc=$rc in $((SECONDS - t)) s"
    tar czf $OUT/all.tgz -C $O .
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
    print('   secs_per_step', d.get('secs_per_step'), 'steps', len(st), 'replayed', d.get('replayed_steps'), 'first', [round(s['secs'], 3) for s in st[:3]],
          'last losses', [round(s['loss'], 5) for s in st[-3:]])
elif kind == 'bench':
    print('  ', [(r.get('test'), r.get('median_tok_s')) for r in d.get('results', [])])
elif kind == 'spec':
    print('  ', {k: d.get(k) for k in ('drafts', 'ar_decode_tok_s', 'spec_decode_tok_s', 'speedup', 'mean_acceptance_length', 'all_identical', 'blocks_by_length')})
    print('   divergences', [p['divergence'] for p in d.get('prompts', []) if 'divergence' in p])
PY
}
# f_θ step time (the aim: ≥ 20× the CPU), replayed and issued side by side.
step ft-cuda 100 $O/ft-cuda.log - env KAKEYA_LOG=kakeya_train=debug $X/kakeya-cuda train f-theta --config $X/ft.toml --device $dev
cp /tmp/x/ft-run/report.json $O/ft-cuda.json 2>/dev/null; summary train $O/ft-cuda.json; python3 scripts/device/phases.py $O/ft-cuda.log
grep -v DEBUG $O/ft-cuda.log | tail -2
rm -rf /tmp/x/ft-run /tmp/x/ft-export
sed "/^\[train\]/a graph = false" $X/ft.toml > $X/ft-nograph.toml
step ft-nograph 100 $O/ft-nograph.log - env KAKEYA_LOG=kakeya_train=debug $X/kakeya-cuda train f-theta --config $X/ft-nograph.toml --device $dev
cp /tmp/x/ft-run/report.json $O/ft-nograph.json 2>/dev/null; summary train $O/ft-nograph.json; python3 scripts/device/phases.py $O/ft-nograph.log
grep -E "recorded for replay|records no graphs" $O/ft-cuda.log | head -3
# The server on the GPU: 1 vs 8 streams (the aim of ≥ 2×), the engine on the device.
step serve 150 $O/serve.log - python3 $X/load_test.py --kakeya $X/kakeya-cuda --server-args "--device $dev" \
    --rounds 1 --json $O/serve.json
grep -E "medians|round|reference|errors|replays" $O/serve.log
step golden 90 $O/golden.log - env KAKEYA_TEST_DEVICE=$dev $X/golden-cuda --include-ignored --nocapture \
    --test-threads 1 logits_and_greedy_match_transformers
grep -E "max \||logit|diverg|test result" $O/golden.log | tail -12
step bench-ar 100 $O/bench-ar.json $O/bench-ar.log $X/kakeya-cuda bench --device $dev --runs 3 --warmup 1 --json
summary bench $O/bench-ar.json
# The same with every decode step issued kernel by kernel (no recorded step), side by side.
step bench-ar-nograph 100 $O/bench-ar-nograph.json $O/bench-ar-nograph.log $X/kakeya-cuda bench \
    --device $dev --no-graph --runs 3 --warmup 1 --json
summary bench $O/bench-ar-nograph.json
# Sampled decode (T = 1; then top-k 40, top-p 0.95): drawn on the device, only the ids read back.
step bench-sampled 100 $O/bench-sampled.json $O/bench-sampled.log $X/kakeya-cuda bench --device $dev \
    --temperature 1 --prompt-tokens 16 --runs 3 --warmup 1 --json
summary bench $O/bench-sampled.json
step bench-sampled-cut 100 $O/bench-sampled-cut.json $O/bench-sampled-cut.log $X/kakeya-cuda bench \
    --device $dev --temperature 1 --top-k 40 --top-p 0.95 --prompt-tokens 16 --runs 3 --warmup 1 --json
summary bench $O/bench-sampled-cut.json
step bench-spec 150 $O/bench-spec.json $O/bench-spec.log $X/kakeya-cuda bench --device $dev \
    --drafter checkpoints/drafter-gemma3-270m-v3 --runs 1 --warmup 1 --json
summary spec $O/bench-spec.json
# transformers on the same GGUF and GPU, side by side.
step hf 150 $O/hf.log - env PYTHONUNBUFFERED=1 python3 scripts/device/hf_bench.py models/gemma-3-270m --json $O/hf.json
tail -3 $O/hf.log
# Decode of several sequences together (the server's batched steps), against one.
for n in 1 8 16; do
    step bench-batch-$n 60 $O/bench-batch-$n.json $O/bench-batch-$n.log $X/kakeya-cuda bench --device $dev \
        --batch $n --prompt-tokens 16 --gen-tokens 64 --runs 3 --warmup 1 --json
    summary bench $O/bench-batch-$n.json
done
# The tiny-model device equivalences and the kernel tests (when their binaries came along).
[ -d $X/fixtures-gemma4 ] && mkdir -p tests/fixtures && rm -rf tests/fixtures/gemma4 && cp -r $X/fixtures-gemma4 tests/fixtures/gemma4
for t in $X/test-*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    step $name 90 $O/$name.log - env KAKEYA_TEST_DEVICE=$dev "$t" --test-threads 1 --nocapture
    grep -E "^test |test result|panicked" $O/$name.log | tail -16
done
# The build with Burn's fusion, when it came along.
if [ -x $X/kakeya-alt ]; then
    rm -rf /tmp/x/ft-run /tmp/x/ft-export
    step ft-fused 100 $O/ft-fused.log - env KAKEYA_LOG=kakeya_train=debug $X/kakeya-alt train f-theta --config $X/ft.toml --device $dev
    cp /tmp/x/ft-run/report.json $O/ft-fused.json 2>/dev/null; summary train $O/ft-fused.json; python3 scripts/device/phases.py $O/ft-fused.log
    grep -v DEBUG $O/ft-fused.log | tail -2
fi
# The drafter on the GPU: capture 64 prompts' continuations and hidden states, then train.
step drafter-capture 60 $O/drafter-capture.log - $X/kakeya-cuda capture --config $X/dcap.toml --device $dev
tail -1 $O/drafter-capture.log
step drafter-train 80 $O/drafter-train.log - $X/kakeya-cuda train drafter --config $X/dtrain.toml --device $dev
cp /tmp/x/dr-run/report.json $O/drafter.json 2>/dev/null; summary train $O/drafter.json; tail -2 $O/drafter-train.log
tar czf $OUT/all.tgz -C $O .
echo "== done in $SECONDS s"
