#!/usr/bin/env python3
"""Writes data/corpus/synthetic.jsonl: varied completion prompts for drafter training.

Deterministic (fixed seed): topic x template combinations, shuffled, plus code openers. The
prompts are written for Kakeya (CC0, see data/corpus/README.md). None of them is one of
`kakeya bench`'s 20 built-in prompts, which stay held out for the speed-up measurement
(checked: no prompt shares a subject or an opening with them).
Usage: python3 scripts/make_prompts.py [--count 260] [--out data/corpus/synthetic.jsonl]
       python3 scripts/make_prompts.py --large --count 3300 --out data/corpus/synthetic-large.jsonl
       (--large adds more topics, templates and code openers: the 10x drafter data set)
"""
import argparse
import json
import random
import re

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
EXTRA_TOPICS = [
    "tides", "the Sahara", "sharks", "the Ottoman Empire", "rockets", "volleyball", "bread yeast",
    "the nervous system", "origami", "the Great Depression", "comets", "mangroves", "radio",
    "the Aztecs", "fermentation", "tsunamis", "the Cold War", "batteries", "elephants",
    "marathons", "antibiotics", "icebergs", "banking", "squids", "the spice trade", "the ozone layer",
    "fossils", "insurance", "chocolate", "the Baroque period", "airships", "caves", "the skeleton",
    "tunnels", "the guitar", "calligraphy", "hydroelectric dams", "puffins", "microscopes",
    "museums", "subways", "the Nile", "ferns", "prime numbers", "the Mongols", "composting",
    "auroras", "the cello", "lighthouses of Scotland", "geothermal energy", "Saturn's rings",
    "termites", "glassblowing", "time zones", "tornadoes", "bats", "the compass", "surveying",
    "candles", "the Byzantine Empire", "satellites", "basketball", "cheese making", "the liver",
    "origami cranes", "the Gold Rush", "meteor showers", "wetlands", "television", "the Incas",
    "genetics", "avalanches", "the Space Race", "fuel cells", "dolphins", "cycling races",
    "allergies", "permafrost", "accounting", "jellyfish", "the Hanseatic League", "acid rain",
    "mammoths", "pensions", "tea plantations", "Gothic cathedrals", "hot air balloons", "canyons",
    "the lungs", "skyscrapers", "the flute", "woodcarving", "tidal power", "flamingos",
    "binoculars", "zoos", "trams", "the Mississippi", "lichens", "graph theory", "the Celts",
    "water treatment", "rainbows", "the harp", "windmills", "fusion energy", "Jupiter's moons",
    "spiders", "pottery", "leap years", "monsoons", "hedgehogs", "the sextant", "cartography",
    "perfume", "the Persian Empire", "weather balloons", "tennis", "olive oil", "the kidneys",
    "stamps", "the Bronze Age", "sunspots", "savannas", "the telegraph", "the Maya",
    "robotics competitions", "sand dunes", "the Hundred Years' War", "magnets", "giraffes",
    "rowing", "insulin", "sea ice", "taxes", "octopus camouflage", "the Phoenicians",
    "smog", "trilobites", "mortgages", "spices", "Romanesque churches", "gliders", "waterfalls",
]

EXTRA_TEMPLATES = [
    "Ten questions and answers about {t}.\n\n1. Q:",
    "A travel blog post that mentions {t}.\n\n",
    "Teacher: Today we are going to talk about {t}.\nStudent:",
    "Three common myths about {t}, and the truth behind them.\n\nMyth 1:",
    "A news report: new findings about {t}.\n\n",
    "Dear diary, today I learned about {t}.",
    "{T}: a timeline.\n\n",
    "A museum guide describes {t} to visitors:\n\n\"",
    "The pros and cons of {t}.\n\nPros:\n-",
    "How {t} works, step by step:\n\nStep 1:",
    "A podcast transcript about {t}.\n\nHost:",
    "An exam question on {t}, with a model answer.\n\nQuestion:",
]

EXTRA_CODE = [
    "# Python: {d} of the numbers read from a file\nimport sys\n\ndef {f}(path):\n",
    "package main\n\n// {f} returns the {d} of xs.\nfunc {f}(xs []int) int {{\n",
    "public static int {f}(int[] a) {{\n    // the {d} of a\n",
    "#!/usr/bin/env bash\n# print the {d} of the numbers given as arguments\n",
    "-- Haskell: the {d} of a list\n{f} :: [Int] -> Int\n",
]
EXTRA_FUNCS = [("average", "average"), ("maximum", "maximum"), ("minimum", "minimum"),
               ("sum_squares", "sum of the squares"), ("count_odd", "number of odd values"),
               ("mode", "most frequent value"), ("variance", "variance"),
               ("second_largest", "second largest value")]

# `kakeya bench`'s built-in prompts (crates/kakeya-cli/src/bench_spec.rs): held out.
HELD_OUT = [
    "The history of the printing press begins", "Write a short story about a lighthouse keeper who",
    "def quicksort(items):", "The main differences between rivers and canals are",
    "Here is a recipe for banana bread.", "In economics, inflation refers to",
    "The following is a letter from a student to her teacher:",
    "A list of common houseplants and how to care for them:", "class Stack:",
    "The planet Mars has two moons,", "Explain how a bicycle stays upright:",
    "The year was 1848, and the city", "SQL query to find the ten largest orders:",
    "Tips for a good night's sleep:", "The theory of evolution by natural selection states that",
    "Once there was a robot who wanted to", "function debounce(fn, ms) {",
    "The Great Wall of China is", "Summary of the water cycle: evaporation,",
    "My favourite season is autumn because",
]
HELD_OUT_SUBJECTS = ["printing press", "lighthouse keeper", "quicksort", "rivers and canals",
                     "banana bread", "inflation", "houseplants", "Mars", "bicycle", "1848",
                     "largest orders", "sleep", "natural selection", "robot who", "debounce",
                     "Great Wall", "water cycle", "autumn"]

FUNCS = [("mean", "mean"), ("median", "median"), ("largest", "largest value"),
         ("smallest", "smallest value"), ("total", "sum"), ("spread", "range"),
         ("count_even", "number of even values"), ("product", "product")]


def near_held_out(p: str) -> bool:
    if any(p.startswith(h[:24]) for h in HELD_OUT):
        return True
    return any(re.search(r"\b" + re.escape(s) + r"\b", p, re.IGNORECASE) for s in HELD_OUT_SUBJECTS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=260)
    ap.add_argument("--out", default="data/corpus/synthetic.jsonl")
    ap.add_argument("--large", action="store_true", help="more topics, templates and code")
    args = ap.parse_args()
    rng = random.Random(20261122)
    topics, templates, code_tpls, funcs = TOPICS, TEMPLATES, CODE, FUNCS
    if args.large:
        topics = TOPICS + EXTRA_TOPICS
        templates = TEMPLATES + EXTRA_TEMPLATES
        code_tpls = CODE + EXTRA_CODE
        funcs = FUNCS + EXTRA_FUNCS
    prose = [tpl.format(t=t, T=t[0].upper() + t[1:]) for t in topics for tpl in templates]
    rng.shuffle(prose)
    code = [tpl.format(f=f, d=d) for f, d in funcs for tpl in code_tpls]
    rng.shuffle(code)
    # Drop (after shuffling, so that the default set is unchanged) anything that opens like
    # a held-out prompt or names one of their subjects.
    prose = [p for p in prose if not near_held_out(p)]
    code = [p for p in code if not near_held_out(p)]
    n_code = min(args.count // 8, len(code))
    prompts = prose[: args.count - n_code] + code[:n_code]
    rng.shuffle(prompts)
    if len(prompts) < args.count:
        raise SystemExit(f"only {len(prompts)} distinct prompts for --count {args.count}")
    with open(args.out, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"text": p}) + "\n")
    print(f"wrote {len(prompts)} prompts to {args.out}")


if __name__ == "__main__":
    main()
