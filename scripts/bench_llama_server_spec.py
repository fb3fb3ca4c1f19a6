#!/usr/bin/env python3
"""llama.cpp's own speculative decoding on the prompts `kakeya bench --drafter` measures: one
`llama-server` per setting (plain decoding, then `--spec-type ngram-mod` — llama.cpp's
draft-model-free lookup decoding), each prompt sent alone as a raw completion (greedy, a fixed
number of new tokens, no prompt cache), and the decode rate the server reports
(`timings.predicted_per_second`) aggregated as tokens over seconds.

The server is built by `scripts/bench_llama_cpp.py --server` (the same pinned llama.cpp and
build options as llama-bench). Run on an otherwise idle machine, beside
`kakeya bench --drafter D --prompts P --gen-tokens N --json` for Kakeya's figures.

Usage: python3 scripts/bench_llama_server_spec.py --prompts P.jsonl [--gen-tokens 128]
       [--threads 2] [--model models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf] [--json OUT]
(P: JSON lines with a "text" field, as `kakeya bench --prompts` reads; without --prompts,
`kakeya bench`'s 20 built-in prompts, read from crates/kakeya-cli/src/bench_spec.rs.)
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def builtin_prompts() -> list[str]:
    src = (ROOT / "crates/kakeya-cli/src/bench_spec.rs").read_text()
    block = re.search(r"DEFAULT_PROMPTS: \[&str; \d+\] = \[(.*?)\];", src, re.S)
    if not block:
        sys.exit("bench_llama_server_spec: the built-in prompts were not found in bench_spec.rs")
    return [json.loads(s) for s in re.findall(r'("(?:[^"\\]|\\.)*")', block.group(1))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def run_server(exe: Path, model: Path, threads: int, extra: list[str], prompts: list[str],
               gen: int) -> dict:
    port = free_port()
    cmd = [str(exe), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-np", "1",
           "-c", "4096", "--port", str(port), "--host", "127.0.0.1", "--no-webui", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            sys.exit("bench_llama_server_spec: llama-server did not come up")
        # One unmeasured warm-up request.
        post(port, "/completion", {"prompt": prompts[0], "n_predict": 8, "temperature": 0})
        per_prompt, tokens, secs, drafted, accepted = [], 0, 0.0, 0, 0
        for text in prompts:
            r = post(port, "/completion", {
                "prompt": text, "n_predict": gen, "temperature": 0, "top_k": 1,
                "cache_prompt": False, "ignore_eos": True,
            })
            t = r["timings"]
            tokens += t["predicted_n"]
            secs += t["predicted_ms"] / 1000.0
            drafted += t.get("draft_n", 0)
            accepted += t.get("draft_n_accepted", 0)
            per_prompt.append(t["predicted_per_second"])
        return {
            "args": extra,
            "decode_tok_s": tokens / max(secs, 1e-9),
            "per_prompt_tok_s": per_prompt,
            "drafted": drafted,
            "accepted": accepted,
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, default=ROOT / "models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.prompts:
        try:
            prompts = [json.loads(l)["text"] for l in a.prompts.read_text().splitlines() if l.strip()]
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"bench_llama_server_spec: {a.prompts}: expected JSON lines with \"text\" ({e})")
    else:
        prompts = builtin_prompts()
    exe = Path(subprocess.run([sys.executable, str(ROOT / "scripts/bench_llama_cpp.py"), "--server"],
                              check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    plain = run_server(exe, a.model, a.threads, [], prompts, a.gen_tokens)
    spec = run_server(exe, a.model, a.threads, ["--spec-type", "ngram-mod"], prompts, a.gen_tokens)
    report = {"prompts": len(prompts), "gen_tokens": a.gen_tokens, "plain": plain, "ngram_mod": spec,
              "speedup": spec["decode_tok_s"] / max(plain["decode_tok_s"], 1e-9)}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(a.json)
    print(f"{len(prompts)} prompts, {a.gen_tokens} new tokens each (greedy), llama-server -t {a.threads}")
    print("| llama-server | decode tok/s | drafts accepted |")
    print("|---|---|---|")
    for name, r in (("plain", plain), ("--spec-type ngram-mod", spec)):
        acc = f"{r['accepted']} of {r['drafted']}" if r["drafted"] else "—"
        print(f"| {name} | {r['decode_tok_s']:.1f} | {acc} |")
    print(f"ngram-mod over plain: {report['speedup']:.2f}×")


if __name__ == "__main__":
    main()
