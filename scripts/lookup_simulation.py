#!/usr/bin/env python3
"""Prompt lookup (n-gram drafting) simulated on the default model's own greedy outputs: for
`kakeya bench`'s 20 built-in prompts, 128 greedy tokens each (`kakeya infer --json
--no-drafter --no-loop-guard`), block-8 lookups of the last 3, 2 or 1 tokens' most recent
earlier occurrence, as `--draft ngram --block-size 8` runs them. Prints tokens committed per
block, the drafts accepted by matched tail length, and what an oracle choosing the best
earlier occurrence would commit. Standard library only.

    python3 scripts/lookup_simulation.py [--kakeya ./target/release/kakeya]
"""

import argparse
import json
import re
import subprocess

BLOCK = 8


def prompts(root: str) -> list[str]:
    src = open(f"{root}/crates/kakeya-cli/src/bench_spec.rs").read()
    body = src[src.index("pub const DEFAULT_PROMPTS"):]
    body = body[body.index("= [") + 3: body.index("];")]
    return [json.loads(m) for m in re.findall(r'"(?:[^"\\]|\\.)*"', body)]


def occurrences(tokens: list[int]) -> list[tuple[int, int]]:
    """(tail length, index after the occurrence) of every earlier occurrence of the last 3, 2,
    then 1 tokens, most recent first within each length."""
    out = []
    for n in (3, 2, 1):
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        out += [(n, i + n) for i in range(len(tokens) - n - 1, -1, -1) if tokens[i:i + n] == tail]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kakeya", default="./target/release/kakeya")
    args = ap.parse_args()
    seqs = []
    for p in prompts("."):
        r = subprocess.run([args.kakeya, "infer", "--prompt", p, "--max-tokens", "128", "--json",
                            "--no-drafter", "--no-loop-guard"], capture_output=True, text=True, check=True)
        d = json.loads(r.stdout)
        seqs.append(d["prompt_ids"] + d["tokens"])
        seqs[-1] = (len(d["prompt_ids"]), seqs[-1])
    blocks = committed = oracle_committed = 0
    by_tail: dict[int, list[int]] = {}
    for n_prompt, full in seqs:
        pos, end = n_prompt + 1, len(full)
        while pos < end:
            occ = occurrences(full[:pos])

            def accepted(nxt: int) -> int:
                a = 0
                for j, t in enumerate(full[nxt:nxt + BLOCK - 1]):
                    if pos + j < end and full[pos + j] == t:
                        a += 1
                    else:
                        break
                return a

            a = accepted(occ[0][1]) if occ else 0
            if occ:
                s = by_tail.setdefault(occ[0][0], [0, 0, 0])
                s[0] += 1
                s[1] += a
                s[2] += a > 0
            best = max((accepted(nx) for _, nx in occ), default=0)
            step = min(a + 1, end - pos)
            blocks += 1
            committed += step
            oracle_committed += min(best + 1, end - pos)
            pos += step
    print(f"{blocks} blocks, {committed / blocks:.3f} tokens committed per block "
          f"(an oracle choosing the best occurrence: {oracle_committed / blocks:.3f}, same blocks)")
    print(f"no match: {blocks - sum(s[0] for s in by_tail.values())} blocks")
    for n, (c, a, first) in sorted(by_tail.items()):
        print(f"tail of {n}: {c} blocks, {a / c:.2f} drafts accepted per block, first draft right {first / c:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
