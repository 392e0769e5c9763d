"""The embedded default dataset: small deterministic question/answer tasks a tiny model learns in minutes.

Every answer is a function of its prompt (look-ups, one-digit arithmetic, copying words backwards), so the
loss on response tokens can fall far below the vocabulary's entropy within a few dozen steps. The shipped
file ``data/tasks.jsonl`` is ``write_jsonl(generate())``; `tests/test_sft.py` checks they agree.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DAYS = ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]
MONTHS = ["january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
          "november", "december"]  # fmt: skip
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
           "twelve"]  # fmt: skip
COLORS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple", "brown", "pink"]
ANIMALS = ["cat", "dog", "bird", "fish", "horse", "cow", "sheep", "goat", "mouse", "lion"]
CAPITALS = {
    "france": "paris", "spain": "madrid", "italy": "rome", "japan": "tokyo", "egypt": "cairo",
    "peru": "lima", "kenya": "nairobi", "norway": "oslo", "greece": "athens", "china": "beijing",
}  # fmt: skip


def _cycle_next(words: list[str], rng: random.Random) -> tuple[str, str]:
    i = rng.randrange(len(words))
    return f"next: {words[i]}", words[(i + 1) % len(words)]


def _cycle_prev(words: list[str], rng: random.Random) -> tuple[str, str]:
    i = rng.randrange(len(words))
    return f"before: {words[i]}", words[i - 1]


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"add: {a} + {b}", str(a + b)


def _reverse(rng: random.Random) -> tuple[str, str]:
    words = [rng.choice(COLORS + ANIMALS) for _ in range(rng.randint(2, 5))]
    return "reverse: " + " ".join(words), " ".join(reversed(words))


def _capital(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(sorted(CAPITALS))
    return f"capital of {country}:", CAPITALS[country]


def generate(n: int = 3000, seed: int = 0) -> list[dict[str, str]]:
    """`n` prompt/response records, the same for the same seed."""
    rng = random.Random(seed)
    makers = [
        lambda: _cycle_next(rng.choice([DAYS, MONTHS, NUMBERS]), rng),
        lambda: _cycle_prev(rng.choice([DAYS, MONTHS, NUMBERS]), rng),
        lambda: _add(rng),
        lambda: _reverse(rng),
        lambda: _capital(rng),
    ]
    records = []
    for _ in range(n):
        prompt, answer = rng.choice(makers)()
        records.append({"prompt": prompt + "\n", "response": " " + answer})
    return records


def write_jsonl(records: list[dict[str, str]], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
