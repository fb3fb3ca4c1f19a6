#!/usr/bin/env bash
# The main job on a fresh machine: fetch the default model (Gemma 3 270M, GGUF Q4_K_M, and its
# tokenizer), build kakeya in release mode, and generate from a prompt.
# Usage: scripts/run-default.sh ["prompt text"] [extra `kakeya infer` flags...]
set -euo pipefail
cd "$(dirname "$0")/.."

prompt="${1:-The three most useful things to know about the Rust borrow checker are}"
shift || true
python3 scripts/fetch_default_model.py
cargo build --release --locked -p kakeya-cli
./target/release/kakeya infer --prompt "$prompt" --max-tokens 64 "$@"
