#!/usr/bin/env python3
"""Hugging Face transformers on the same GGUF and GPU as `kakeya bench --device cuda`: the side-by-side
anchor (decode and prefill tokens/s).

It mirrors `kakeya bench`'s two figures (crates/kakeya-cli/src/bench.rs):
  * ppN: one forward over N synthetic prompt ids (kakeya's xorshift stream, `<bos>` first) into an
    empty cache;
  * tgM: `generate` of M new tokens after `<bos>` alone, greedy, no stop token (every token
    generated), the KV cache on, as a user of transformers runs it.
Both after warm-up, the median of --runs, with the GPU synchronised around each timing. The
weights are the GGUF's, dequantised by transformers (`gguf_file=`) to f32, then cast to each
--dtype asked for. A MODEL_DIR without the GGUF is read as a Hugging Face folder (config.json and
model.safetensors, e.g. random_model.py's random weights of the same shapes).

  python3 scripts/device/hf_bench.py MODEL_DIR [--dtypes float32,bfloat16] [--runs 3] [--json OUT]
(needs torch, transformers >= 5 and the `gguf` package; the device run carries its wheel.)
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

GGUF = "gemma-3-270m-q4_k_m.gguf"
BOS = 2
MASK = (1 << 64) - 1


def synthetic_prompt(n: int, vocab: int, bos: int) -> list:
    """kakeya bench's prompt: `bos`, then xorshift64 ids in [4, vocab)."""
    x = 0x2545F4914F6CDD1D
    ids = [bos]
    while len(ids) < n:
        x ^= (x << 13) & MASK
        x ^= x >> 7
        x ^= (x << 17) & MASK
        ids.append(4 + x % (vocab - 4))
    return ids


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def bench(model, vocab: int, pp: int, tg: int, runs: int, warmup: int, attn: str) -> dict:
    dev = model.device
    prompt = torch.tensor([synthetic_prompt(pp, vocab, BOS)], device=dev)
    start = torch.tensor([[BOS]], device=dev)
    pp_rates, tg_rates, outs = [], [], []
    for i in range(warmup + runs):
        with torch.no_grad():
            t_pp = timed(lambda: model(prompt, use_cache=True, logits_to_keep=1))
            holder = {}

            def gen():
                holder["out"] = model.generate(
                    start,
                    attention_mask=torch.ones_like(start),
                    max_new_tokens=tg,
                    min_new_tokens=tg,
                    do_sample=False,
                    top_p=None,
                    top_k=None,
                    temperature=None,
                    pad_token_id=0,
                )

            t_tg = timed(gen)
        made = holder["out"].shape[1] - 1
        assert made == tg, f"generate made {made} tokens, wanted {tg}"
        if i >= warmup:
            pp_rates.append(pp / t_pp)
            tg_rates.append(tg / t_tg)
            outs.append(holder["out"][0, 1:].tolist())
    return {
        "attn_implementation": attn,
        f"pp{pp}_tok_s": statistics.median(pp_rates),
        f"pp{pp}_runs": pp_rates,
        f"tg{tg}_tok_s": statistics.median(tg_rates),
        f"tg{tg}_runs": tg_rates,
        "tg_tokens": outs[0],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    report = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "model": GGUF,
        "results": {},
    }
    # Dequantise the GGUF once (f32), then cast for each dtype asked for.
    t = time.perf_counter()
    gguf = {"gguf_file": GGUF} if (Path(a.model_dir) / GGUF).exists() else {}
    report["model"] = GGUF if gguf else a.model_dir
    model = AutoModelForCausalLM.from_pretrained(
        a.model_dir, dtype=torch.float32, attn_implementation=a.attn, **gguf
    ).to("cuda").eval()
    report["load_s"] = time.perf_counter() - t
    vocab = model.config.get_text_config().vocab_size
    for name in a.dtypes.split(","):
        model = model.to(getattr(torch, name))
        r = bench(model, vocab, a.prompt_tokens, a.gen_tokens, a.runs, a.warmup, a.attn)
        report["results"][name] = r
        print(f"{name}: pp{a.prompt_tokens} {r[f'pp{a.prompt_tokens}_tok_s']:.1f} tok/s, "
              f"tg{a.gen_tokens} {r[f'tg{a.gen_tokens}_tok_s']:.1f} tok/s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
