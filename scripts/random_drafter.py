#!/usr/bin/env python3
"""A drafter with random weights in the shape of a trained one: its drafts are useless and its
forward costs what the trained one's does, the input of the never-slower-than-AR benchmark.

Usage: scripts/random_drafter.py [SRC] [OUT] [--seed N]
(default SRC: checkpoints/drafter-gemma3-270m, OUT: runs/drafter-random)
Weights are N(0, 0.02²) (norm weights: 0, as initialised), the vocabulary map `d2t` and the
config are kept, so the folder loads for the same verifier. Pure Python (no PyTorch): about a
second per million weights. Written to a temporary folder, then renamed.
"""
import argparse
import array
import json
import os
import random
import shutil
import struct
import sys
import tempfile

# Bytes per element of the dtypes a drafter checkpoint holds.
SIZES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4}


def encode(values, dtype):
    """`values` (floats) as little-endian `dtype` bytes (BF16: round to nearest even)."""
    if dtype == "F32":
        return struct.pack(f"<{len(values)}f", *values)
    if dtype == "F16":
        return struct.pack(f"<{len(values)}e", *values)
    bits = array.array("I", struct.pack(f"<{len(values)}f", *values))
    out = array.array("H", ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 for b in bits))
    return out.tobytes()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src", nargs="?", default="checkpoints/drafter-gemma3-270m")
    ap.add_argument("out", nargs="?", default="runs/drafter-random")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    path = os.path.join(a.src, "model.safetensors")
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            data = f.read()
    except (OSError, ValueError, struct.error) as e:
        sys.exit(f"random_drafter: {path}: not a readable safetensors file ({e})")
    rng = random.Random(a.seed)
    parts, offset, layout = [], 0, {}
    for name in sorted(k for k in header if k != "__metadata__"):
        t = header[name]
        if t["dtype"] not in SIZES:
            sys.exit(f"random_drafter: {path}: tensor {name} has dtype {t['dtype']}")
        begin, end = t["data_offsets"]
        count = (end - begin) // SIZES[t["dtype"]]
        if t["dtype"] in ("I64", "I32"):
            blob = data[begin:end]
        elif name.endswith("norm.weight"):
            blob = bytes(end - begin)
        else:
            blob = encode([rng.gauss(0.0, 0.02) for _ in range(count)], t["dtype"])
        layout[name] = {**t, "data_offsets": [offset, offset + len(blob)]}
        parts.append(blob)
        offset += len(blob)
    layout["__metadata__"] = {"format": "pt"}
    head = json.dumps(layout, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    parent = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".drafter-random-")
    with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for p in parts:
            f.write(p)
    shutil.copy(os.path.join(a.src, "config.json"), os.path.join(tmp, "config.json"))
    if os.path.exists(a.out):
        shutil.rmtree(a.out)
    os.rename(tmp, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
