"""Arithmetic word problems a small pretrained LM can partly do, generated deterministically (a pure
function of the seed) as rows of verl's parquet schema, graded by the math recipe's math-verify reward
(``maspo_verl.math.reward``: the answer in ``\\boxed{}``).

Difficulty: ``steps`` (1: one sum, difference or product; 2: a sum or difference, then another) and
``max_operand`` (operands of sums and differences are 1..max_operand; a product's factors 2..
max(3, max_operand // 2), so products stay small). Differences never go below zero.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

DATA_SOURCE = "maspo_arith"
VERSION = 1  # bump when the generated rows change
VAL_OFFSET = 10_000  # the validation split's seed is the run's + this
INSTRUCTION = "Give the final answer as a number in \\boxed{}."
NAMES = ("Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gia", "Hal", "Ivy", "Jon", "Kim", "Leo")
ITEMS = ("apples", "books", "coins", "pens", "stamps", "cards", "shells", "marbles")


def _one_step(rng: random.Random, name: str, item: str, max_operand: int) -> tuple[str, int]:
    op = rng.choice("+-*")
    if op == "*":
        top = max(3, max_operand // 2)
        a, b = rng.randint(2, top), rng.randint(2, top)
        return f"{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have?", a * b
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    if op == "+":
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    a, b = max(a, b), min(a, b)
    return f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?", a - b


def _two_steps(rng: random.Random, name: str, item: str, max_operand: int) -> tuple[str, int]:
    a, b, c = (rng.randint(1, max_operand) for _ in range(3))
    first, second = rng.choice("+-"), rng.choice("+-")
    total = a + b if first == "+" else a - b
    if first == "-" and total < 0:
        a, b = b, a
        total = a - b
    if second == "-" and c > total:
        c = rng.randint(0, total)
    answer = total + c if second == "+" else total - c
    text = f"{name} has {a} {item}. " + (f"{name} gets {b} more. " if first == "+" else f"{name} gives away {b}. ")
    text += f"Then {name} gets {c} more. " if second == "+" else f"Then {name} gives away {c}. "
    return text + f"How many {item} does {name} have now?", answer


def problems(n: int, seed: int, steps: int = 1, max_operand: int = 20) -> list[tuple[str, int]]:
    """``n`` (question, answer) pairs; the same arguments give the same pairs."""
    if steps not in (1, 2):
        raise ValueError(f"arith steps={steps!r} is invalid: allowed 1 or 2")
    if not (isinstance(max_operand, int) and max_operand >= 2):
        raise ValueError(f"arith max_operand={max_operand!r} is invalid: allowed an integer >= 2")
    rng = random.Random(f"{seed}-{steps}-{max_operand}")
    make = _one_step if steps == 1 else _two_steps
    return [make(rng, rng.choice(NAMES), rng.choice(ITEMS), max_operand) for _ in range(n)]


# one worked exchange before the question: SmolLM2-135M answers in GSM8K's "#### n" form without it
EXAMPLE = ("Sam has 4 pens and gets 3 more. How many pens does Sam have now?", "Sam has 4 + 3 = 7 pens. \\boxed{7}")


def prompt(question: str) -> list[dict]:
    return [
        {"role": "user", "content": f"{EXAMPLE[0]} {INSTRUCTION}"},
        {"role": "assistant", "content": EXAMPLE[1]},
        {"role": "user", "content": f"{question} {INSTRUCTION}"},
    ]


def task_rows(data_source: str, prompted: list[tuple[list[dict], int]], split: str, **extra) -> list[dict]:
    """verl's parquet rows of ``prompted`` ((chat prompt, answer) pairs), graded on the answer by the math reward."""
    return [
        {
            "data_source": data_source,
            "prompt": chat,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a)},
            "extra_info": {"split": split, "index": i, **extra},
        }
        for i, (chat, a) in enumerate(prompted)
    ]


def rows(n: int, seed: int, split: str, steps: int = 1, max_operand: int = 20) -> list[dict]:
    prompted = [(prompt(q), a) for q, a in problems(n, seed, steps, max_operand)]
    return task_rows(DATA_SOURCE, prompted, split, steps=steps, max_operand=max_operand)


def write_splits(name: str, version: int, rows_of, seed: int, steps: int, max_operand: int, n_train, n_val, cache_dir):
    """Train and val parquet files of ``rows_of(n, seed, split, steps, max_operand)`` in the cache, made once (a
    folder per name, version, seed, difficulty and size); the val split from seed + ``VAL_OFFSET`` (no shared
    problem)."""
    import pandas as pd

    from maspo_verl.util import default_cache_dir

    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    key = hashlib.sha1(json.dumps([version, seed, steps, max_operand, n_train, n_val]).encode()).hexdigest()[:10]
    folder = cache / f"{name}-v{version}-s{steps}-m{max_operand}-seed{seed}-{key}"
    paths = {"train": folder / "train.parquet", "val": folder / "test.parquet"}
    if not all(p.is_file() for p in paths.values()):
        folder.mkdir(parents=True, exist_ok=True)
        for (split, path), n, s in zip(paths.items(), (n_train, n_val), (seed, seed + VAL_OFFSET), strict=True):
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            pd.DataFrame(rows_of(n, s, split, steps, max_operand)).to_parquet(tmp, index=False)
            os.replace(tmp, path)
    return {k: str(v) for k, v in paths.items()}


def ensure_dataset(
    seed: int = 0,
    steps: int = 1,
    max_operand: int = 20,
    cache_dir: str | os.PathLike | None = None,
    n_train: int = 512,
    n_val: int = 64,
) -> dict[str, str]:
    """Train and val parquet files in the cache (the val split uses another seed: no shared problem)."""
    return write_splits("arith", VERSION, rows, seed, steps, max_operand, n_train, n_val, cache_dir)


if __name__ == "__main__":  # python -m maspo_verl.pretrained.arith [STEPS MAX_OPERAND]: write the task, print its files
    import sys

    steps, top = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (1, 5)
    print(json.dumps(ensure_dataset(steps=steps, max_operand=top)))
