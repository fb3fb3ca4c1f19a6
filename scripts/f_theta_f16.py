#!/usr/bin/env python3
"""Stores an exported f_θ folder's weights in float16 (half the bytes; Kakeya reads F32, F16
and BF16 and computes in f32). Usage: scripts/f_theta_f16.py SRC_DIR DST_DIR

Copies config.json unchanged and writes DST_DIR/f_theta.safetensors with every tensor cast to
float16 (through a temporary folder and a rename: nothing half-written)."""
import json
import os
import shutil
import sys

import numpy as np
from safetensors.numpy import load_file, save_file


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst = sys.argv[1], sys.argv[2]
    cfg = os.path.join(src, "config.json")
    with open(cfg) as f:
        if json.load(f).get("format") != "kakeya-f-theta":
            print(f"{cfg}: not an f_θ export", file=sys.stderr)
            return 1
    tensors = load_file(os.path.join(src, "f_theta.safetensors"))
    big = {k: float(np.abs(v).max()) for k, v in tensors.items() if np.abs(v).max() > 65504}
    if big:
        print(f"values beyond float16 range: {big}", file=sys.stderr)
        return 1
    tmp = dst.rstrip("/") + f".tmp-{os.getpid()}"
    os.makedirs(tmp)
    shutil.copy(cfg, os.path.join(tmp, "config.json"))
    save_file({k: v.astype(np.float16) for k, v in tensors.items()},
              os.path.join(tmp, "f_theta.safetensors"))
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.rename(tmp, dst)
    print(f"{dst}: {len(tensors)} tensors in float16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
