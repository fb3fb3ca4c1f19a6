#!/usr/bin/env bash
# Kakeya vs llama.cpp on the same GGUF, 2 threads each, measured back to back in one session:
# llama-bench (pp512, tg128), then `kakeya bench` (pp512, tg128; exact and `--kernel int8`), then Kakeya's speculative
# decoding with the default settings on the 20 built-in prompts, then llama-bench again (the
# two llama.cpp runs bracket Kakeya's: if they differ much, the machine was not quiet). Prints
# the ratios; the raw JSON lands in runs/side-by-side/. Run it on an otherwise idle machine.
#
# A fresh machine needs a C/C++ compiler (installed with apt-get when missing and run as root)
# and cmake (fetched from PyPI by scripts/bench_llama_cpp.py when missing). llama.cpp is built
# with explicit ISA options, AMX off (see scripts/bench_llama_cpp.py).
#
# Then, at each depth of --depths (default "4096 16384"; "" for none), pp512 and tg32 after that
# many context tokens: llama-bench with flash attention and f16, q8_0 and q4_0 KV caches beside
# `kakeya bench --depth` with `full` and the recommended bounded mode, and the prefill of the
# deepest context (llama-bench pp<depth> against the depth context's own prefill in Kakeya).
#
# Usage: scripts/bench_side_by_side.sh [--runs N] [--depths "4096 16384"]
#        (N runs per figure, default 5; 3 at depth)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=5
depths="4096 16384"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --depths) depths="$2"; shift 2 ;;
    *) echo "bench_side_by_side: unknown option $1" >&2; exit 2 ;;
  esac
done
bounded=bounded-k2v2-mixed
model=models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf
drafter=checkpoints/drafter-gemma3-270m-v3
table=checkpoints/ngram-gemma3-270m.bin
out=runs/side-by-side
mkdir -p "$out"

if ! command -v c++ >/dev/null || ! command -v make >/dev/null; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq build-essential
  else
    echo "bench_side_by_side: a C/C++ compiler and make are needed (apt-get install build-essential)" >&2
    exit 1
  fi
fi
python3 scripts/fetch_default_model.py
cargo build --release --locked -p kakeya-cli
python3 scripts/bench_llama_cpp.py --build-only

kakeya=./target/release/kakeya
echo "## llama-bench -t 2 (before)"
python3 scripts/bench_llama_cpp.py --model "$model" --threads 2 --reps "$runs" --json "$out/llama-before.json"
echo "## kakeya bench (burn-flex CPU, RAYON_NUM_THREADS=2)"
RAYON_NUM_THREADS=2 "$kakeya" bench --model "$model" --runs "$runs" --warmup 1 --json > "$out/kakeya.json.tmp"
mv "$out/kakeya.json.tmp" "$out/kakeya.json"
echo "## kakeya bench --kernel int8 (opt-in: int8 inputs, integer dot products; not the f32 model's numbers)"
RAYON_NUM_THREADS=2 "$kakeya" bench --model "$model" --kernel int8 --runs "$runs" --warmup 1 --json > "$out/kakeya-int8.json.tmp"
mv "$out/kakeya-int8.json.tmp" "$out/kakeya-int8.json"
echo "## kakeya bench --drafter (default settings: combined proposer with the n-gram table, adaptive blocks)"
RAYON_NUM_THREADS=2 "$kakeya" bench --model "$model" --drafter "$drafter" --ngram-table "$table" --runs 1 --warmup 1 --json > "$out/spec.json.tmp"
mv "$out/spec.json.tmp" "$out/spec.json"
echo "## llama-bench -t 2 (after)"
python3 scripts/bench_llama_cpp.py --model "$model" --threads 2 --reps "$runs" --json "$out/llama-after.json"

python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def llama(name):
    recs = json.loads((out / name).read_text())
    return {("pp" if r["n_gen"] == 0 else "tg"): r["avg_ts"] for r in recs}
before, after = llama("llama-before.json"), llama("llama-after.json")
def kakeya(name):
    return {f["test"][:2]: f["median_tok_s"] for f in json.loads((out / name).read_text())["results"]}
k, k8 = kakeya("kakeya.json"), kakeya("kakeya-int8.json")
spec = json.loads((out / "spec.json").read_text())
print()
print("| figure | kakeya tok/s | llama.cpp tok/s (before / after) | kakeya / llama.cpp (mean of the two) |")
print("|---|---|---|---|")
for test, name in (("pp", "pp512"), ("tg", "tg128")):
    mean = (before[test] + after[test]) / 2
    print(f"| {name} | {k[test]:.1f} | {before[test]:.1f} / {after[test]:.1f} | {k[test] / mean:.2f}× |")
    print(f"| {name}, `--kernel int8` | {k8[test]:.1f} | {before[test]:.1f} / {after[test]:.1f} | {k8[test] / mean:.2f}× |")
mean = (before["tg"] + after["tg"]) / 2
print(f"| speculative decode (20 prompts, 128 tokens; AR {spec['ar_decode_tok_s']:.1f}, "
      f"{spec['speedup']:.2f}× own AR, acceptance {spec['mean_acceptance_length']:.2f}, "
      f"identical {spec['all_identical']}) | {spec['spec_decode_tok_s']:.1f} | "
      f"{before['tg']:.1f} / {after['tg']:.1f} (tg128) | {spec['spec_decode_tok_s'] / mean:.2f}× |")
PY

# Depth: the same tests after a long context.
deep=0
for d in $depths; do
  echo "## depth $d: llama-bench -fa 1 (f16, q8_0, q4_0 KV), kakeya bench (full, $bounded)"
  for ct in f16 q8_0 q4_0; do
    python3 scripts/bench_llama_cpp.py --model "$model" --threads 2 --reps 3 --prompt 512 --gen 32 \
      --depth "$d" --cache-type "$ct" --flash-attn --json "$out/llama-d$d-$ct.json"
  done
  for mode in full "$bounded"; do
    RAYON_NUM_THREADS=2 "$kakeya" bench --model "$model" --depth "$d" --prompt-tokens 512 \
      --gen-tokens 32 --runs 3 --warmup 1 --kv-mode "$mode" --json > "$out/kakeya-d$d-$mode.json.tmp"
    mv "$out/kakeya-d$d-$mode.json.tmp" "$out/kakeya-d$d-$mode.json"
  done
  deep="$d"
done
if [[ "$deep" != 0 ]]; then
  echo "## prefill of a $deep-token prompt: llama-bench pp$deep -fa 1"
  python3 scripts/bench_llama_cpp.py --model "$model" --threads 2 --reps 1 --prompt "$deep" --gen 0 \
    --flash-attn --json "$out/llama-pp$deep.json"
fi

python3 - "$out" "$bounded" "$deep" $depths <<'PY'
import json, sys
from pathlib import Path
out, bounded, deep, depths = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
if not depths:
    sys.exit()
def llama(name):
    recs = json.loads((out / name).read_text())
    return {("pp" if r["n_gen"] == 0 else "tg"): r["avg_ts"] for r in recs}
def kakeya(name):
    res = json.loads((out / name).read_text())["results"]
    return {f["test"].split()[0][:2] if "depth context" not in f["test"] else "ctx": f["median_tok_s"]
            for f in res}
print()
print("| depth | test | kakeya full | kakeya " + bounded + " | llama.cpp f16 | q8_0 | q4_0 | full / f16 | " + bounded + " / q4_0 |")
print("|---|---|---|---|---|---|---|---|---|")
for d in depths:
    l = {ct: llama(f"llama-d{d}-{ct}.json") for ct in ("f16", "q8_0", "q4_0")}
    k = {m: kakeya(f"kakeya-d{d}-{m}.json") for m in ("full", bounded)}
    for test, name in (("pp", "pp512"), ("tg", "tg32")):
        print(f"| {d} | {name} | {k['full'][test]:.1f} | {k[bounded][test]:.1f} | {l['f16'][test]:.1f} | "
              f"{l['q8_0'][test]:.1f} | {l['q4_0'][test]:.1f} | {k['full'][test] / l['f16'][test]:.2f}× | "
              f"{k[bounded][test] / l['q4_0'][test]:.2f}× |")
if deep:
    lp = llama(f"llama-pp{deep}.json")["pp"]
    kp = kakeya(f"kakeya-d{deep}-full.json")["ctx"]
    print(f"| — | pp{deep} (a {deep}-token prompt) | {kp:.1f} | — | {lp:.1f} | — | — | {kp / lp:.2f}× | — |")
PY
