#!/usr/bin/env python3
"""Compares a CPU run with the same run on another device (scripts/wgpu_real_model.sh).

    python3 scripts/wgpu_compare.py infer   CPU.json DEVICE.json   # `kakeya infer --json`
    python3 scripts/wgpu_compare.py train   CPU_RUN DEVICE_RUN     # run folders (report.json)
    python3 scripts/wgpu_compare.py capture CPU_DIR DEVICE_DIR     # `kakeya capture` datasets

infer: the generated token ids must be equal. train: per-step losses and the held-out figures
within TOL (relative to max(|cpu|, 1); default 1e-3). capture: the seq/pos/token/in_prompt
columns equal, and each tensor group's largest difference relative to its row's largest |value|
(the CPU's) printed and held to two f16 steps of that value (2^-9) by default. Needs pyarrow and numpy for captures. Prints one line;
exits 1 when the check fails.
"""
import json
import sys
from pathlib import Path

TOL = float(sys.argv[4]) if len(sys.argv) > 4 else None


def infer(a: str, b: str) -> bool:
    x, y = json.load(open(a)), json.load(open(b))
    same = x["tokens"] == y["tokens"]
    print(f"infer {x['stats']['kv_mode']}: {len(x['tokens'])} tokens, equal: {same}; "
          f"KV bytes {x['stats']['kv_bytes']} (cpu) / {y['stats']['kv_bytes']} (device)")
    return same


def figures(run: str) -> list:
    r = json.load(open(Path(run) / "report.json"))
    out = [s["loss"] for s in r["steps"]]
    for e in r.get("evals", []):
        out += [v for k, v in e.items() if isinstance(v, float)]
    return out


def train(a: str, b: str) -> bool:
    x, y = figures(a), figures(b)
    tol = TOL or 1e-3
    err = max(abs(p - q) / max(abs(p), 1.0) for p, q in zip(x, y))
    ok = len(x) == len(y) and err <= tol
    print(f"train {Path(a).name}: {len(x)} figures, max rel |Δ| {err:.2e} (tolerance {tol:g}): {ok}")
    return ok


def capture(a: str, b: str) -> bool:
    import numpy as np
    import pyarrow.parquet as pq
    tol = TOL or 2.0 ** -9
    m = json.load(open(Path(a) / "manifest.json"))
    worst, same = {}, True
    for s in m["shards"]:
        x, y = pq.read_table(Path(a) / s["file"]), pq.read_table(Path(b) / s["file"])
        for n in x.schema.names:
            cx, cy = x.column(n), y.column(n)
            if not str(cx.type).startswith("fixed_size_list"):
                same &= cx.to_pylist() == cy.to_pylist()
                continue
            w = cx.type.list_size
            vx = np.asarray(cx.combine_chunks().flatten().to_numpy(zero_copy_only=False), np.float32)
            vy = np.asarray(cy.combine_chunks().flatten().to_numpy(zero_copy_only=False), np.float32)
            vx, vy = vx.reshape(-1, w), vy.reshape(-1, w)
            # f16 saturation (±inf or ±65504 in either) left out.
            held = np.isfinite(vx) & np.isfinite(vy) & (np.abs(vx) < 65504) & (np.abs(vy) < 65504)
            diff = np.abs(np.subtract(vx, vy, where=held, out=np.zeros_like(vx)))
            scale = np.max(np.where(held, np.abs(vx), 0.0), axis=1, keepdims=True)
            group = "".join(c for c in n if not c.isdigit()).strip("_")
            err = float(np.max(diff / np.maximum(scale, 1e-30)))
            worst[group] = max(worst.get(group, 0.0), err)
    ok = same and all(e <= tol for e in worst.values())
    print(f"capture {Path(a).name}: ids equal: {same}; max rel |Δ| "
          + ", ".join(f"{g} {e:.2e}" for g, e in worst.items()) + f" (tolerance {tol:.2e}): {ok}")
    return ok


if __name__ == "__main__":
    kind, a, b = sys.argv[1:4]
    sys.exit(0 if {"infer": infer, "train": train, "capture": capture}[kind](a, b) else 1)
