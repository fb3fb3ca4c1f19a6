#!/usr/bin/env python3
"""A drafter with random weights in the shape of a trained one (useless drafts): the input of
the never-slower-than-AR benchmark (issue 16).

Usage: scripts/random_drafter.py [SRC] [OUT] [--seed N]
(default SRC: checkpoints/drafter-gemma3-270m, OUT: runs/drafter-random)
Weights are N(0, 0.02²) (norm weights: 0, as initialised), the vocabulary map `d2t` and the
config are kept, so the folder loads for the same verifier. Written to a temporary folder, then
renamed.
"""
import argparse
import json
import os
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src", nargs="?", default="checkpoints/drafter-gemma3-270m")
    ap.add_argument("out", nargs="?", default="runs/drafter-random")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(a.seed)
    tensors = {}
    with safe_open(os.path.join(a.src, "model.safetensors"), "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            if not t.is_floating_point():
                tensors[k] = t
            elif k.endswith("norm.weight"):
                tensors[k] = torch.zeros_like(t)
            else:
                r = torch.randn(t.shape, generator=g, dtype=torch.float32) * 0.02
                tensors[k] = r.to(t.dtype)
    parent = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".drafter-random-")
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(a.src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if os.path.exists(a.out):
        shutil.rmtree(a.out)
    os.rename(tmp, a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
