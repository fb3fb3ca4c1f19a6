#!/usr/bin/env python3
"""Load test of `kakeya serve` on loopback: starts the server, measures how aggregate
throughput grows from one stream to eight (batching at work; the two alternated, medians
of three; a lone stream decodes speculatively), then runs rounds of many concurrent
streaming clients and reports errors, time to first token (p50/p99), aggregate tokens/s and
the server's resident memory after each round; last, the single stream again on a server
that never speculates (`--no-drafter`), the reference for what batching alone gives.
Standard library only.

    python3 scripts/load_test.py                      # default model, 64 clients, 2 rounds
    python3 scripts/load_test.py --clients 64 --requests 128 --max-tokens 32 --json out.json

Every request streams a completion of exactly --max-tokens tokens (`ignore_eos`, greedy) for
one of a set of varied prompts. The resident memory is read 2 s after each round (the server
idle). Exit status 1 when a request failed or the memory after the last round is more than
2 % above that after the first.
"""

import argparse
import http.client
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time

TOPICS = [
    "the history of the printing press", "how bees make honey", "the rules of chess",
    "why the sky is blue", "the life of a lighthouse keeper", "how bread rises",
    "the first flight across the Atlantic", "a walk through an autumn forest",
    "how a steam engine works", "the migration of whales", "the invention of the telephone",
    "a day at a busy train station", "how volcanoes form", "the story of the Silk Road",
    "a recipe for vegetable soup", "the water cycle",
]


def prompt(i: int) -> str:
    return f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}. Paragraph {i}:"


def start_server(kakeya: str, extra: list[str]) -> tuple[subprocess.Popen, str, int]:
    proc = subprocess.Popen([kakeya, "serve", "--port", "0", *extra], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    for line in proc.stderr:
        sys.stderr.write(line)
        if "http://" in line:
            host, port = line.split("http://", 1)[1].split()[0].rsplit(":", 1)
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, host, int(port)
        if time.time() > deadline:
            break
    proc.kill()
    sys.exit("load_test: the server did not start")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def replays(host: str, port: int) -> dict:
    """The server's counts of greedy forwards recorded, replayed and declined for replay (a
    GPU replays recorded forwards; the CPU records none), from /metrics."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for name in ("recorded", "replayed", "replay_declined"):
        key = f"kakeya_forwards_{name}_total"
        out[name] = next((float(l.split()[-1]) for l in text.splitlines() if l.startswith(key + " ")), 0.0)
    return out


def one_request(host: str, port: int, i: int, max_tokens: int, temperature: float = 0.0) -> dict:
    """Streams one completion (greedy, or sampled at `temperature` with seed `i`); returns its
    timings and token count (or the error)."""
    req = {"prompt": prompt(i), "max_tokens": max_tokens, "temperature": temperature,
           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if temperature > 0:
        req["seed"] = i
    body = json.dumps(req)
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    try:
        conn = http.client.HTTPConnection(host, port, timeout=600)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        done = False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                return {"error": ev["error"]["message"]}
            if ev.get("choices") and ev["choices"][0].get("text") and ttft is None:
                ttft = time.perf_counter() - t0
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
        conn.close()
        if not done:
            return {"error": "the stream ended without [DONE]"}
    except (OSError, http.client.HTTPException, ValueError) as e:
        return {"error": repr(e)}
    return {"ttft": ttft or 0.0, "latency": time.perf_counter() - t0, "tokens": tokens}


def run(host: str, port: int, clients: int, requests: int, max_tokens: int, first: int = 0,
        request=None) -> dict:
    """`requests` requests over `clients` concurrent clients; aggregate figures. `request(host,
    port, i, max_tokens)` sends request `i` (default: [`one_request`]) and returns its
    `ttft`, `latency` and `tokens`, or an `error`."""
    request = request or one_request
    todo: queue.Queue = queue.Queue()
    for i in range(requests):
        todo.put(first + i)
    results: list[dict] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            r = request(host, port, i, max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttfts = sorted(r["ttft"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)

    def pct(p: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else 0.0

    return {"clients": clients, "requests": requests, "errors": len(errors), "error_samples": errors[:3],
            "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall if wall > 0 else 0.0,
            "ttft_p50_s": pct(0.50), "ttft_p99_s": pct(0.99),
            "latency_p50_s": statistics.median(r["latency"] for r in ok) if ok else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kakeya", default="./target/release/kakeya")
    ap.add_argument("--server-args", default="", help="extra `kakeya serve` arguments, one string")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128, help="requests per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--scaling-tokens", type=int, default=64, help="tokens per request of the 1-vs-8 streams runs")
    ap.add_argument("--scaling-runs", type=int, default=3,
                    help="alternations of the 1-stream and 8-stream runs (the ratio of their medians)")
    ap.add_argument("--no-plain-reference", action="store_true",
                    help="skip the single stream on a plain-decoding server (--no-drafter), the "
                         "reference that shows what batching alone gives")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    proc, host, port = start_server(args.kakeya, args.server_args.split())
    report: dict = {"server_args": args.server_args}
    try:
        run(host, port, 2, 2, 8)  # warm-up
        # One stream and eight streams alternately, each --scaling-runs times: this VM's speed
        # drifts between minutes, so the ratio is that of the two medians.
        ones, eights = [], []
        for k in range(args.scaling_runs):
            ones.append(run(host, port, 1, 4, args.scaling_tokens, first=1000 + 100 * k))
            eights.append(run(host, port, 8, 16, args.scaling_tokens, first=2000 + 100 * k))
            print(f"1 stream: {ones[-1]['tok_s']:.1f} tok/s; 8 streams: {eights[-1]['tok_s']:.1f} tok/s "
                  f"aggregate = {eights[-1]['tok_s'] / ones[-1]['tok_s']:.2f}x", flush=True)
        one_med = statistics.median(r["tok_s"] for r in ones)
        eight_med = statistics.median(r["tok_s"] for r in eights)
        report["one_stream_runs"], report["eight_streams_runs"] = ones, eights
        report["one_stream_tok_s"], report["eight_streams_tok_s"] = one_med, eight_med
        report["eight_over_one"] = eight_med / one_med if one_med else 0.0
        print(f"medians of {args.scaling_runs}: 1 stream {one_med:.1f} tok/s; 8 streams {eight_med:.1f} tok/s "
              f"aggregate = {report['eight_over_one']:.2f}x", flush=True)
        rounds = []
        for r in range(args.rounds):
            fig = run(host, port, args.clients, args.requests, args.max_tokens, first=10000 * (r + 1))
            time.sleep(2.0)  # the server idle again: what it holds, not what is in flight
            fig["rss_bytes"] = rss_bytes(proc.pid)
            rounds.append(fig)
            print(f"round {r + 1}: {fig['requests']} requests over {fig['clients']} clients, "
                  f"{fig['errors']} errors, TTFT p50 {fig['ttft_p50_s']:.2f} s p99 {fig['ttft_p99_s']:.2f} s, "
                  f"{fig['tok_s']:.1f} tok/s aggregate, {fig['wall_s']:.1f} s, "
                  f"RSS {fig['rss_bytes'] / 2**20:.1f} MiB", flush=True)
        report["rounds"] = rounds
        report["replays"] = replays(host, port)
        print(f"replays: {report['replays']}", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            report["exit_status"] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            report["exit_status"] = "killed"
    if not args.no_plain_reference and report.get("eight_streams_tok_s"):
        # The same single-stream requests on a server that never speculates: the 8 streams
        # above against it are what batching alone gives.
        plain, host, port = start_server(args.kakeya, [*args.server_args.split(), "--no-drafter"])
        try:
            run(host, port, 2, 2, 8)  # warm-up
            runs = [run(host, port, 1, 4, args.scaling_tokens, first=1000 + 100 * k)
                    for k in range(args.scaling_runs)]
        finally:
            plain.send_signal(signal.SIGTERM)
            plain.wait(timeout=60)
        med = statistics.median(r["tok_s"] for r in runs)
        report["one_stream_plain_runs"], report["one_stream_plain_tok_s"] = runs, med
        report["eight_over_plain_one"] = report["eight_streams_tok_s"] / med if med else 0.0
        print(f"reference: 1 stream without speculation (--no-drafter) {med:.1f} tok/s; "
              f"8 streams above = {report['eight_over_plain_one']:.2f}x that", flush=True)
    errors = sum(r["errors"] for r in report.get("rounds", []))
    rss = [r["rss_bytes"] for r in report.get("rounds", [])]
    # Growth = a trend, not the allocator's round-to-round noise: the last idle round against
    # the first (every round after the first runs the same load on warm caches).
    growth = rss[-1] / rss[0] - 1 if len(rss) > 1 else 0.0
    report["rss_growth"] = growth
    ok = errors == 0 and growth <= 0.02 and bool(report.get("rounds"))
    print(f"errors {errors}; RSS after each round (idle) {[f'{b / 2**20:.1f} MiB' for b in rss]}, "
          f"last vs first {growth * 100:+.2f}%; server exit {report['exit_status']}; "
          f"{'PASS' if ok else 'FAIL'}")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=2)
        os.replace(tmp, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
