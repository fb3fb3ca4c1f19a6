#!/usr/bin/env bash
# A newcomer's run, end to end: clone this repository into an empty folder and, with empty pip,
# npm and cargo caches, run the README's main job and then its "A short tour" block exactly as
# written (taken from the clone's README), the openai client installed in a fresh venv.
# Prints each part's wall time; exits non-zero if any part fails.
# Usage: scripts/fresh_clone_run.sh [work-dir]   (default: a new temporary folder)
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)}"
mkdir -p "$work"
export PIP_NO_CACHE_DIR=1 npm_config_cache="$work/npm-cache" CARGO_HOME="$work/cargo-home"
git clone -q "$src" "$work/kakeya"
cd "$work/kakeya"
echo "fresh clone at $(git log --oneline -1) in $work/kakeya"
t=$(date +%s)
scripts/run-default.sh "The capital of France is"
echo "main job: $(( $(date +%s) - t )) s"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q openai
export PATH="$work/venv/bin:$PATH"
python3 - > "$work/tour.sh" <<'PY'
import re
s = open("README.md").read()
block = re.search(r"```sh\n(.*?)```", s[s.index("## A short tour"):], re.S)
print("set -e\n" + block.group(1))
PY
t=$(date +%s)
bash -x "$work/tour.sh"
echo "tour: $(( $(date +%s) - t )) s"
