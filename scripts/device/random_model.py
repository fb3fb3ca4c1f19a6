#!/usr/bin/env python3
"""Writes a random-weight model folder with a real model's shapes, for kernel profiling on a lent
GPU without carrying the real weights: config.json copied, model.safetensors with every tensor of
the spec (name -> shape, f32) drawn N(0, 0.02²), norms around 0 (Gemma's weight is 1 + w).

  python3 scripts/device/random_model.py CONFIG.json SPEC.json OUT_DIR
(SPEC.json: {"name": [dims...]}, e.g. read from the header of `kakeya convert`'s output.)
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def main(config: str, spec: str, out: str):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(config, out / "config.json")
    rng = np.random.default_rng(0)
    tensors = {
        name: (rng.standard_normal(shape, dtype=np.float32) * 0.02)
        for name, shape in json.load(open(spec)).items()
    }
    save_file(tensors, str(out / "model.safetensors"))
    print(f"wrote {out}: {len(tensors)} tensors, {sum(t.size for t in tensors.values())} values")


if __name__ == "__main__":
    main(*sys.argv[1:4])
