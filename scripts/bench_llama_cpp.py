#!/usr/bin/env python3
"""Build llama.cpp's `llama-bench` from PyPI's `llama-cpp-python` sdist and run it on a GGUF.

The sdist vendors llama.cpp; we fetch it from PyPI (pinned version and SHA-256), build only
`llama-bench` (CPU backend, no curl), cache the build under `runs/llama.cpp/` (git-ignored),
and run `llama-bench -t 2 -p 512 -n 128 -r 5` — the speed anchor Kakeya's `kakeya bench` is
compared with in docs/benchmarks.md.

What a fresh machine lacks is fetched: cmake from PyPI into `runs/llama.cpp/cmake-venv` when
none is on PATH (a C/C++ compiler must be there: `apt-get install build-essential`).

The instruction set is chosen explicitly, not by `GGML_NATIVE=ON`: on Intel machines with AMX,
the native build's AMX path dies with SIGSEGV in `ggml_backend_amx_mul_mat` on this model, so
the build turns on the AVX/AVX2/FMA/F16C/AVX-512 (F, VBMI, VNNI, BF16)/AVX-VNNI options that
`/proc/cpuinfo` reports and leaves AMX off. Each flag set builds in its own folder. Where
`/proc/cpuinfo` is missing (macOS), `GGML_NATIVE=ON`.

Usage: python3 scripts/bench_llama_cpp.py [--model models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf]
       [--threads 2] [--reps 5] [--prompt 512] [--gen 128] [--depth 0] [--cache-type f16]
       [--flash-attn]
       python3 scripts/bench_llama_cpp.py --server   (builds `llama-server` the same way)
(`--depth D`: both tests after D context tokens, llama-bench's `-d`; `--cache-type q8_0`: the
KV cache's type, `-ctk`/`-ctv`; `--prompt 0` or `--gen 0` leaves that test out.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "runs" / "llama.cpp"


def sdist() -> Path:
    tgz = WORK / f"llama_cpp_python-{VERSION}.tar.gz"
    if tgz.is_file() and hashlib.sha256(tgz.read_bytes()).hexdigest() == SHA256:
        return tgz
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"bench_llama_cpp: pip download llama-cpp-python=={VERSION} (sdist)", file=sys.stderr)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}",
         "--no-deps", "--no-binary", "llama-cpp-python", "-d", str(WORK)],
        check=True,
    )
    if not tgz.is_file() or hashlib.sha256(tgz.read_bytes()).hexdigest() != SHA256:
        tgz.unlink(missing_ok=True)
        sys.exit(f"bench_llama_cpp: {tgz}: sdist missing or sha256 mismatch (expected {SHA256})")
    return tgz


CMAKE_PIN = "cmake==4.4.4"

# ggml's CMake option per /proc/cpuinfo flag (the CPU backend's x86 variants).
ISA_OPTIONS = [
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
    ("avx_vnni", "GGML_AVX_VNNI"),
]


def cmake() -> str:
    """cmake on PATH, else one installed from PyPI into a venv under runs/llama.cpp/."""
    found = shutil.which("cmake")
    if found:
        return found
    venv = WORK / "cmake-venv"
    exe = venv / "bin" / "cmake"
    if not exe.is_file():
        print(f"bench_llama_cpp: no cmake on PATH; installing {CMAKE_PIN} from PyPI into {venv}",
              file=sys.stderr)
        WORK.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", CMAKE_PIN], check=True)
    return str(exe)


def isa_options() -> tuple[str, list[str]]:
    """A build-folder tag and the ggml ISA options for this CPU (AMX always off)."""
    try:
        flags: set[str] = set()
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        return "native", ["-DGGML_NATIVE=ON"]
    if not flags or platform.machine() not in ("x86_64", "AMD64"):
        return "native", ["-DGGML_NATIVE=ON"]
    opts = ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    on = []
    for flag, option in ISA_OPTIONS:
        state = "ON" if flag in flags else "OFF"
        opts.append(f"-D{option}={state}")
        if state == "ON":
            on.append(flag)
    return "-".join(on) or "generic", opts


def source() -> Path:
    """The llama.cpp tree vendored in the pinned sdist (fetched and unpacked once)."""
    src = WORK / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not src.is_dir():
        with tarfile.open(sdist()) as t:
            t.extractall(WORK, filter="data")
    return src


def build(target: str = "llama-bench") -> Path:
    """`target` (llama-bench or llama-server), built once per instruction set."""
    tag, isa = isa_options()
    out = WORK / f"build-{tag}"
    exe = out / "bin" / target
    if exe.is_file():
        return exe
    src = source()
    tool = cmake()
    print(f"bench_llama_cpp: building {target} in {out} with {' '.join(isa)}", file=sys.stderr)
    subprocess.run(
        [tool, "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
         "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
         *isa],
        check=True,
    )
    subprocess.run([tool, "--build", str(out), "--target", target, "-j", "2"], check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens of the pp test (0: none)")
    ap.add_argument("--gen", type=int, default=128, help="tokens of the tg test (0: none)")
    ap.add_argument("--depth", type=int, default=0, help="context tokens before the tests (-d)")
    ap.add_argument("--cache-type", default="f16", help="KV cache type, -ctk and -ctv (f16, q8_0, q4_0)")
    ap.add_argument("--flash-attn", action="store_true", help="flash attention (-fa 1)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--server", action="store_true", help="build llama-server and print its path")
    ap.add_argument("--json", type=Path, help="also write llama-bench's JSON records here")
    args = ap.parse_args()
    if args.server:
        print(build("llama-server"))
        return
    exe = build()
    if args.build_only:
        print(exe)
        return
    cmd = [str(exe), "-m", str(args.model), "-t", str(args.threads), "-p", str(args.prompt),
           "-n", str(args.gen), "-r", str(args.reps)]
    if args.depth:
        cmd += ["-d", str(args.depth)]
    if args.cache_type != "f16":
        cmd += ["-ctk", args.cache_type, "-ctv", args.cache_type]
    if args.flash_attn:
        cmd += ["-fa", "1"]
    if args.json is None:
        subprocess.run([*cmd, "-o", "md"], check=True)
        return
    out = subprocess.run([*cmd, "-o", "json"], check=True, capture_output=True, text=True).stdout
    records = json.loads(out)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=2))
    tmp.replace(args.json)
    print("| test | llama.cpp tok/s (mean ± sd) |")
    print("|---|---|")
    for r in records:
        test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        if r.get("n_depth"):
            test += f" @ d{r['n_depth']}"
        print(f"| {test} | {r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} |")


if __name__ == "__main__":
    main()
