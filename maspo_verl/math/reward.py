"""Math reward for verl: ``compute_score(data_source, solution_str, ground_truth, extra_info)``.

Referenced from the trainer config as::

    reward.custom_reward_function.path=pkg://maspo_verl.math.reward
    reward.custom_reward_function.name=compute_score

(verl loads ``pkg://`` paths with ``importlib``, so this works from a wheel and on every Ray node.)

Rules, in order (any failure scores 0.0; only a run of timeouts raises, below):

1. Qwen3 thinking: if the response has ``</think>``, only the text after the last one is graded;
   an opened ``<think>`` that never closes (a truncated thought) has no answer.
2. The answer is the content of ``\\boxed{...}`` (also ``\\boxed ...`` and ``\\fbox{...}``), found
   with brace matching. No box, an empty box, or an unclosed box scores 0. Several boxes with
   *different* contents are hedging and score 0 (``allow_multiple_boxes=True`` grades the last one
   instead); the same answer boxed twice counts once.
3. Equivalence is math-verify's (what verl uses): fractions, LaTeX vs plain numbers, sets and
   intervals, ``\\text{}`` units and ``\\$`` stripped, thousands separators; percent and degree
   marks are dropped on both sides first (``50\\%`` = ``50``, ``30^\\circ`` = ``30``).

Timeouts: ``MASPO_MATH_REWARD_TIMEOUT`` (s) bounds the grading of one answer, never its wait. On the
main thread a SIGALRM timer bounds it; verl's reward loop calls ``compute_score`` from executor threads,
where signals cannot work, so there it grades in spawned grading processes (``MASPO_MATH_REWARD_WORKERS``
per process, default 1): a caller waits for an idle one, and one that runs past the timeout is killed and
replaced, so that it cannot hold up the answers queued behind it. A timed-out answer scores 0 and is
marked (``timeout: 1.0``; verl's trainer logs the step's fraction as ``reward/timeout/mean``). When more
than ``max_timeout_frac`` (a reward kwarg, default 0.5) of the recent answers time out, the reward raises
and the trainer stops with that cause (``maspo_verl.plugin.hooks.report_run_failure``).
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import signal
import threading

from maspo_verl.util import import_extra

_BOX_COMMANDS = ("\\boxed", "\\fbox")
TIMEOUT_S = float(os.environ.get("MASPO_MATH_REWARD_TIMEOUT", "10"))
POOL_WORKERS = int(os.environ.get("MASPO_MATH_REWARD_WORKERS", "1"))  # per reward-loop worker
KILL_GRACE_S = 1.0  # a grading process that has not answered this long after its own timer is killed
START_TIMEOUT_S = 300.0  # a grading process imports math-verify once (~1.5 s on 2 idle cores)
CORRECT, WRONG, TIMEOUT, READY = "correct", "wrong", "timeout", "ready"

_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _require_math_verify():
    import_extra("math_verify", "math-verify[antlr4_9_3]", "math", "maspo_verl.math.reward")


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


class GradingTimeout(BaseException):
    """Grading ran past ``TIMEOUT_S`` (a BaseException, so math-verify's ``except Exception`` lets it through)."""


class MathRewardTimeouts(RuntimeError):
    """More than ``max_timeout_frac`` of the recent answers timed out: raised so that the run stops."""


def _verify(answer: str, ground_truth: str) -> bool:
    """math-verify equivalence with no timeout of its own (the caller bounds it)."""
    import math_verify.grader
    import math_verify.parser
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # its "timeout is disabled" warning: the timeout is ours (``_grade``)
    math_verify.grader.TIMEOUT_WARNING_SHOWN = math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    answer, ground_truth = strip_unit_marks(answer), strip_unit_marks(ground_truth)
    gold = parse("\\boxed{" + ground_truth + "}", (LatexExtractionConfig(),), parsing_timeout=None)
    pred = parse(
        "\\boxed{" + answer + "}",
        (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()),
        parsing_timeout=None,
    )
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def _raise_timeout(signum, frame):
    raise GradingTimeout


def _grade_with_alarm(answer: str, ground_truth: str, timeout_s: float) -> str:
    """``CORRECT``, ``WRONG`` or ``TIMEOUT``, bounded by a SIGALRM timer (main thread only)."""
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return CORRECT if _verify(answer, ground_truth) else WRONG
    except GradingTimeout:
        return TIMEOUT
    except Exception:  # noqa: BLE001 - unparsable answers are wrong, never a crash
        return WRONG
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _serve(conn) -> None:
    """A grading process: imports math-verify, says ``ready``, then grades one task at a time."""
    import math_verify  # noqa: F401

    conn.send(READY)
    while True:
        try:
            answer, ground_truth, timeout_s = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(_grade_with_alarm(answer, ground_truth, timeout_s))


class _Worker:
    """One spawned grading process and the pipe to it; used by one thread at a time."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=True, name="maspo-math-grader")
        self.process.start()
        child.close()
        # start-up (imports, ~1.5 s on 2 cores) is waiting, not grading: it is not timed against TIMEOUT_S
        if not self.conn.poll(START_TIMEOUT_S) or self.conn.recv() != READY:
            self.kill()
            raise RuntimeError(f"maspo_verl.math.reward: a grading process did not start in {START_TIMEOUT_S:.0f} s")

    def grade(self, answer: str, ground_truth: str, timeout_s: float) -> str | None:
        """The verdict, or None when the process did not answer within ``timeout_s`` (+ grace) or died."""
        try:
            self.conn.send((answer, ground_truth, timeout_s))
            if self.conn.poll(timeout_s + KILL_GRACE_S):
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        return None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class _Pool:
    """Up to ``size`` grading processes. A caller waits for an idle one (the wait is not timed), grades
    one answer under ``TIMEOUT_S``, and a process that runs past it is killed and later replaced, so
    that it never holds up the answers queued behind it."""

    def __init__(self, size: int):
        self.size = max(1, size)
        self.idle: list[_Worker] = []
        self.count = 0
        self.cond = threading.Condition()
        self.closed = False

    def _acquire(self) -> _Worker:
        with self.cond:
            while not self.idle and self.count >= self.size:
                self.cond.wait()
            if self.idle:
                return self.idle.pop()
            self.count += 1
        try:
            return _Worker()
        except BaseException:
            self._forget()
            raise

    def _forget(self) -> None:
        with self.cond:
            self.count -= 1
            self.cond.notify()

    def grade(self, answer: str, ground_truth: str, timeout_s: float) -> str:
        worker = self._acquire()
        verdict = worker.grade(answer, ground_truth, timeout_s)
        if verdict is None:  # ran past the timeout (or died): replaced by a fresh process on demand
            worker.kill()
            self._forget()
            return TIMEOUT
        with self.cond:
            if self.closed:
                worker.kill()
            else:
                self.idle.append(worker)
            self.cond.notify()
        return verdict

    def close(self) -> None:
        with self.cond:
            self.closed = True
            idle, self.idle = self.idle, []
            self.count -= len(idle)
        for worker in idle:
            worker.kill()


def _get_pool() -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Pool(POOL_WORKERS)
        return _pool


def reset_pool() -> None:
    """Stop the grading processes (a new pool starts on the next call off the main thread)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.close()


def grade(answer: str, ground_truth: str) -> str:
    """``CORRECT``, ``WRONG`` or ``TIMEOUT`` under math-verify, with ``TIMEOUT_S`` bounding this answer's
    grading in any thread: a SIGALRM timer on the main thread, a grading process elsewhere."""
    _require_math_verify()
    if threading.current_thread() is threading.main_thread():
        return _grade_with_alarm(answer, ground_truth, TIMEOUT_S)
    return _get_pool().grade(answer, ground_truth, TIMEOUT_S)


def is_equivalent(answer: str, ground_truth: str) -> bool:
    """math-verify equivalence with a timeout that works in any thread; False on a timeout or an error."""
    return grade(answer, ground_truth) == CORRECT


class TimeoutJudge:
    """Raises ``MathRewardTimeouts`` when more than ``max_timeout_frac`` of the last ``WINDOW`` answers
    (at least ``MIN_JUDGED``) timed out: a grader that cannot keep up, not hard answers."""

    WINDOW = 32
    MIN_JUDGED = 8

    def __init__(self):
        self.recent: collections.deque[bool] = collections.deque(maxlen=self.WINDOW)
        self.lock = threading.Lock()

    def record(self, timed_out: bool, max_timeout_frac: float) -> None:
        with self.lock:
            self.recent.append(timed_out)
            judged, late = len(self.recent), sum(self.recent)
            if judged < self.MIN_JUDGED or late <= max_timeout_frac * judged:
                return
            self.recent.clear()
        message = (
            f"math reward: {late} of the last {judged} answers timed out (grading one answer is bounded by "
            f"MASPO_MATH_REWARD_TIMEOUT={TIMEOUT_S:g} s), more than max_timeout_frac={max_timeout_frac}. "
            "Raise the timeout or MASPO_MATH_REWARD_WORKERS, or set "
            "reward.custom_reward_function.reward_kwargs.max_timeout_frac=1.0 to score them 0 and go on."
        )
        from maspo_verl.plugin.hooks import report_run_failure

        report_run_failure(message)
        raise MathRewardTimeouts(message)


_judge = TimeoutJudge()


def compute_score(
    data_source: str | None = None,
    solution_str: str | None = None,
    ground_truth: str | None = None,
    extra_info: dict | None = None,
    allow_multiple_boxes: bool = False,
    max_timeout_frac: float = 0.5,
    **kwargs,
) -> dict:
    """verl custom reward: ``{"score": 1.0 | 0.0, "acc": same, "format_ok": 1.0 if one usable box,
    "timeout": 1.0 if grading ran past the timeout (scored 0)}``; raises ``MathRewardTimeouts`` when
    more than ``max_timeout_frac`` of the recent answers timed out."""
    _require_math_verify()
    if not 0.0 <= float(max_timeout_frac) <= 1.0:
        raise ValueError(f"math reward: max_timeout_frac={max_timeout_frac} is invalid: allowed a number in [0, 1]")
    answer = extract_answer(solution_str or "", allow_multiple_boxes=allow_multiple_boxes)
    if answer is None or ground_truth is None or not str(ground_truth).strip():
        return {"score": 0.0, "acc": 0.0, "format_ok": 0.0, "timeout": 0.0}
    verdict = grade(answer, str(ground_truth).strip())
    _judge.record(verdict == TIMEOUT, float(max_timeout_frac))
    score = 1.0 if verdict == CORRECT else 0.0
    return {"score": score, "acc": score, "format_ok": 1.0, "timeout": float(verdict == TIMEOUT)}
