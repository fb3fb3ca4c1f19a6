#!/usr/bin/env python3
"""Build llama.cpp's `llama-bench` from PyPI's `llama-cpp-python` sdist and run it on a GGUF.

The sdist vendors llama.cpp; we fetch it from PyPI (pinned version and SHA-256), build only
`llama-bench` (CPU, native ISA, no curl), cache the build under `runs/llama.cpp/` (git-ignored),
and run `llama-bench -t 2 -p 512 -n 128 -r 5` — the speed anchor Kakeya's `kakeya bench` is
compared with in docs/benchmarks.md.

Usage: python3 scripts/bench_llama_cpp.py [--model models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf]
       [--threads 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "runs" / "llama.cpp"


def sdist() -> Path:
    tgz = WORK / f"llama_cpp_python-{VERSION}.tar.gz"
    if tgz.is_file() and hashlib.sha256(tgz.read_bytes()).hexdigest() == SHA256:
        return tgz
    index = "https://pypi.org/pypi/llama-cpp-python/json"
    meta = json.load(urllib.request.urlopen(index))
    files = meta.get("releases", {}).get(VERSION) or meta["urls"]
    name = f"llama_cpp_python-{VERSION}.tar.gz"
    url = next(u["url"] for u in files if u["filename"] == name)
    url = urllib.parse.urljoin(index, url)
    print(f"bench_llama_cpp: downloading {url}", file=sys.stderr)
    body = urllib.request.urlopen(url).read()
    if hashlib.sha256(body).hexdigest() != SHA256:
        sys.exit(f"bench_llama_cpp: sdist sha256 mismatch (expected {SHA256})")
    WORK.mkdir(parents=True, exist_ok=True)
    tgz.write_bytes(body)
    return tgz


def build() -> Path:
    exe = WORK / "build" / "bin" / "llama-bench"
    if exe.is_file():
        return exe
    src = WORK / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not src.is_dir():
        with tarfile.open(sdist()) as t:
            t.extractall(WORK, filter="data")
    subprocess.run(
        ["cmake", "-S", str(src), "-B", str(WORK / "build"), "-DCMAKE_BUILD_TYPE=Release",
         "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
         "-DLLAMA_BUILD_TOOLS=ON"],
        check=True,
    )
    subprocess.run(["cmake", "--build", str(WORK / "build"), "--target", "llama-bench", "-j", "2"], check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--build-only", action="store_true")
    args = ap.parse_args()
    exe = build()
    if args.build_only:
        print(exe)
        return
    subprocess.run(
        [str(exe), "-m", str(args.model), "-t", str(args.threads), "-p", "512", "-n", "128",
         "-r", str(args.reps), "-o", "md"],
        check=True,
    )


if __name__ == "__main__":
    main()
