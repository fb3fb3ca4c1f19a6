#!/bin/bash
# Device side of `scripts/device/pack.sh profile`: decode and prefill speed on a CUDA GPU with no
# real weights carried. Builds a random-weight model of the default model's shapes
# (random_model.py), then:
#   1. runs each carried test binary (built with --features cuda) with KAKEYA_TEST_DEVICE=cuda;
#   2. times `kakeya bench` (pp512, tg128) on it, alternating with the baseline build when one
#      was carried (base, new, base, new);
#   3. times transformers on the same weights (hf_bench.py, f32 and bf16);
#   4. runs a few decode steps with CubeCL's kernel profiler on (cubecl.toml).
# Output in $OUT: bench-{new,base}-{1,2}.json, hf.json, bench-profiled.json, and logs.tgz (each
# test's output and CubeCL's log of its kernels, with their CUDA sources; the profile).
# KAKEYA_DEVICE=cpu runs it on the CPU (a dry run of the script; steps 1 and 3 skipped);
# SKIP_HF=1 skips step 3; ROUNDS=1 times each build once (default 2).
source .xfer/unpack.sh
dev=${KAKEYA_DEVICE:-cuda}
L=/tmp/logs; mkdir -p $L
python3 scripts/device/random_model.py $X/config.json $X/spec.json /tmp/m || exit 5
cp models/gemma-3-270m/tokenizer.json /tmp/m/
[ -d $X/fixtures-gemma4 ] && mkdir -p tests/fixtures && cp -r $X/fixtures-gemma4 tests/fixtures/gemma4
if [ "$dev" = cuda ]; then
    for t in $X/test-*; do
        [ -x "$t" ] || continue
        name=$(basename "$t"); echo "== $name"; t0=$SECONDS
        CUBECL_DEBUG_LOG=$L/$name.cubecl.log KAKEYA_TEST_DEVICE=cuda timeout 240 "$t" \
            --test-threads 1 --nocapture > $L/$name.log 2>&1
        echo "rc=$? in $((SECONDS - t0)) s"; grep -E "^test |test result|max|Δ|panicked" $L/$name.log | tail -40
    done
fi
args="bench --device $dev --model /tmp/m --json --prompt-tokens 512 --gen-tokens 128 --runs 3 --warmup 1"
for round in $(seq ${ROUNDS:-2}); do
    for b in base new; do
        bin=$X/kakeya-$b; [ $b = new ] && bin=$X/kakeya-cuda
        [ -x "$bin" ] || continue
        echo "== bench $b, round $round"; t0=$SECONDS
        timeout 150 $bin $args > $OUT/bench-$b-$round.json
        echo "rc=$? in $((SECONDS - t0)) s"; cat $OUT/bench-$b-$round.json; echo
    done
done
if [ "$dev" = cuda ] && [ -z "${SKIP_HF:-}" ]; then
    echo "== transformers on the same random weights"; t0=$SECONDS
    timeout 180 python3 scripts/device/hf_bench.py /tmp/m --json $OUT/hf.json
    echo "rc=$? in $((SECONDS - t0)) s"
fi
cat > cubecl.toml <<TOML
[profiling.logger]
level = "basic"
file = "$L/profile.log"
[compilation.logger]
level = "basic"
file = "$L/compile.log"
TOML
echo "== profile"; t0=$SECONDS
timeout 60 $X/kakeya-cuda bench --device $dev --model /tmp/m --json --prompt-tokens 16 --gen-tokens 4 \
    --runs 1 --warmup 1 > $OUT/bench-profiled.json
echo "rc=$? in $((SECONDS - t0)) s"; rm cubecl.toml
wc -l $L/*; tar czf $OUT/logs.tgz -C $L .
