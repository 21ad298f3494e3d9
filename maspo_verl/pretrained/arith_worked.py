"""Arithmetic word problems of several steps, answered with their working: the arithmetic task of
``maspo_verl.pretrained.arith`` with headroom and length for SmolLM2-135M-Instruct (``maspo.arith.form=worked``
with ``model=smollm2``), generated deterministically (a pure function of the seed), graded by the same math-verify
reward on the answer in ``\\boxed{}``.

A problem is a start amount and ``steps`` changes to it, each one of: gets b more; gives away b (at most what there
is, so the amount never goes below zero); every number 1..``max_operand``. The prompt's worked example (a problem of
the same difficulty, from its own generator) answers with the start, one line per change with the running amount,
and the boxed answer, so the model's answers carry their working: about 20 tokens a step (SmolLM2's tokenizer
writes each digit as a token).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping

from maspo_verl.pretrained.arith import INSTRUCTION, ITEMS, NAMES, task_rows, write_splits

DATA_SOURCE = "maspo_arith_worked"
VERSION = 1  # bump when the generated rows change
FORMS = ("short", "worked")  # maspo.arith.form: arith's one-line answers, or this module's worked ones
STEPS = (2, 6)  # the allowed number of changes, inclusive
N_TRAIN, N_VAL = 512, 128  # 128 validation problems: one problem is 0.78 % of the accuracy
EXAMPLE_NAME, EXAMPLE_ITEM = "Sam", "pens"  # the worked example's, used by no problem (not in arith.NAMES)


def check(steps, max_operand) -> None:
    """A clear error naming the setting (``maspo.arith.steps`` / ``max_operand``) and its allowed values."""
    from maspo_verl.validation import FieldError

    if not (isinstance(steps, int) and STEPS[0] <= steps <= STEPS[1]):
        raise FieldError(
            "maspo.arith.steps",
            f"maspo.arith.steps={steps!r} is invalid with maspo.arith.form=worked: allowed an integer "
            f"{STEPS[0]}..{STEPS[1]}",
        )
    if not (isinstance(max_operand, int) and max_operand >= 2):
        raise FieldError("maspo.arith.max_operand", f"maspo.arith.max_operand={max_operand!r}: allowed an integer >= 2")


def _changes(rng: random.Random, steps: int, max_operand: int) -> tuple[int, list[tuple[str, int]]]:
    """The start amount and the changes, each (kind, b): ``gets`` b more or ``gives`` away b (at most what there is)."""
    total = start = rng.randint(1, max_operand)
    out = []
    for _ in range(steps):
        kind = "gets" if total == 0 else rng.choice(("gets", "gives"))
        b = rng.randint(1, max_operand if kind == "gets" else min(max_operand, total))
        total += b if kind == "gets" else -b
        out.append((kind, b))
    return start, out


def _render(name: str, item: str, start: int, changes: list[tuple[str, int]]) -> tuple[str, str, int]:
    """(question, worked answer, answer): the start, one line per change (what changes, the amount before, the sum
    or difference, the amount after), then the amount at the end and the boxed answer."""
    question = [f"{name} has {start} {item}."]
    working = [f"{name} starts with {start} {item}."]
    total = start
    for i, (kind, b) in enumerate(changes):
        then = "Then " if i else ""
        sign, after = ("+", total + b) if kind == "gets" else ("-", total - b)
        said = f"gets {b} more {item}" if kind == "gets" else f"gives away {b} {item}"
        question.append(f"{then}{name} {said}.")
        working.append(
            f"Step {i + 1}: {name} {said}. {name} had {total} {item}, and {total} {sign} {b} = {after}, "
            f"so now {name} has {after} {item}."
        )
        total = after
    question.append(f"How many {item} does {name} have now?")
    working.append(f"At the end {name} has {total} {item}. The answer is \\boxed{{{total}}}.")
    return " ".join(question), "\n".join(working), total


def worked_problems(n: int, seed: int, steps: int = 3, max_operand: int = 20) -> list[tuple[str, str, int]]:
    """``n`` (question, worked answer, answer) triples; the same arguments give the same triples."""
    check(steps, max_operand)
    rng = random.Random(f"worked-{seed}-{steps}-{max_operand}")
    out = []
    for _ in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        out.append(_render(name, item, *_changes(rng, steps, max_operand)))
    return out


def problems(n: int, seed: int, steps: int = 3, max_operand: int = 20) -> list[tuple[str, int]]:
    """``n`` (question, answer) pairs (``arith.problems``' form)."""
    return [(q, a) for q, _, a in worked_problems(n, seed, steps, max_operand)]


def example(steps: int, max_operand: int) -> tuple[str, str]:
    """The prompt's worked example: the first problem of its own generator, at the same difficulty, with both kinds
    of change and no operand twice."""
    check(steps, max_operand)
    for k in range(10_000):
        start, changes = _changes(random.Random(f"example-{k}-{steps}-{max_operand}"), steps, max_operand)
        numbers = [start, *(b for _, b in changes)]
        if {kind for kind, _ in changes} == {"gets", "gives"} and len(set(numbers)) == len(numbers):
            question, working, _ = _render(EXAMPLE_NAME, EXAMPLE_ITEM, start, changes)
            return question, working
    raise AssertionError("no example shows both kinds of change")  # pragma: no cover - 2 kinds, 10 000 draws


def prompt(question: str, steps: int, max_operand: int) -> list[dict]:
    shown, working = example(steps, max_operand)
    return [
        {"role": "user", "content": f"{shown} {INSTRUCTION}"},
        {"role": "assistant", "content": working},
        {"role": "user", "content": f"{question} {INSTRUCTION}"},
    ]


def rows(n: int, seed: int, split: str, steps: int = 3, max_operand: int = 20) -> list[dict]:
    prompted = [(prompt(q, steps, max_operand), a) for q, a in problems(n, seed, steps, max_operand)]
    return task_rows(DATA_SOURCE, prompted, split, steps=steps, max_operand=max_operand, seed=seed)


def ensure_dataset(
    seed: int = 0,
    steps: int = 3,
    max_operand: int = 20,
    cache_dir: str | os.PathLike | None = None,
    n_train: int = N_TRAIN,
    n_val: int = N_VAL,
) -> dict[str, str]:
    """Train and val parquet files in the cache (val from seed + ``arith.VAL_OFFSET``: no shared problem)."""
    check(steps, max_operand)
    return write_splits("arith-worked", VERSION, rows, seed, steps, max_operand, n_train, n_val, cache_dir)


def ensure_task(task: Mapping, seed: int, cache_dir=None) -> tuple[dict[str, str], str]:
    """The train and val files of ``maspo.arith`` (``task``: form, steps, max_operand; arith's defaults where
    absent) and the line that names the task."""
    from maspo_verl.pretrained import arith
    from maspo_verl.validation import FieldError

    form = task.get("form") or FORMS[0]
    if form not in FORMS:
        raise FieldError("maspo.arith.form", f"maspo.arith.form={form!r} is invalid: allowed {list(FORMS)}")
    steps, top = task.get("steps", 1), task.get("max_operand", 20)
    if form == "short":
        return arith.ensure_dataset(seed, int(steps), int(top), cache_dir), f"arith (steps={steps}, max_operand={top})"
    return ensure_dataset(seed, steps, top, cache_dir), f"arith worked (steps={steps}, max_operand={top})"


if __name__ == "__main__":  # python -m maspo_verl.pretrained.arith_worked [STEPS MAX_OPERAND]: write, print the files
    import sys

    steps, top = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (3, 20)
    print(json.dumps(ensure_dataset(steps=steps, max_operand=top)))
