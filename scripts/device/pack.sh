#!/bin/bash
# Packs what a GPU run of `kakeya train f-theta` needs for the lent NVIDIA machine (`device` tool),
# whose working tree travels in at most 64 MiB per call: a CUDA build of kakeya (xz), the verifier
# GGUF, the first shard of the f_θ capture (with a manifest for it alone) and a step-time config.
# Writes .xfer/ (git-ignored through .git/info/exclude) with parts of 41 MiB, run.sh's input.
#
#   cargo build --release -p kakeya-cli --features cuda && strip target/release/kakeya
#   scripts/device/pack.sh target/release/kakeya
#   then one device call per part:  mv .xfer/parts/pN /tmp/x/   (carry .xfer/parts/pN)
#   and last:  bash .xfer/run.sh   (carry .xfer/parts/<last>, .xfer/run.sh, .xfer/payload.sha)
set -euo pipefail
bin=${1:?usage: pack.sh <kakeya built with --features cuda>}
cd "$(dirname "$0")/../.."
mkdir -p .git/info && grep -qx '/.xfer/' .git/info/exclude 2>/dev/null || echo '/.xfer/' >> .git/info/exclude
rm -rf .xfer && mkdir -p .xfer/stage/ds .xfer/parts
python3 - <<'PY'
import json
m = json.load(open('data/capture-f-theta-270m/manifest.json'))
m['shards'] = m['shards'][:1]; m['shards_total'] = 1
m['sequences'] = len(m['shards'][0]['sequences']); m['sequence_sources'] = m['sequence_sources'][:m['sequences']]
json.dump(m, open('.xfer/stage/ds/manifest.json', 'w'), indent=2)
PY
cp data/capture-f-theta-270m/shard-00000.parquet .xfer/stage/ds/
xz -T2 -6 -c "$bin" > .xfer/stage/kakeya-cuda.xz
cp models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf .xfer/stage/verifier.gguf
sed -e 's#data/capture-f-theta-270m#/tmp/x/ds#' -e 's#^steps = .*#steps = 40#' -e 's#^warmup_steps = .*#warmup_steps = 10#' \
    -e 's#runs/train-f-theta-270m#/tmp/x/run#' -e 's#runs/f-theta-gemma3-270m#/tmp/x/export#' \
    -e 's#^checkpoint_every = .*#checkpoint_every = 1000#' -e 's#^eval_every = .*#eval_every = 1000#' \
    configs/train/f-theta-270m.toml > .xfer/stage/cfg.toml
(cd .xfer/stage && tar cf ../payload.tar kakeya-cuda.xz verifier.gguf ds cfg.toml)
rm -rf .xfer/stage
(cd .xfer && sha256sum payload.tar | cut -d' ' -f1 > payload.sha && cd parts && split -b 41M -d -a 1 ../payload.tar p)
rm .xfer/payload.tar
cp scripts/device/run.sh .xfer/run.sh
ls -l .xfer/parts
