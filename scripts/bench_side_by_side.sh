#!/usr/bin/env bash
# Decode and prefill throughput of kakeya and llama.cpp on the same GGUF, measured back to back
# in one session (2 threads each; run it on an otherwise idle machine). Numbers go to
# docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
model=models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf
python3 scripts/fetch_default_model.py
cargo build --release --locked -p kakeya-cli
python3 scripts/bench_llama_cpp.py --build-only
echo "## kakeya bench (burn-flex CPU, RAYON_NUM_THREADS=2)"
RAYON_NUM_THREADS=2 ./target/release/kakeya bench --model "$model" --runs 5 --warmup 1
echo "## llama-bench -t 2"
python3 scripts/bench_llama_cpp.py --model "$model" --threads 2 --reps 5
