#!/usr/bin/env python3
"""Writes data/corpus/sampled.jsonl: free-form prompts for drafter training.

The template prompts of make_prompts.py repeat two dozen openings, and a drafter trained on
their continuations learns those openings' formats: it drafts far better on held-out prompts
of the same generator than on `kakeya bench`'s hand-written ones. These prompts vary the form
instead. Each starts from a short seed — one of ~90 openers (prose, letters, dialogue, lists,
reviews, code and markup in a dozen languages) with one of ~300 subjects — and the default
model itself continues the seed by *sampling* (temperature 0.8, top-p 0.95, a random 6–40
tokens, a fixed per-prompt seed), so the openings read like the model's own free text, in
every register the seeds reach. `kakeya capture` then writes the greedy continuations of
these prompts, which is what the drafter learns.

None of `kakeya bench`'s 20 built-in prompts or their subjects can appear (the filter of
make_prompts.py runs on the final text), so the bench stays held out.

Usage: python3 scripts/make_sampled_prompts.py [--count 1400] [--out data/corpus/sampled.jsonl]
       [--kakeya target/release/kakeya] [--clients 16]
Starts `kakeya serve --no-drafter` on a free loopback port (load_test.py's start_server) and
stops it at the end.
"""
import argparse
import concurrent.futures as cf
import json
import os
import random
import re
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_test import start_server  # noqa: E402
from make_prompts import near_held_out  # noqa: E402

PROSE = [
    "{T}", "The {t}", "{T} are", "A brief history of {t}", "Why do so many people care about {t}?",
    "Chapter 3: {T}\n\n", "My first experience with {t}", "Notes from a weekend spent studying {t}:",
    "It was late in the evening when", "Dear Sir or Madam,\n\n", "Breaking news:", "Review:",
    "How to", "A step-by-step guide:", "Abstract\n\n", "Once upon a time,", "Introduction\n\n",
    "Product description:", "Interview with an expert on {t}\n\nQ:", "To the editor:\n\n",
    "Diary, Tuesday.", "Instructions:", "The scientist explained that", "According to the report,",
    "In this tutorial, we will", "Table of contents\n\n1.", "Question:", "User manual\n\n",
    "Yesterday I", "Most people think that", "There is an old saying about {t}:",
    "The committee agreed that", "Patient notes:", "Weather forecast for the weekend:",
    "Meeting minutes\n\n", "Travel diary, day four:", "A beginner's mistake with {t} is",
    "Press release:", "The museum's new exhibition on {t}", "Lesson plan: {t}\n\nObjectives:",
    "Grandpa always said", "If I could change one thing about {t},", "Job posting:",
    "Cover letter\n\nDear hiring manager,\n\n", "Abstract: We study {t}", "The first rule of",
    "She opened the door and", "He had never seen", "In the year 2090,", "The detective",
    "Ingredients:\n-", "Pros and cons of {t}:\n\nPros:\n-", "A haiku about {t}:\n\n",
    "Song lyrics, verse one:\n", "Customer support chat\n\nCustomer:", "The legend says that",
    "Safety warning:", "Fun fact:", "Our company", "Translation of the sign:", "Top 10",
    "Book summary:", "Speech for the opening ceremony:\n\n", "Dialogue\n\nTeacher:", "Note to self:",
]

CODE = [
    "import ", "from collections import", "#include <", "package main\n\nimport (", "use std::",
    "<!DOCTYPE html>\n<html>", "CREATE TABLE", "SELECT", "const ", "public class ",
    "#!/bin/bash\n", "def ", "class ", "fn main() {\n", "// ", "{\n  \"name\":", "---\ntitle:",
    "# ", "<?php\n", "require '", "apiVersion: v1\nkind:", "async function ", "interface ",
    "struct ", "#[derive(", "template <typename T>", "module ", "FROM python:", "[package]\nname =",
    "@app.route(", "let ", "SELECT COUNT(*)", "if __name__ == \"__main__\":\n",
    "// {T} simulator\n", "# {T} analysis\nimport", "/* {t} */\n", "<div class=\"",
]

SUBJECTS = """
tides, glaciers, comets, nebulae, galaxies, asteroids, satellites, rockets, telescopes, eclipses,
volcanoes, earthquakes, canyons, caves, deserts, rainforests, wetlands, savannas, tundra, oceans,
sharks, dolphins, octopuses, whales, penguins, owls, eagles, parrots, crows, bees, ants,
butterflies, spiders, wolves, foxes, bears, tigers, elephants, giraffes, horses, camels, llamas,
frogs, turtles, lizards, snakes, oak trees, ferns, mosses, mushrooms, orchids, cacti, sunflowers,
tulips, bamboo, seaweed, algae, bacteria, viruses, vaccines, antibiotics, the immune system,
the brain, the liver, bones, muscles, blood, sleepwalking, nutrition, vitamins, diabetes,
allergies, dentistry, surgery, nursing, hospitals, pharmacies, yoga, running, swimming, cycling,
races, football, basketball, tennis, cricket, baseball, chess, poker, crosswords, puzzles,
video games, board games, card tricks, magic, circuses, theatre, opera, ballet, jazz, blues,
rock music, violins, pianos, drums, guitars, choirs, orchestras, podcasts, radio, television,
cinema, cartoons, comics, novels, poetry, libraries, newspapers, typewriters, fountain pens,
calligraphy, photography, painting, sculpture, pottery, weaving, knitting, sewing, carpentry,
plumbing, welding, masonry, architecture, bridges, tunnels, skyscrapers, castles, cathedrals,
temples, pyramids, harbours, airports, railways, subways, trams, buses, taxis, motorcycles,
trucks, ships, submarines, airplanes, helicopters, drones, hot-air balloons, parachutes,
elevators, escalators, clocks, calendars, maps, compasses, money, banks, taxes, insurance,
mortgages, stocks, bonds, startups, factories, supply chains, shipping containers, farming,
irrigation, tractors, wheat, rice, maize, potatoes, coffee, tea, chocolate, cheese, baking,
soups, curry, pasta, sushi, tacos, dumplings, pancakes, spices, salt, sugar, honey, olive oil,
wine, cider, fermentation, refrigerators, microwaves, stoves, dishwashers, washing machines,
vacuum cleaners, batteries, solar power, wind power, nuclear power, hydrogen, electric grids,
transistors, chips, compilers, databases, spreadsheets, search engines, encryption, passwords,
firewalls, routers, cloud computing, robotics, machine learning, neural networks, statistics,
probability, algebra, geometry, calculus, prime numbers, infinity, logic, philosophy, ethics,
democracy, elections, courts, lawyers, police, firefighters, the postal service, census,
diplomacy, treaties, empires, revolutions, the Bronze Age, the Middle Ages, the Renaissance,
the Enlightenment, ancient Greece, ancient Rome, the Maya, the Incas, Mongolia, Japan, Brazil,
Kenya, Norway, India, Egypt, Canada, Australia, Peru, Iceland, languages, grammar, dictionaries,
spelling, handwriting, sign language, translation, emojis, friendship, marriage, parenting,
grandparents, siblings, pets, dogs, cats, hamsters, goldfish, gardening, composting, recycling,
plastic pollution, climate, storms, hurricanes, floods, droughts, snow, rainbows, fog, lightning,
holidays, birthdays, weddings, festivals, fireworks, camping, hiking, mountaineering, sailing,
fishing, skiing, skating, surfing, diving, archaeology, fossils, dinosaurs, museums, zoos,
aquariums, botanical gardens, space stations, astronauts, Jupiter, Saturn, Venus, Neptune,
black holes, gravity, magnetism, light, sound, heat, friction, atoms, molecules, chemistry,
acids, soap, glass, steel, concrete, rubber, paper, ink, dyes, perfume
"""


def subjects() -> list:
    return sorted({s.strip() for s in SUBJECTS.replace("\n", " ").split(",") if s.strip()})


def seed_text(rng: random.Random, subs: list) -> str:
    t = rng.choice(subs)
    tpl = rng.choice(CODE) if rng.random() < 0.2 else rng.choice(PROSE)
    return tpl.replace("{t}", t).replace("{T}", t[0].upper() + t[1:])


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=1400)
    ap.add_argument("--out", default="data/corpus/sampled.jsonl")
    ap.add_argument("--kakeya", default="target/release/kakeya")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seed", type=int, default=20261126)
    args = ap.parse_args()
    subs = subjects()
    server, host, port = start_server(args.kakeya, ["--no-drafter", "--max-seqs", str(args.clients)])
    base = f"http://{host}:{port}"
    try:
        def one(i: int):
            rng = random.Random(args.seed * 100003 + i)
            seed = seed_text(rng, subs)
            body = {"prompt": seed, "max_tokens": rng.randint(6, 40), "temperature": 0.8,
                    "top_p": 0.95, "seed": i, "ignore_eos": True}
            text = seed + post(base + "/v1/completions", body)["choices"][0]["text"]
            return i, text

        # Ask for more than needed: the held-out filter and the blank check drop some.
        todo = range(int(args.count * 1.15) + 16)
        got = {}
        started = time.time()
        with cf.ThreadPoolExecutor(args.clients) as pool:
            for n, (i, text) in enumerate(pool.map(one, todo), 1):
                got[i] = text
                if n % 100 == 0:
                    print(f"{n} prompts, {time.time() - started:.0f} s", file=sys.stderr)
    finally:
        server.terminate()
        server.wait()
    prompts, seen = [], set()
    for i in sorted(got):
        p = got[i]
        if len(p.strip()) < 12 or near_held_out(p) or p in seen or "\ufffd" in p:
            continue
        seen.add(p)
        prompts.append(p)
    if len(prompts) < args.count:
        raise SystemExit(f"only {len(prompts)} usable prompts for --count {args.count}")
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for p in prompts[: args.count]:
            f.write(json.dumps({"text": p}) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.count} prompts to {args.out}")


if __name__ == "__main__":
    main()
