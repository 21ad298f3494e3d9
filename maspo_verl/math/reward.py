"""Math reward for verl: ``compute_score(data_source, solution_str, ground_truth, extra_info)``.

Referenced from the trainer config as::

    reward.custom_reward_function.path=pkg://maspo_verl.math.reward
    reward.custom_reward_function.name=compute_score

(verl loads ``pkg://`` paths with ``importlib``, so this works from a wheel and on every Ray node.)

Rules, in order (any failure scores 0.0 and never raises):

1. Qwen3 thinking: if the response has ``</think>``, only the text after the last one is graded;
   an opened ``<think>`` that never closes (a truncated thought) has no answer.
2. The answer is the content of ``\\boxed{...}`` (also ``\\boxed ...`` and ``\\fbox{...}``), found
   with brace matching. No box, an empty box, or an unclosed box scores 0. Several boxes with
   *different* contents are hedging and score 0 (``allow_multiple_boxes=True`` grades the last one
   instead); the same answer boxed twice counts once.
3. Equivalence is math-verify's (what verl uses): fractions, LaTeX vs plain numbers, sets and
   intervals, ``\\text{}`` units and ``\\$`` stripped, thousands separators; percent and degree
   marks are dropped on both sides first (``50\\%`` = ``50``, ``30^\\circ`` = ``30``).

Timeouts: math-verify times out with ``signal.alarm``, which only works in the main thread. verl's
reward loop calls ``compute_score`` from an executor thread, where math-verify would silently score
everything 0; off the main thread we therefore grade in a small spawn-based process pool (as verl's
own ``verl.utils.reward_score.math_verify`` does) with a wall-clock timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeoutError

from maspo_verl.util import warn_once

_BOX_COMMANDS = ("\\boxed", "\\fbox")
TIMEOUT_S = float(os.environ.get("MASPO_MATH_REWARD_TIMEOUT", "10"))
POOL_WORKERS = int(os.environ.get("MASPO_MATH_REWARD_WORKERS", "1"))  # per reward-loop worker
# the pool's answer may take this much longer than the grading itself (a spawned worker imports
# this module and math-verify once: ~1.5 s on 2 cores)
POOL_GRACE_S = 5.0

_pool: ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()


def _require_math_verify():
    try:
        import math_verify  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "maspo_verl.math.reward needs math-verify: pip install 'math-verify[antlr4_9_3]' "
            "(or the `math` extra: pip install -e '.[math]' in the maspo-verl checkout)"
        ) from exc


def strip_thinking(text: str) -> str | None:
    """The part of a response after the model's thinking; None if the thought never closed."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return None
    return text


def closing_brace(text: str, start: int) -> int:
    """Index of the ``}`` that closes the ``{`` at ``start``; -1 if it never closes."""
    depth = 0
    for k in range(start, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return -1


def find_boxes(text: str) -> list[str]:
    """Contents of every ``\\boxed{..}`` / ``\\boxed ..`` / ``\\fbox{..}``, in order; unclosed ones are dropped."""
    found: list[str] = []
    i = 0
    while True:
        starts = [(text.find(cmd, i), cmd) for cmd in _BOX_COMMANDS]
        starts = [(pos, cmd) for pos, cmd in starts if pos >= 0]
        if not starts:
            return found
        pos, cmd = min(starts)
        j = pos + len(cmd)
        if text.startswith("{", j):
            k = closing_brace(text, j)
            if k < 0:  # unclosed: a truncated answer
                return found
            found.append(text[j + 1 : k].strip())
            i = k + 1
        elif text.startswith(" ", j) and cmd == "\\boxed":  # "\boxed 5"
            words = text[j:].split()
            found.append(words[0].strip("$.,") if words else "")
            i = j + 1
        else:  # e.g. "\boxedsomething": not a box
            i = j
    return found


def extract_answer(solution_str: str, allow_multiple_boxes: bool = False) -> str | None:
    """The single graded answer of a response, or None (no box, empty, conflicting boxes, open thought)."""
    if not isinstance(solution_str, str) or not solution_str.strip():
        return None
    text = strip_thinking(solution_str)
    if text is None:
        return None
    boxes = [b for b in find_boxes(text) if b]
    if not boxes:
        return None
    distinct = {" ".join(b.split()) for b in boxes}
    if len(distinct) > 1 and not allow_multiple_boxes:
        return None
    return boxes[-1]


_UNIT_MARKS = ("^{\\circ}", "^\\circ", "\u00b0", "\\%", "%")


def strip_unit_marks(text: str) -> str:
    """Drop percent and degree marks, which math-verify would otherwise read as x/100 or a symbol."""
    for mark in _UNIT_MARKS:
        text = text.replace(mark, "")
    return text.strip()


def _verify(answer: str, ground_truth: str, timeout: int | None) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    answer, ground_truth = strip_unit_marks(answer), strip_unit_marks(ground_truth)

    gold = parse(
        "\\boxed{" + ground_truth + "}",
        (LatexExtractionConfig(),),
        parsing_timeout=timeout,
    )
    pred = parse(
        "\\boxed{" + answer + "}",
        (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()),
        parsing_timeout=timeout,
    )
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


def _verify_in_pool(answer: str, ground_truth: str) -> bool:
    return _verify(answer, ground_truth, timeout=max(1, int(TIMEOUT_S)))


def _get_pool() -> ProcessPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ProcessPoolExecutor(max_workers=POOL_WORKERS, mp_context=multiprocessing.get_context("spawn"))
        return _pool


def reset_pool() -> None:
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.shutdown(wait=False, cancel_futures=True)
        _pool = None


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """math-verify equivalence with a timeout that works in any thread; False on any error."""
    _require_math_verify()
    try:
        if threading.current_thread() is threading.main_thread():
            return _verify(answer, ground_truth, timeout=max(1, int(TIMEOUT_S)))
        future = _get_pool().submit(_verify_in_pool, answer, ground_truth)
        return bool(future.result(timeout=TIMEOUT_S + POOL_GRACE_S))
    except FuturesTimeoutError:
        return False
    except Exception as exc:  # noqa: BLE001 - a reward must never crash the trainer
        if exc.__class__.__name__ == "BrokenProcessPool":
            reset_pool()
            warn_once(
                f"maspo_verl.math.reward: grading pool broke ({exc!r}); scoring 0 and restarting it",
                RuntimeWarning,
            )
        return False


def compute_score(
    data_source: str | None = None,
    solution_str: str | None = None,
    ground_truth: str | None = None,
    extra_info: dict | None = None,
    allow_multiple_boxes: bool = False,
    **kwargs,
) -> dict:
    """verl custom reward: ``{"score": 1.0 | 0.0, "acc": same, "format_ok": 1.0 if one usable box}``."""
    _require_math_verify()
    answer = extract_answer(solution_str or "", allow_multiple_boxes=allow_multiple_boxes)
    if answer is None or ground_truth is None or not str(ground_truth).strip():
        return {"score": 0.0, "acc": 0.0, "format_ok": 0.0}
    correct = is_equivalent(answer, str(ground_truth).strip())
    score = 1.0 if correct else 0.0
    return {"score": score, "acc": score, "format_ok": 1.0}
