#!/usr/bin/env python3
"""Aggregate tokens/s of `kakeya serve` at 1, 2, 3, 4 and 8 concurrent streams, for one or
more server binaries side by side.

    python3 scripts/serve_streams.py BIN [BIN ...] [--reps 3] [--tokens 64] [--server-args "..."]
                                     [--temperature T]

Each repetition starts every binary's server in turn (alternating, so that this VM's drift
hits them alike), warms it up, then runs, for each stream count n, 2n requests (4 for one
stream) of `--tokens` greedy tokens (sampled at `--temperature`, each request seeded by its
index) over n clients, with the load test's prompts
(`load_test.prompt`; a set of its own per count and repetition, the same for every binary).
Prints each binary's tok/s per count, one figure per repetition, and the medians.
"""

import argparse
import json
import os
import signal
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load_test  # noqa: E402

COUNTS = (1, 2, 3, 4, 8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("binaries", nargs="+")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--server-args", default="", help="extra `kakeya serve` arguments, one string")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    res: dict = {b: {n: [] for n in COUNTS} for b in args.binaries}

    def request(host: str, port: int, i: int, max_tokens: int) -> dict:
        return load_test.one_request(host, port, i, max_tokens, args.temperature)

    for rep in range(args.reps):
        for b in args.binaries:
            proc, host, port = load_test.start_server(b, args.server_args.split())
            try:
                load_test.run(host, port, 2, 2, 8)  # warm-up
                for n in COUNTS:
                    r = load_test.run(host, port, n, 2 * n if n > 1 else 4, args.tokens,
                                      first=3000 + 100 * n + 10 * rep, request=request)
                    if r["errors"]:
                        print(f"{b}: {r['errors']} errors at {n} streams", file=sys.stderr)
                        return 1
                    res[b][n].append(r["tok_s"])
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    for b in args.binaries:
        runs = {n: [round(v, 1) for v in vs] for n, vs in res[b].items()}
        meds = {n: round(statistics.median(vs), 1) for n, vs in res[b].items()}
        print(f"{b}: runs {runs}; medians {meds}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "server_args": args.server_args,
                       "temperature": args.temperature, "tok_s": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
