#!/usr/bin/env python3
"""Writes data/corpus/synthetic.jsonl: varied completion prompts for drafter training.

Deterministic (fixed seed): topic x template combinations, shuffled, plus code openers. The
prompts are written for Kakeya (CC0, see data/corpus/README.md). None of them is one of
`kakeya bench`'s 20 built-in prompts, which stay held out for the speed-up measurement.
Usage: python3 scripts/make_prompts.py [--count 260] [--out data/corpus/synthetic.jsonl]
"""
import argparse
import json
import random

TOPICS = [
    "volcanoes", "the moon landing", "honeybees", "the Roman Empire", "electric cars",
    "coral reefs", "the human heart", "chess", "jazz music", "the Industrial Revolution",
    "black holes", "rainforests", "the internet", "ancient Egypt", "photosynthesis",
    "earthquakes", "the French Revolution", "solar panels", "whales", "the Olympic Games",
    "vaccines", "glaciers", "the printing of money", "octopuses", "the Silk Road",
    "climate change", "dinosaurs", "the stock market", "coffee", "the Renaissance",
    "submarines", "deserts", "the immune system", "bridges", "the piano", "tea ceremonies",
    "wind turbines", "penguins", "the telescope", "public libraries", "trains",
    "the Amazon river", "mushrooms", "cryptography", "the Vikings", "recycling",
    "lightning", "the violin", "castles", "bees and flowers", "nuclear power",
    "the Moon's phases", "ant colonies", "paper making", "the metric system",
    "hurricanes", "owls", "the wheel", "maps and map making", "soap",
]

TEMPLATES = [
    "Here are five interesting facts about {t}:\n1.",
    "A short essay on {t}.\n\n",
    "Q: What should every student know about {t}?\nA:",
    "The most surprising thing about {t} is",
    "Write a poem about {t}.\n\n",
    "An encyclopedia entry: {T}\n\n",
    "A conversation between two friends about {t}:\n\nAnna:",
    "If you want to understand {t}, start with",
    "Lecture notes on {t}\n\nIntroduction\n",
    "Why {t} matters: a simple explanation for children.\n\n",
    "The history of {t} can be divided into three periods.",
    "Frequently asked questions about {t}\n\nQ:",
]

CODE = [
    "def {f}(values):\n    \"\"\"Return the {d} of a list of numbers.\"\"\"\n",
    "fn {f}(values: &[i64]) -> i64 {{\n    // the {d} of the values\n",
    "// JavaScript: compute the {d} of an array\nfunction {f}(arr) {{\n",
    "#include <stdio.h>\n\n/* {d} of an array of ints */\nint {f}(const int *a, int n) {{\n",
    "-- SQL: the {d} of order totals per customer\nSELECT customer_id,",
]
FUNCS = [("mean", "mean"), ("median", "median"), ("largest", "largest value"),
         ("smallest", "smallest value"), ("total", "sum"), ("spread", "range"),
         ("count_even", "number of even values"), ("product", "product")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=260)
    ap.add_argument("--out", default="data/corpus/synthetic.jsonl")
    args = ap.parse_args()
    rng = random.Random(20261122)
    prose = [tpl.format(t=t, T=t[0].upper() + t[1:]) for t in TOPICS for tpl in TEMPLATES]
    rng.shuffle(prose)
    code = [tpl.format(f=f, d=d) for f, d in FUNCS for tpl in CODE]
    rng.shuffle(code)
    n_code = args.count // 8
    prompts = prose[: args.count - n_code] + code[:n_code]
    rng.shuffle(prompts)
    with open(args.out, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"text": p}) + "\n")
    print(f"wrote {len(prompts)} prompts to {args.out}")


if __name__ == "__main__":
    main()
