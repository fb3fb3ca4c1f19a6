#!/usr/bin/env python3
"""The prefix cache of `kakeya serve` at work: chat requests that share a system prompt (a
help desk's ≈ 180-token instructions) and ask different questions, against a server with the
cache on (the default) and one with `--prefix-cache-mib 0`, one after the other on loopback.
Prints, per server and client count: prompt tokens, prompt tokens the cache supplied
(`usage.prompt_tokens_details.cached_tokens`), time to first token (p50) and aggregate
tokens/s. Standard library only.

    python3 scripts/prefix_cache_bench.py [--kakeya ./target/release/kakeya] [--json out.json]

Every request streams a greedy 32-token reply.
"""

import argparse
import http.client
import json
import signal
import statistics
import time

from load_test import run, start_server

SYSTEM = (
    "You are the help desk of a small public library. Opening hours: Monday to Friday "
    "9:00-19:00, Saturday 10:00-16:00, closed on Sundays and public holidays. Members may "
    "borrow up to 12 items for three weeks; renewals are possible twice unless another member "
    "has reserved the item. Late returns cost 20 cents per item per day, capped at 5 euros. "
    "Printing costs 10 cents per page in black and white and 50 cents in colour. Study rooms "
    "on the second floor can be booked for up to three hours a day at the front desk or "
    "online. The children's section hosts story time every Wednesday at 15:00. Answer briefly "
    "and politely; if you do not know, say so and suggest the front desk."
)
QUESTIONS = [
    "Can I borrow 15 books?", "When are you open on Saturday?", "How much is colour printing?",
    "Can I renew a reserved book?", "Is there story time for kids?", "How do I book a study room?",
    "What is the late fee?", "Are you open on Sunday?",
]


def ask(host: str, port: int, i: int, max_tokens: int) -> dict:
    """One streamed chat request: its time to first token, latency and usage."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (ticket {i})"}]
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    ttft, usage = None, None
    conn = http.client.HTTPConnection(host, port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        return {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[5:])
        if ttft is None and ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
            ttft = time.perf_counter() - t0
        if ev.get("usage"):
            usage = ev["usage"]
    conn.close()
    return {"ttft": ttft or 0.0, "latency": time.perf_counter() - t0,
            "tokens": usage["completion_tokens"], "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def measure(host: str, port: int, clients: int, requests: int, first: int) -> dict:
    """`load_test.run` with these chat requests, plus their prompt and cached tokens."""
    seen: list[dict] = []

    def request(host: str, port: int, i: int, max_tokens: int) -> dict:
        r = ask(host, port, i, max_tokens)
        seen.append(r)
        return r

    fig = run(host, port, clients, requests, 32, first=first, request=request)
    if fig["errors"]:
        raise SystemExit(f"prefix_cache_bench: {fig['error_samples']}")
    fig["prompt_tokens"] = statistics.mean(r["prompt"] for r in seen)
    fig["cached_tokens"] = statistics.mean(r["cached"] for r in seen)
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kakeya", default="./target/release/kakeya")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    report = {}
    for name, extra in (("cache on", []), ("cache off", ["--prefix-cache-mib", "0"])):
        proc, host, port = start_server(args.kakeya, extra)
        try:
            ask(host, port, 999, 32)  # warm-up (with the cache on: the system prompt's first entry)
            report[name] = []
            for clients, requests in ((1, 8), (8, 32)):
                r = measure(host, port, clients, requests, 100 * clients)
                report[name].append(r)
                print(f"{name}: {clients} client(s), {requests} requests: prompt {r['prompt_tokens']:.0f} "
                      f"tokens, {r['cached_tokens']:.0f} from the cache; TTFT p50 "
                      f"{r['ttft_p50_s'] * 1000:.0f} ms; {r['tok_s']:.1f} tok/s", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
