"""Generate the small instruction dataset shipped for the offline default (``apexw_hf/data/offline_*.jsonl``).

The published comparison fine-tunes on 1,000 chat samples (FineTome-100k). With no internet the recipe needs data of
the same shape that a tiny model built from a config can really learn in a few hundred steps, so the loss falls far
below its starting value. Every sample here is a templated single-turn chat made from small fixed tables: facts
(capitals, opposites, colours), small arithmetic, counting, comparison, copying and plurals. Each task has several
question phrasings; the pool of distinct (phrasing, content) pairs is shuffled once and split, so the validation set
holds question/answer pairs never seen in training, made from the same tables.

The output is deterministic (fixed seed, sorted keys, ``\\n`` line ends): ``tests/recipe`` regenerates it and compares
the bytes with the shipped files.

Usage::

    python scripts/make_dataset.py                 # writes apexw_hf/data/offline_{train,validation}.jsonl
    python scripts/make_dataset.py --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 20261129
N_TRAIN = 1000
N_VALIDATION = 200

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Brazil": "Brasilia",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Austria": "Vienna",
    "Ireland": "Dublin",
    "Turkey": "Ankara",
    "Russia": "Moscow",
    "Australia": "Canberra",
}
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "fast": "slow",
    "happy": "sad",
    "light": "dark",
    "up": "down",
    "open": "closed",
    "early": "late",
    "full": "empty",
    "strong": "weak",
    "young": "old",
    "high": "low",
    "wet": "dry",
    "hard": "soft",
    "rich": "poor",
    "loud": "quiet",
    "long": "short",
    "thick": "thin",
    "near": "far",
    "clean": "dirty",
}
COLOURS = {
    "the sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "a banana": "yellow",
    "a tomato": "red",
    "an orange": "orange",
    "a lemon": "yellow",
    "milk": "white",
    "a leaf": "green",
    "the sun": "yellow",
    "a strawberry": "red",
    "a crow": "black",
    "the sea": "blue",
    "chocolate": "brown",
}
NOUNS = [
    "cat",
    "dog",
    "book",
    "tree",
    "car",
    "house",
    "river",
    "apple",
    "chair",
    "table",
    "bird",
    "cup",
    "door",
    "hand",
    "ship",
    "road",
    "star",
    "girl",
    "boy",
    "lamp",
    "pen",
    "shoe",
    "hat",
    "key",
    "ring",
    "bell",
    "coin",
]
WORDS = NOUNS + ["red", "blue", "green", "sun", "moon", "rain", "wind", "fire", "stone", "water"]


def _capital(rng: random.Random) -> list[tuple[str, str]]:
    asks = [
        "What is the capital of {c}?",
        "Name the capital city of {c}.",
        "Which city is the capital of {c}?",
        "Tell me the capital of {c}.",
        "{c} has which capital?",
        "What city is {c}'s capital?",
    ]
    return [(a.format(c=c), f"The capital of {c} is {cap}.") for c, cap in CAPITALS.items() for a in asks]


def _opposite(rng: random.Random) -> list[tuple[str, str]]:
    asks = [
        "What is the opposite of {w}?",
        "Give the opposite of the word {w}.",
        "What word means the opposite of {w}?",
        "Antonym of {w}?",
        "Tell me the opposite of {w}.",
    ]
    pairs = list(OPPOSITES.items()) + [(b, a) for a, b in OPPOSITES.items()]
    return [(a.format(w=w), f"The opposite of {w} is {o}.") for w, o in pairs for a in asks]


def _colour(rng: random.Random) -> list[tuple[str, str]]:
    asks = ["What color is {t}?", "Which color does {t} have?", "Tell me the color of {t}.", "{t} is what color?"]
    return [(a.format(t=t), f"{t[0].upper() + t[1:]} is {col}.") for t, col in COLOURS.items() for a in asks]


def _add(rng: random.Random) -> list[tuple[str, str]]:
    asks = [
        "What is {a} plus {b}?",
        "Add {a} and {b}.",
        "Compute {a} + {b}.",
        "What do you get when you add {a} to {b}?",
    ]
    return [(q.format(a=a, b=b), f"{a} plus {b} is {a + b}.") for a in range(10) for b in range(10) for q in asks]


def _next(rng: random.Random) -> list[tuple[str, str]]:
    asks = [
        "What number comes after {n}?",
        "Which number follows {n}?",
        "Count one up from {n}.",
        "What is {n} plus one?",
    ]
    return [(q.format(n=n), f"The number after {n} is {n + 1}.") for n in range(60) for q in asks]


def _larger(rng: random.Random) -> list[tuple[str, str]]:
    asks = ["Which is larger, {a} or {b}?", "Which number is bigger: {a} or {b}?", "Is {a} or {b} greater?"]
    out = []
    for _ in range(400):
        a, b = rng.sample(range(100), 2)
        out.append((rng.choice(asks).format(a=a, b=b), f"{max(a, b)} is larger than {min(a, b)}."))
    return out


def _repeat(rng: random.Random) -> list[tuple[str, str]]:
    asks = {
        2: ["Repeat the word {w} twice.", "Say {w} two times."],
        3: ["Repeat the word {w} three times.", "Say {w} three times."],
    }
    return [(q.format(w=w), " ".join([w] * k)) for w in WORDS for k, qs in asks.items() for q in qs]


def _plural(rng: random.Random) -> list[tuple[str, str]]:
    asks = ["What is the plural of {w}?", "Give the plural form of {w}.", "One {w}, two what?"]
    return [(q.format(w=w), f"The plural of {w} is {w}s.") for w in NOUNS for q in asks]


TASKS = {
    "capital": _capital,
    "opposite": _opposite,
    "colour": _colour,
    "add": _add,
    "next": _next,
    "larger": _larger,
    "repeat": _repeat,
    "plural": _plural,
}


def _allocate(total: int, sizes: dict[str, int]) -> dict[str, int]:
    """Split ``total`` over tasks in proportion to their pool sizes (largest remainder), never above a pool's size."""
    pool = sum(sizes.values())
    if total > pool:
        raise ValueError(f"{total} samples requested but the tasks hold only {pool} distinct ones")
    exact = {k: total * n / pool for k, n in sizes.items()}
    out = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: (out[k] - exact[k], k))[: total - sum(out.values())]:
        out[k] += 1
    return out


def build(seed: int = SEED, n_train: int = N_TRAIN, n_validation: int = N_VALIDATION) -> dict[str, list[dict]]:
    """Return ``{"train": [...], "validation": [...]}``: disjoint lists of chat samples.

    Each task contributes in proportion to its number of distinct samples.

    Each sample is ``{"task": name, "messages": [{"role": "user", ...}, {"role": "assistant", ...}]}``.
    """
    rng = random.Random(seed)
    per_task = {}
    for name, make in TASKS.items():
        pool = sorted(set(make(rng)))  # distinct (question, answer) pairs, in a fixed order
        rng.shuffle(pool)
        per_task[name] = pool
    sizes = {name: len(pool) for name, pool in per_task.items()}
    n_val = _allocate(n_validation, sizes)
    n_tr = _allocate(n_train, {k: sizes[k] - n_val[k] for k in sizes})
    splits: dict[str, list[dict]] = {"train": [], "validation": []}
    for name, pool in per_task.items():
        v, t = n_val[name], n_tr[name]
        for split, chunk in (("validation", pool[:v]), ("train", pool[v : v + t])):
            for q, a in chunk:
                splits[split].append(
                    {"task": name, "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                )
    for split in splits.values():
        rng.shuffle(split)
    return splits


def write(out_dir: Path, seed: int = SEED) -> list[Path]:
    """Write ``offline_train.jsonl`` and ``offline_validation.jsonl`` into ``out_dir``; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, rows in build(seed).items():
        path = out_dir / f"offline_{split}.jsonl"
        text = "".join(json.dumps(r, sort_keys=True, ensure_ascii=True) + "\n" for r in rows)
        path.write_bytes(text.encode("ascii"))
        paths.append(path)
    return paths


def main() -> None:
    default_out = Path(__file__).resolve().parents[1] / "apexw_hf" / "data"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=default_out)
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args()
    for p in write(args.out_dir, args.seed):
        print(f"wrote {p} ({sum(1 for _ in p.open())} samples)")


if __name__ == "__main__":
    main()
