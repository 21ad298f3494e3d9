"""The multi-turn toy environment of the local mode (``task=turns``): no verl, no torch.

A response is ``turns`` assistant turns of ``turn_tokens`` tokens each, separated by environment
observations that the agent loop (``maspo_verl.local.turns_agent``) appends with ``response_mask``
0::

    prompt: "Say: 0213"  | turn 1 | <|im_start|> "1302" <|im_end|> | turn 2 | ... | turn N
    response_mask:         1 1 1 1  0 0 0 0 0 0                      1 1 1 1       1 1 1 1

Each turn has a reference of ``turn_tokens`` symbols 0..3 (the prompt shows turn 1's, each
observation the next turn's, as digits). On the embedded byte-level model (``assets``: id b < 256 is
the byte b), token t of a turn is right when its byte lies in the reference symbol's block of 64
(``b // 64``); a special id is wrong. A turn scores the share of right tokens over its reference
(missing tokens are wrong), and the reward is the mean over all ``turns`` turns (a turn the response
budget left out scores 0): every turn counts, the last no more than the first. A random model is right
a quarter of the time, so the responses of a group score differently from the first step. The
references are fixed by the seed for every prompt, as the lab's learn tasks' sentence is: a tiny
random model can learn them within a few dozen steps.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from maspo_verl.local.assets import NUM_BYTES, SPECIAL_TOKENS

TASK = "turns"
# the name the agent loop is registered under in verl (``actor_rollout_ref.rollout.agent.default_agent_loop``)
AGENT_NAME = "maspo_toy_turns"
DATA_SOURCE = "maspo_local_turns"
DATA_VERSION = 1  # bump when the generated rows change
SYMBOLS = 4
BLOCK = NUM_BYTES // SYMBOLS  # byte ids per symbol
OBS_START = NUM_BYTES + SPECIAL_TOKENS.index("<|im_start|>")
OBS_END = NUM_BYTES + SPECIAL_TOKENS.index("<|im_end|>")
# the task's settings (hydra_configs/task/turns.yaml, maspo.*)
SETTINGS = ("turns", "turn_tokens")


def check_settings(turns, turn_tokens) -> tuple[int, int]:
    """(turns, turn_tokens) as ints; FieldError naming the setting for anything but a positive integer."""
    from maspo_verl.validation import FieldError

    out = []
    for name, value in zip(SETTINGS, (turns, turn_tokens), strict=True):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FieldError(f"maspo.{name}", f"maspo.{name}={value!r} is invalid: allowed a positive integer")
        out.append(value)
    return out[0], out[1]


def references(seed: int, turns: int, turn_tokens: int) -> list[str]:
    """One reference per turn (``turn_tokens`` digits 0..3), a pure function of the seed."""
    rng = random.Random(f"turns-{seed}")
    return ["".join(str(rng.randrange(SYMBOLS)) for _ in range(turn_tokens)) for _ in range(turns)]


def prompt_text(first: str) -> str:
    return f"Say: {first}"


def observation_ids(reference: str) -> list[int]:
    """The observation before a turn: its reference as digit bytes between the chat markers."""
    return [OBS_START, *reference.encode(), OBS_END]


def observation_length(turn_tokens: int) -> int:
    return turn_tokens + 2


def prompt_length(turn_tokens: int) -> int:
    """Tokens of the prompt on the embedded tokenizer: its chat template around ``prompt_text``
    (one token a byte, one a special: ``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``)."""
    return len(prompt_text("0" * turn_tokens)) + 19


def response_length(turns: int, turn_tokens: int) -> int:
    """Tokens of a full response: the turns and the observations between them."""
    return turns * turn_tokens + (turns - 1) * observation_length(turn_tokens)


def symbol(token: int) -> int | None:
    """The symbol a token id stands for (its byte's block), None for a special id."""
    return token // BLOCK if 0 <= token < NUM_BYTES else None


def turn_score(ids: list[int], reference: str) -> float:
    """Share of the reference's positions whose token is in the right block."""
    right = sum(symbol(t) == int(s) for t, s in zip(ids, reference, strict=False))
    return right / len(reference)


def turn_scores(response: list[int], starts: list[int], ends: list[int], refs: list[str]) -> list[float]:
    """Per turn, its score over its span of ``response``; turns without a span (cut by the response
    budget) score 0."""
    if not len(starts) == len(ends) <= len(refs):
        raise ValueError(f"{len(starts)} turn starts and {len(ends)} ends for {len(refs)} references")
    scores = [turn_score(response[a:b], ref) for ref, a, b in zip(refs, starts, ends, strict=False)]
    return scores + [0.0] * (len(refs) - len(scores))


def reward(response: list[int], starts: list[int], ends: list[int], refs: list[str]) -> tuple[float, list[float]]:
    """The mean turn score over all turns, and the turn scores."""
    scores = turn_scores(response, starts, ends, refs)
    return sum(scores) / len(scores), scores


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of 1s in a response mask: the assistant turns."""
    runs, start = [], None
    for t, m in enumerate([*mask, 0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


def rows(refs: list[str], n: int, split: str) -> list[dict]:
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt_text(refs[0])}],
            "ability": "multi_turn",
            "reward_model": {"style": "rule", "ground_truth": list(refs)},
            "extra_info": {"split": split, "index": i, "turns": len(refs)},
            "agent_name": AGENT_NAME,
        }
        for i in range(n)
    ]


def write_dataset(folder: str | Path, seed: int, turns: int, turn_tokens: int, n_train: int = 64, n_val: int = 16):
    """train.parquet and test.parquet in ``folder``; (train, val) paths."""
    import pandas as pd

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    refs = references(seed, turns, turn_tokens)
    out = []
    for split, n in (("train", n_train), ("test", n_val)):
        path = folder / f"{split}.parquet"
        pd.DataFrame(rows(refs, n, split)).to_parquet(path, index=False)
        out.append(str(path))
    return out[0], out[1]


def ensure_dataset(seed: int, turns: int, turn_tokens: int, cache_dir: str | os.PathLike | None = None) -> dict:
    """The task's train and val parquet in the local mode's cache, built on first use."""
    from maspo_verl.util import atomic_build, default_cache_dir

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    folder = cache / f"turns-v{DATA_VERSION}-seed{seed}-n{turns}-t{turn_tokens}"
    atomic_build(folder, lambda tmp: write_dataset(tmp, seed, turns, turn_tokens))
    return {"train": str(folder / "train.parquet"), "val": str(folder / "test.parquet")}
