#!/usr/bin/env python3
"""Soak test of `kakeya serve` on loopback: mixed traffic for a fixed time, then a verdict.

Starts the server (the default model unless --server-args say otherwise; short timeouts so
that idle connections are closed within the run) and runs --workers threads until
--minutes pass, each picking, at random (seeded), one of:

- a well-formed completion or chat request, streamed or not, greedy or sampled;
- a streamed request whose client disconnects after the first few events;
- a malformed request (not JSON, an unknown field, a wrong type, an unknown model, a body
  over the limit, an unknown route, a wrong method);
- an idle half-request (part of a head, then silence past the header timeout).

The server's resident memory and its prefix cache's bytes (`/metrics`) are sampled every 2 s.
Verdict (exit status 1 when one fails): no well-formed request got a 5xx or a broken answer,
every malformed one got a 4xx, and the mean resident memory less the prefix cache's bytes
(which fill up to their budget by design) of the second half is within 2 % of the first
half's. Standard library
only; loopback only; bounded in time and in concurrent connections.

    python3 scripts/soak.py                      # 10 minutes, 6 workers, default model
    python3 scripts/soak.py --minutes 1 --json runs/soak.json
"""

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import sys
import threading
import time

from load_test import rss_bytes, start_server  # scripts/load_test.py

PROMPTS = [
    "The history of the printing press", "How bees make honey", "The rules of chess",
    "Why the sky is blue", "A day at a busy train station", "How volcanoes form",
]

MALFORMED = [
    ("POST", "/v1/completions", b"{not json"),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4, "frobnicate": 1}).encode()),
    ("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": "four"}).encode()),
    ("POST", "/v1/completions", json.dumps({"model": "no-such-model", "prompt": "x"}).encode()),
    ("POST", "/v1/chat/completions", json.dumps({"messages": "hello"}).encode()),
    ("POST", "/v1/completions", b"{\"prompt\": \"" + b"x" * (2 << 20) + b"\"}"),
    ("GET", "/v1/no-such-route", b""),
    ("GET", "/v1/completions", b""),
]


def prefix_cache_bytes(host, port):
    """The prefix cache's bytes from `/metrics` (0 when unreadable)."""
    try:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
    except (OSError, http.client.HTTPException):
        return 0
    for line in text.splitlines():
        if line.startswith("kakeya_prefix_cache_bytes "):
            return int(float(line.split()[1]))
    return 0


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {}
        self.failures = []

    def add(self, kind, status, ok, detail=""):
        with self.lock:
            key = f"{kind} {status}"
            self.counts[key] = self.counts.get(key, 0) + 1
            if not ok and len(self.failures) < 50:
                self.failures.append(f"{kind}: {status} {detail[:200]}")


def well_formed(host, port, rng, tally):
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    body = {"max_tokens": rng.choice([8, 16, 32]), "stream": stream}
    body["temperature"] = 0 if rng.random() < 0.5 else 0.8
    if body["temperature"]:
        body["seed"] = rng.randrange(1 << 30)
    text = rng.choice(PROMPTS)
    if chat:
        body["messages"] = [{"role": "user", "content": f"Tell me about {text.lower()}."}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = f"{text}:"
        path = "/v1/completions"
    kind = f"{'chat' if chat else 'completion'}{' streamed' if stream else ''}"
    conn = http.client.HTTPConnection(host, port, timeout=300)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read().decode(errors="replace")
        if r.status != 200:
            tally.add(kind, r.status, False, data)
            return
        if stream:
            ok = data.rstrip().endswith("data: [DONE]") and "\"error\"" not in data
        else:
            v = json.loads(data)
            ok = bool(v.get("choices")) and "usage" in v
        tally.add(kind, 200, ok, data)
    except (OSError, ValueError, http.client.HTTPException) as e:
        tally.add(kind, "exception", False, repr(e))
    finally:
        conn.close()


def disconnect(host, port, rng, tally):
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": 64, "stream": True, "temperature": 0}
    conn = http.client.HTTPConnection(host, port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.fp.readline()  # the first line of events, then gone
        tally.add("disconnect mid-stream", r.status, r.status == 200)
    except (OSError, http.client.HTTPException) as e:
        tally.add("disconnect mid-stream", "exception", False, repr(e))
    finally:
        conn.close()


def malformed(host, port, rng, tally):
    method, path, body = rng.choice(MALFORMED)
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read().decode(errors="replace")
        ok = 400 <= r.status < 500 and "\"error\"" in data
        tally.add(f"malformed {method} {path}", r.status, ok, data)
    except (OSError, http.client.HTTPException) as e:
        # A server may answer an oversized body and close before reading it all.
        tally.add(f"malformed {method} {path}", "exception", len(body) > (1 << 20), repr(e))
    finally:
        conn.close()


def half_request(host, port, rng, tally):
    s = socket.create_connection((host, port), timeout=30)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        s.settimeout(20)
        closed = s.recv(1) == b""
        tally.add("idle half-request", "closed" if closed else "open", closed)
    except OSError as e:
        tally.add("idle half-request", "exception", False, repr(e))
    finally:
        s.close()


def worker(host, port, seed, until, tally):
    rng = random.Random(seed)
    while time.time() < until:
        x = rng.random()
        if x < 0.6:
            well_formed(host, port, rng, tally)
        elif x < 0.7:
            disconnect(host, port, rng, tally)
        elif x < 0.9:
            malformed(host, port, rng, tally)
        else:
            half_request(host, port, rng, tally)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kakeya", default="target/release/kakeya")
    ap.add_argument("--server-args", default="", help="extra `kakeya serve` arguments")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    extra = ["--header-timeout-secs", "5", *a.server_args.split()]
    proc, host, port = start_server(a.kakeya, extra)
    tally = Tally()
    start = time.time()
    until = start + 60 * a.minutes
    threads = [threading.Thread(target=worker, args=(host, port, a.seed * 100 + i, until, tally))
               for i in range(a.workers)]
    for t in threads:
        t.start()
    rss = []  # (seconds, resident bytes, the prefix cache's bytes)
    while any(t.is_alive() for t in threads):
        rss.append((time.time() - start, rss_bytes(proc.pid), prefix_cache_bytes(host, port)))
        time.sleep(2)
    for t in threads:
        t.join()
    proc.terminate()
    proc.wait(timeout=60)
    mean = lambda xs: statistics.mean(xs or [0])
    halves = ([x for x in rss if x[0] < 30 * a.minutes], [x for x in rss if x[0] >= 30 * a.minutes])
    first, second = (mean([r for _, r, _ in h]) for h in halves)
    # The prefix cache fills up to its budget by design: what must stay flat is the rest.
    net = [mean([r - c for _, r, c in h]) for h in halves]
    growth = (net[1] - net[0]) / max(net[0], 1)
    report = {
        "minutes": a.minutes, "workers": a.workers, "counts": tally.counts,
        "failures": tally.failures, "rss_first_half_mib": first / 2**20,
        "rss_second_half_mib": second / 2**20,
        "rss_less_prefix_cache_first_half_mib": net[0] / 2**20,
        "rss_less_prefix_cache_second_half_mib": net[1] / 2**20,
        "growth_less_prefix_cache": growth,
        "samples": [{"secs": round(t, 1), "rss": r, "prefix_cache": c} for t, r, c in rss],
        "exit_status": proc.returncode,
    }
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump(report, f, indent=2)
        os.replace(a.json + ".tmp", a.json)
    print(f"{a.minutes} minutes, {a.workers} workers")
    for k in sorted(tally.counts):
        print(f"  {k}: {tally.counts[k]}")
    print(f"resident memory: {first / 2**20:.1f} MiB (first half), {second / 2**20:.1f} MiB "
          f"(second half); less the prefix cache's bytes: {net[0] / 2**20:.1f} MiB, "
          f"{net[1] / 2**20:.1f} MiB, {100 * growth:+.2f} %")
    for f in tally.failures:
        print(f"FAILED {f}")
    ok = not tally.failures and abs(growth) <= 0.02
    print("verdict:", "pass" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
