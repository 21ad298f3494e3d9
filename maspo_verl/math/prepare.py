"""Math data for verl: ``python -m maspo_verl.math.prepare --out-dir DIR [--datasets ...] [--local ...]``.

Writes one parquet per dataset and split, ``DIR/<name>_<split>.parquet``, in verl's RL schema::

    data_source   str   the dataset's short name (gsm8k, math, math500, dapo17k, aime24, aime25);
                        verl groups validation metrics by it (val-core/<data_source>/acc/...)
    prompt        list  chat messages [{"role": "user", "content": problem + BOXED_INSTRUCTION}]
                        (``--system-prompt`` puts the instruction in a system message instead)
    ability       str   "math"
    reward_model  dict  {"style": "rule", "ground_truth": answer}
    extra_info    dict  {"split", "index", "problem", "answer", "source", "level", "subject"}

Every file has the same columns and types, so verl can concatenate several of them
(``data.val_files=[math500, aime24, aime25]``).

Sources come from the Hugging Face hub through ``datasets`` by default; ``--local NAME[:SPLIT]=PATH``
reads a json / jsonl / parquet file with the hub's columns instead (how the tests run, and the way
to use a mirror). Where the Hub cannot be reached (or offline mode is set and the dataset is not
cached), it stops at once, in one line pointing to ``--local ... --only-local``. ``--limit N`` keeps
the first N rows of each output (smoke runs).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from maspo_verl.math.reward import closing_brace
from maspo_verl.util import hub_offline, hub_unreachable, write_parquet

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# DAPO-Math-17k ships prompts already wrapped in its own "Answer: $Answer" instruction; we unwrap
# the problem and re-wrap it in our \boxed{} instruction so every dataset asks for the same format.
_DAPO_PREFIX = re.compile(r"^\s*Solve the following math problem step by step\..*?\n\n", re.S)
_DAPO_SUFFIX = re.compile(r"\n\nRemember to put your answer on its own line after \"Answer:\"\.?\s*$", re.S)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in a reference solution."""
    pos = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if pos < 0:
        return None
    start = text.find("{", pos)
    end = closing_brace(text, start) if start >= 0 else -1
    return text[start + 1 : end].strip() if end >= 0 else None


def _first(row: dict, *keys: str):
    """The first present, non-empty value among ``keys`` (case-insensitive)."""
    lowered = {str(k).lower(): v for k, v in row.items()}
    for key in keys:
        value = lowered.get(key.lower())
        if value is not None and value != "":
            return value
    return None


def _problem_plain(row: dict) -> str | None:
    value = _first(row, "problem", "question", "prompt")
    return value if isinstance(value, str) else None


def _answer_field_or_boxed(row: dict) -> str | None:
    value = _first(row, "answer", "final_answer", "expected_answer")
    if value is not None:
        return str(value)
    solution = _first(row, "solution")
    return last_boxed(solution) if isinstance(solution, str) else None


def _gsm8k_answer(row: dict) -> str | None:
    answer = _first(row, "answer")
    if not isinstance(answer, str) or "####" not in answer:
        return None
    return answer.split("####")[-1].strip().replace(",", "")


def _math_answer(row: dict) -> str | None:
    solution = _first(row, "solution")
    boxed = last_boxed(solution) if isinstance(solution, str) else None
    return boxed if boxed is not None else _answer_field_or_boxed(row)


def _dapo_problem(row: dict) -> str | None:
    prompt = _first(row, "prompt")
    if isinstance(prompt, str):  # open-r1/DAPO-Math-17k-Processed: plain problem text
        return prompt
    if prompt is not None and len(prompt) and isinstance(prompt[0], dict):  # raw: chat messages
        content = prompt[0].get("content", "")
        return _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", content)).strip()
    return _problem_plain(row)


def _dapo_answer(row: dict) -> str | None:
    reward_model = _first(row, "reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return str(reward_model["ground_truth"])
    return _answer_field_or_boxed(row)


def _integer_answer(row: dict) -> str | None:
    answer = _answer_field_or_boxed(row)
    if answer is None:
        return None
    answer = answer.strip()
    return str(int(answer)) if re.fullmatch(r"[+-]?\d+", answer) else answer


@dataclass(frozen=True)
class Source:
    """Where one dataset comes from and how to read a row of it."""

    hub: str
    config: str | None
    splits: dict[str, str]  # our split name -> hub split name
    problem: Callable[[dict], str | None] = _problem_plain
    answer: Callable[[dict], str | None] = _answer_field_or_boxed
    dedupe: bool = False
    meta: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {"level": ("level",), "subject": ("subject", "type")}
    )


SOURCES: dict[str, Source] = {
    "gsm8k": Source("openai/gsm8k", "main", {"train": "train", "test": "test"}, answer=_gsm8k_answer),
    "math": Source("DigitalLearningGmbH/MATH-lighteval", None, {"train": "train"}, answer=_math_answer),
    "math500": Source("HuggingFaceH4/MATH-500", None, {"test": "test"}),
    "dapo17k": Source(
        "BytedTsinghua-SIA/DAPO-Math-17k", None, {"train": "train"}, _dapo_problem, _dapo_answer, dedupe=True
    ),
    "aime24": Source("HuggingFaceH4/aime_2024", None, {"test": "train"}, answer=_integer_answer),
    "aime25": Source("math-ai/aime25", None, {"test": "test"}, answer=_integer_answer),
}
DEFAULT_DATASETS = ("gsm8k", "math", "math500", "dapo17k", "aime24", "aime25")


def parquet_schema():
    """The one arrow schema of every output file (so verl can concatenate them)."""
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    extra = pa.struct(
        [(k, pa.string()) for k in ("split",)]
        + [("index", pa.int64())]
        + [(k, pa.string()) for k in ("problem", "answer", "source", "level", "subject")]
    )
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(message)),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", extra),
        ]
    )


def build_prompt(problem: str, system_prompt: bool = False) -> list[dict]:
    """Qwen chat messages asking for the final answer in \\boxed{}."""
    if system_prompt:
        return [{"role": "system", "content": BOXED_INSTRUCTION}, {"role": "user", "content": problem}]
    return [{"role": "user", "content": f"{problem}\n{BOXED_INSTRUCTION}"}]


def to_verl_rows(name: str, split: str, rows, system_prompt: bool = False, limit: int | None = None) -> list[dict]:
    """Convert source rows to verl's schema; rows without a problem or an answer are dropped."""
    source = SOURCES[name]
    out: list[dict] = []
    seen: set[str] = set()
    for row in rows:
        problem, answer = source.problem(row), source.answer(row)
        if not problem or answer is None or not str(answer).strip():
            continue
        problem, answer = problem.strip(), str(answer).strip()
        if source.dedupe:
            if problem in seen:
                continue
            seen.add(problem)
        meta = {key: _first(row, *aliases) for key, aliases in source.meta.items()}
        out.append(
            {
                "data_source": name,
                "prompt": build_prompt(problem, system_prompt),
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {
                    "split": split,
                    "index": len(out),
                    "problem": problem,
                    "answer": answer,
                    "source": source.hub,
                    "level": "" if meta["level"] is None else str(meta["level"]),
                    "subject": "" if meta["subject"] is None else str(meta["subject"]),
                },
            }
        )
        if limit is not None and len(out) >= limit:
            break
    return out


def read_local(path: str) -> list[dict]:
    """Rows of a local .json (a list or JSON lines), .jsonl or .parquet file, as plain dicts."""
    import json

    lower = path.lower()
    if lower.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if lower.endswith((".json", ".jsonl")):
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        if text.lstrip().startswith("["):
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    raise ValueError(f"{path} is not .json, .jsonl or .parquet")


def load_rows(name: str, split: str, local: str | None = None):
    """Rows of one split: from a local json / jsonl / parquet file, or from the hub via ``datasets``."""
    if local:
        if not os.path.exists(local):
            raise FileNotFoundError(f"--local {name}:{split}: no such file {local}")
        return read_local(local)
    import datasets

    source = SOURCES[name]
    offline = hub_offline() or os.environ.get("HF_DATASETS_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    why = None if offline else hub_unreachable()  # else the Hub client retries for a minute, then a traceback
    if why is None:
        try:
            return datasets.load_dataset(source.hub, source.config, split=source.splits[split])
        except Exception as exc:
            if not offline:
                raise
            why = f"offline mode is set and it is not in the datasets cache ({type(exc).__name__})"
    raise SystemExit(
        f"python -m maspo_verl.math.prepare: {name} comes from the Hugging Face Hub ({source.hub}), but {why}: "
        f"without the Hub, give each dataset as a file with the Hub's columns (json, jsonl or parquet): "
        f"--local {name}:{split}=FILE ... --only-local"
    )


def parse_local(specs: list[str]) -> dict[tuple[str, str], str]:
    """``NAME[:SPLIT]=PATH`` -> {(name, split): path}; SPLIT defaults to the dataset's only split."""
    parsed: dict[tuple[str, str], str] = {}
    for spec in specs:
        key, sep, path = spec.partition("=")
        name, _, split = key.partition(":")
        if not sep or name not in SOURCES:
            raise SystemExit(f"--local {spec!r}: expected NAME[:SPLIT]=PATH with NAME in {sorted(SOURCES)}")
        splits = SOURCES[name].splits
        if not split:
            if len(splits) != 1:
                raise SystemExit(f"--local {spec!r}: {name} has splits {sorted(splits)}; say which (NAME:SPLIT=PATH)")
            split = next(iter(splits))
        if split not in splits:
            raise SystemExit(f"--local {spec!r}: {name} has splits {sorted(splits)}")
        parsed[(name, split)] = path
    return parsed


def prepare(
    out_dir: str,
    names: list[str],
    local: dict[tuple[str, str], str] | None = None,
    only_local: bool = False,
    system_prompt: bool = False,
    limit: int | None = None,
) -> dict[str, int]:
    """Write every requested dataset/split; returns {output path: row count}."""
    local = local or {}
    written: dict[str, int] = {}
    for name in names:
        for split in SOURCES[name].splits:
            path = local.get((name, split))
            if only_local and path is None:
                continue
            rows = to_verl_rows(name, split, load_rows(name, split, path), system_prompt, limit)
            if not rows:
                raise ValueError(f"{name}:{split}: no usable rows (check the columns of {path or SOURCES[name].hub})")
            target = os.path.join(out_dir, f"{name}_{split}.parquet")
            write_parquet(rows, target, schema=parquet_schema())
            written[target] = len(rows)
            print(f"wrote {len(rows):6d} rows  {target}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maspo_verl.math.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=os.path.expanduser("~/data/maspo_math"))
    parser.add_argument("--datasets", nargs="+", default=list(DEFAULT_DATASETS), choices=sorted(SOURCES))
    parser.add_argument(
        "--local", action="append", default=[], metavar="NAME[:SPLIT]=PATH", help="read a json/jsonl/parquet file"
    )
    parser.add_argument(
        "--only-local", action="store_true", help="write only the splits given with --local (no hub access)"
    )
    parser.add_argument("--system-prompt", action="store_true", help="instruction as a system message")
    parser.add_argument("--limit", type=int, default=None, help="keep the first N rows of each output")
    args = parser.parse_args(argv)
    local = parse_local(args.local)
    names = args.datasets
    if args.only_local:
        names = [n for n in names if any(key[0] == n for key in local)]
    prepare(args.out_dir, names, local, args.only_local, args.system_prompt, args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
