#!/bin/bash
# Device side of `scripts/device/pack.sh profile`: where a CUDA decode step's time goes, with no
# real weights carried. Builds a random-weight model of the default model's shapes
# (random_model.py), times `kakeya bench` on it, then runs a few decode steps with CubeCL's
# kernel profiler and compilation log on (cubecl.toml). Output in $OUT: bench.json,
# profile.log (every kernel launch with its GPU time), compile.log.
source .xfer/unpack.sh
python3 scripts/device/random_model.py $X/config.json $X/spec.json /tmp/m || exit 5
cp models/gemma-3-270m/tokenizer.json /tmp/m/
args="bench --device cuda --model /tmp/m --json"
echo "== timing"; t=$SECONDS
timeout 60 $X/kakeya-cuda $args --prompt-tokens 64 --gen-tokens 32 --runs 2 --warmup 1 > $OUT/bench.json
echo "rc=$? in $((SECONDS - t)) s"; cat $OUT/bench.json
cat > cubecl.toml <<TOML
[profiling.logger]
level = "basic"
file = "$OUT/profile.log"
[compilation.logger]
level = "basic"
file = "$OUT/compile.log"
TOML
echo "== profile"; t=$SECONDS
timeout 60 $X/kakeya-cuda $args --prompt-tokens 16 --gen-tokens 4 --runs 1 --warmup 1 > $OUT/bench-profiled.json
echo "rc=$? in $((SECONDS - t)) s"; rm cubecl.toml
wc -l $OUT/*.log
