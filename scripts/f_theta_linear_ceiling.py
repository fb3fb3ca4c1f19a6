#!/usr/bin/env python3
"""How well can *any* linear map predict the verifier's raw K/V from a given per-position input?

    python3 scripts/f_theta_linear_ceiling.py data/capture-f-theta-270m [--out report.json]

f_θ (DESIGN §7) is linear: encoder and decoder are both Linear layers with no non-linearity in
between, so its output is an affine function of the drafter's per-position K/V. This script fits the
best such function in closed form (ridge least squares on the training sequences, the same split as
`kakeya train f-theta`: every 8th sequence is held out) and reports, on the held-out sequences, per
layer type:

- K and V relative MSE (MSE / mean square of the target), as `kakeya train f-theta` reports them;
- vDir = 1 − cos between predicted and true V head vectors (exactly the trainer's vDir: Gemma 3 has
  no v_norm), and the same for raw K head vectors (the trainer's kDir applies k_norm first).

for three inputs: the drafter's own tensor per path (f_θ's default, `inputs = "own"`), the drafter's
[K ; V] (`inputs = "both"`), and the verifier's aux hidden states that the drafter is fed (what a
cache would have to keep to do better than the drafter's K/V). It needs numpy and pyarrow, reads
only the columns it uses, and writes nothing unless `--out` is given.

These are ceilings on raw-vector fidelity, without rank limit; f_θ is trained for attention output
instead, so its raw rel-MSE can be worse while its mseO is better than this fit would give.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq


def read(root: Path, columns: list[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    m = json.loads((root / "manifest.json").read_text())
    seqs, parts = [], {c: [] for c in columns}
    for s in m["shards"]:
        t = pq.read_table(root / s["file"], columns=["seq"] + columns)
        seqs.append(t.column("seq").to_numpy())
        for c in columns:
            col = t.column(c).combine_chunks()
            width = col.type.list_size
            v = col.values.to_numpy(zero_copy_only=False).reshape(-1, width).astype(np.float32)
            # f16 overflow (the aux hidden states reach ±inf): saturate, as the trainer's reader does.
            parts[c].append(np.nan_to_num(v, nan=0.0, posinf=65504.0, neginf=-65504.0))
    return np.concatenate(seqs), {c: np.concatenate(v) for c, v in parts.items()}


def fit(x: np.ndarray, y: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ridge least squares with an intercept: returns (mean_x, W, mean_y) with y ≈ (x − mean_x)·W + mean_y."""
    mx, my = x.mean(0), y.mean(0)
    xc = (x - mx).astype(np.float64)
    gram = xc.T @ xc
    gram += ridge * np.trace(gram) / gram.shape[0] * np.eye(gram.shape[0])
    w = np.linalg.solve(gram, xc.T @ (y - my).astype(np.float64))
    return mx, w, my


def scores(pred: np.ndarray, true: np.ndarray, head_dim: int) -> dict[str, float]:
    rel = float(((pred - true) ** 2).mean() / (true**2).mean())
    p = pred.reshape(len(pred), -1, head_dim)
    t = true.reshape(len(true), -1, head_dim)
    cos = (p * t).sum(-1) / (np.linalg.norm(p, axis=-1) * np.linalg.norm(t, axis=-1) + 1e-12)
    return {"rel_mse": rel, "dir": float((1 - cos).mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("capture", type=Path)
    ap.add_argument("--heldout-every", type=int, default=8)
    ap.add_argument("--ridge", type=float, default=1e-4, help="ridge strength relative to mean eigenvalue")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    m = json.loads((a.capture / "manifest.json").read_text())
    layers = m["verifier_layers"]
    head_dim = m["dims"]["head_dim"]
    drafter = m.get("drafter_layers") or []
    if not drafter:
        sys.exit(f"{a.capture}: the capture has no drafter K/V columns")
    aux = [f"aux_{l:02}" for l in m["aux_layers"]]
    dk = [f"d{l:02}_k" for l in drafter]
    dv = [f"d{l:02}_v" for l in drafter]
    targets = {(p, l): f"v{l:02}_{p}_raw" for p in ("k", "v") for l in layers}
    seq, cols = read(a.capture, aux + dk + dv + list(targets.values()))
    held = (seq + 1) % a.heldout_every == 0
    print(f"{len(seq)} positions: {(~held).sum()} training, {held.sum()} held out", file=sys.stderr)

    cat = lambda names: np.concatenate([cols[n] for n in names], axis=1)  # noqa: E731
    inputs = {
        "own": {"k": cat(dk), "v": cat(dv)},
        "both": {"k": cat(dk + dv), "v": cat(dk + dv)},
        "aux": {"k": cat(aux), "v": cat(aux)},
    }
    # Gemma 3: every sixth layer is global (5, 11, 17 in the 270M model).
    kind = {l: ("global" if (l + 1) % 6 == 0 else "sliding") for l in layers}
    report = {"capture": str(a.capture), "ridge": a.ridge, "positions": int(len(seq)), "inputs": {}}
    for name, by_path in inputs.items():
        per_layer: dict[int, dict[str, float]] = {l: {} for l in layers}
        for p in ("k", "v"):
            x = by_path[p]
            y = np.concatenate([cols[targets[(p, l)]] for l in layers], axis=1)
            mx, w, my = fit(x[~held], y[~held], a.ridge)
            pred = ((x[held] - mx) @ w + my).astype(np.float32)
            width = y.shape[1] // len(layers)
            for i, l in enumerate(layers):
                s = scores(pred[:, i * width : (i + 1) * width], y[held][:, i * width : (i + 1) * width], head_dim)
                per_layer[l][f"{p}_rel_mse"] = s["rel_mse"]
                per_layer[l][f"{p}dir"] = s["dir"]
        by_kind = {}
        for k in ("sliding", "global"):
            ls = [l for l in layers if kind[l] == k]
            by_kind[k] = {m_: float(np.mean([per_layer[l][m_] for l in ls])) for m_ in per_layer[ls[0]]}
        report["inputs"][name] = {"in_dim": {p: int(by_path[p].shape[1]) for p in by_path}, **by_kind, "per_layer": per_layer}
        print(f"{name:5} in {by_path['k'].shape[1]:5}:", json.dumps(by_kind), file=sys.stderr)
    if a.out:
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(a.out)


if __name__ == "__main__":
    main()
