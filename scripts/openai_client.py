#!/usr/bin/env python3
"""Drives `kakeya serve` with the official `openai` Python package: completions and chat,
streamed and not, on whatever model the server serves (the default model by default).

    pip install openai
    ./target/release/kakeya serve &            # 127.0.0.1:8080, the default model
    python3 scripts/openai_client.py [--base-url http://127.0.0.1:8080/v1]

Checks that a greedy streamed answer adds up to the non-streamed one, that `usage` and
`finish_reason` are there, and that an unknown model is refused with the client's
NotFoundError; prints what it got. Exit status 1 on any mismatch.
"""

import argparse
import sys

try:
    import openai
    from openai import OpenAI
except ImportError:
    sys.exit("openai_client: the `openai` package is needed: pip install openai")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="not-needed")
    failures = []

    def check(ok: bool, what: str) -> None:
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    models = client.models.list()
    model = models.data[0].id
    check(len(models.data) == 1, f"/v1/models lists one model: {model}")

    prompt = "The three primary colours are"
    c = client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens, temperature=0)
    text = c.choices[0].text
    print(f"completion: {prompt!r} -> {text!r}")
    check(c.usage.completion_tokens > 0 and c.choices[0].finish_reason in ("stop", "length"),
          f"completion usage {c.usage.completion_tokens} tokens, finish_reason {c.choices[0].finish_reason}")
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                       temperature=0, stream=True)
    pieces = [ch.choices[0].text for ch in stream if ch.choices]
    check("".join(pieces) == text, f"streamed completion ({len(pieces)} chunks) equals the non-streamed one")

    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the boiling point of water at sea level?"},
    ]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens, temperature=0)
    reply = r.choices[0].message.content
    print(f"chat: -> {reply!r}")
    check(r.choices[0].message.role == "assistant" and r.usage.total_tokens > r.usage.prompt_tokens,
          f"chat usage {r.usage.prompt_tokens} + {r.usage.completion_tokens} tokens")
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, usage = [], None
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            pieces.append(ch.choices[0].delta.content)
        if ch.usage:
            usage = ch.usage
    check("".join(pieces) == reply, f"streamed chat ({len(pieces)} chunks) equals the non-streamed reply")
    check(usage is not None and usage.completion_tokens == r.usage.completion_tokens,
          "the streamed chat's usage chunk matches")

    sampled = [client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0.8,
                                         seed=7).choices[0].text for _ in range(2)]
    check(sampled[0] == sampled[1], "a seeded sampled completion repeats exactly")

    try:
        client.completions.create(model="no-such-model", prompt=prompt, max_tokens=4)
        check(False, "an unknown model is refused")
    except openai.NotFoundError as e:
        check(e.status_code == 404, f"an unknown model is refused: {e.body.get('message', e)!r}")
    try:
        client.completions.create(model=model, prompt=prompt, max_tokens=-3)
        check(False, "a negative max_tokens is refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400, f"a negative max_tokens is refused: {e.body.get('message', e)!r}")

    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
