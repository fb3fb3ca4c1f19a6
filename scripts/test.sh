#!/usr/bin/env bash
# Kakeya's full test command (what CI runs): fetch the default model, format and lint checks,
# a compile check of the wgpu backend, then every test — including the golden tests on the
# real Gemma 3 270M, which are marked #[ignore] and run here with --include-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
# A clean build gains nothing from incremental state, and it costs ~1 GB of disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

python3 scripts/fetch_default_model.py
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo check -p kakeya-cli --features wgpu --locked
cargo check -p kakeya-cli --features wgpu,fusion,autotune --locked
cargo test --workspace --locked -- --include-ignored
