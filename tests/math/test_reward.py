"""The math reward: a table of known (solution, ground truth, score) triples, malformed outputs,
verl's loader, and grading from a non-main thread (where verl's reward loop calls it)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.math.conftest import require_math_verify


@pytest.fixture(autouse=True, scope="module")
def _math_verify():
    require_math_verify()


# (model output, ground truth, expected score)
TABLE = [
    # plain and formatted numbers
    ("So the total is \\boxed{72}.", "72", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{2000}", "2,000", 1.0),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
    ("\\boxed{73}", "72", 0.0),
    # fractions
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{1/2}", "\\frac12", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("\\boxed{\\tfrac34}", "0.75", 1.0),
    ("\\boxed{0.33}", "\\frac13", 0.0),
    # LaTeX expressions, radicals, tuples, intervals, sets, equations
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{[1, 3)}", "[1,3)", 1.0),
    ("\\boxed{[1, 3]}", "[1,3)", 0.0),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{\\text{(C)}}", "\\text{(C)}", 1.0),
    ("\\boxed{3.14}", "\\pi", 0.0),
    # units, currency, percent, degrees: the number is graded
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("\\boxed{5 \\text{ cm}^2}", "5", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{30^\\circ}", "30", 1.0),
    ("\\boxed{30^{\\circ}}", "30^\\circ", 1.0),
    # box syntax variants
    ("The answer is \\boxed 7.", "7", 1.0),
    ("\\fbox{7}", "7", 1.0),
    ("\\boxed{\\boxed{7}}", "7", 1.0),
    # Qwen3 thinking: only the text after </think> counts
    ("<think>maybe \\boxed{3}</think>Final: \\boxed{7}", "7", 1.0),
    ("<think>maybe \\boxed{7}</think>Final: \\boxed{3}", "7", 0.0),
    ("<think>still thinking \\boxed{7}", "7", 0.0),  # truncated thought: no answer
    # malformed outputs: all 0, none raises
    ("The answer is 72.", "72", 0.0),  # no box
    ("\\boxed{3} or maybe \\boxed{4}", "3", 0.0),  # several different boxes: hedging
    ("\\boxed{7}, i.e. \\boxed{ 7 }", "7", 1.0),  # the same answer boxed twice counts once
    ("\\boxed{}", "7", 0.0),  # empty box
    ("", "7", 0.0),  # empty output
    ("   \n", "7", 0.0),
    ("\\boxed{7", "7", 0.0),  # unclosed box (truncated)
    ("\\boxed{}}}{{", "1", 0.0),
    ("\\boxed{\\frac{1}{0}}", "1", 0.0),
    ("\\boxed{\\frac{(}{]}}", "1", 0.0),  # unparsable LaTeX
    ("\\boxedx 7", "7", 0.0),  # not a box command
    ("\\boxed{7}", "", 0.0),  # empty ground truth
]


@pytest.mark.parametrize("solution, ground_truth, expected", TABLE)
def test_table(solution, ground_truth, expected):
    from maspo_verl.math.reward import compute_score

    result = compute_score("math500", solution, ground_truth, {"split": "test"})
    assert result["score"] == expected, (solution, ground_truth, result)
    assert result["acc"] == result["score"]
    assert set(result) == {"score", "acc", "format_ok", "timeout"}
    assert result["timeout"] == 0.0


@pytest.mark.parametrize("solution", [None, 17, b"\\boxed{7}", ["\\boxed{7}"]])
def test_non_string_outputs_score_zero(solution):
    from maspo_verl.math.reward import compute_score

    assert compute_score("math", solution, "7")["score"] == 0.0


def test_format_flag():
    from maspo_verl.math.reward import compute_score

    assert compute_score("m", "\\boxed{8}", "7")["format_ok"] == 1.0
    assert compute_score("m", "7", "7")["format_ok"] == 0.0


def test_allow_multiple_boxes_grades_the_last():
    from maspo_verl.math.reward import compute_score

    assert compute_score("m", "\\boxed{3} no wait \\boxed{4}", "4", allow_multiple_boxes=True)["score"] == 1.0
    assert compute_score("m", "\\boxed{3} no wait \\boxed{4}", "4")["score"] == 0.0


def test_verl_loads_it_by_package_path():
    """The recipes pass reward.custom_reward_function.path=pkg://maspo_verl.math.reward (works from a wheel)."""
    from verl.utils.import_utils import load_extern_object

    fn = load_extern_object("pkg://maspo_verl.math.reward", "compute_score")
    assert fn(data_source="aime24", solution_str="\\boxed{24}", ground_truth="24", extra_info={})["score"] == 1.0


def test_grading_off_the_main_thread(monkeypatch):
    """verl's reward loop calls compute_score in an executor thread, where math-verify's signal
    timeouts cannot work (it would score everything 0); the reward grades in a process pool there."""
    import maspo_verl.math.reward as reward

    monkeypatch.setattr(reward, "POOL_WORKERS", 1)
    reward.reset_pool()
    cases = [("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{1/2}", "\\frac12", 1.0), ("\\boxed{3}", "0.5", 0.0)]
    results: dict[int, float] = {}

    def work(i, solution, gt):
        results[i] = reward.compute_score("math", solution, gt)["score"]

    threads = [threading.Thread(target=work, args=(i, s, g)) for i, (s, g, _) in enumerate(cases)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
    finally:
        reward.reset_pool()
    assert results == {i: expected for i, (_, _, expected) in enumerate(cases)}


SLOW = "\\boxed{9^{9^{9^{9^{9}}}}}"  # math-verify cannot finish comparing it with 7


def _in_threads(calls, stagger_s=0.0):
    """compute_score(*call) for each call, each from its own thread (as verl's reward loop calls it)."""
    import maspo_verl.math.reward as reward

    results: dict[int, dict] = {}

    def work(i, args):
        results[i] = reward.compute_score("math", *args)

    threads = [threading.Thread(target=work, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
        time.sleep(stagger_s)
    for t in threads:
        t.join(timeout=300)
    return [results.get(i) for i in range(len(calls))]


@pytest.fixture
def fresh_pool(monkeypatch):
    import maspo_verl.math.reward as reward

    monkeypatch.setattr(reward, "POOL_WORKERS", 1)
    monkeypatch.setattr(reward, "TIMEOUT_S", 2.0)
    monkeypatch.setattr(reward, "_judge", reward.TimeoutJudge())
    reward.reset_pool()
    yield reward
    reward.reset_pool()


def test_a_burst_of_slow_answers_does_not_time_out_the_answer_queued_behind_it(fresh_pool):
    """The timeout bounds one answer's grading, not its wait: three answers math-verify cannot finish,
    then a correct one, from threads into one grading process. The slow ones score 0 and are marked
    ``timeout``; the correct one, which waited three timeouts and more, scores 1."""
    calls = [(SLOW, "7")] * 3 + [("\\boxed{7}", "7")]
    start = time.monotonic()
    out = _in_threads(calls, stagger_s=0.3)
    waited = time.monotonic() - start
    assert [r["timeout"] for r in out] == [1.0, 1.0, 1.0, 0.0], out
    assert [r["score"] for r in out] == [0.0, 0.0, 0.0, 1.0], out
    assert waited > 3 * fresh_pool.TIMEOUT_S  # it did queue behind them


def test_a_grading_process_that_stops_answering_is_replaced(fresh_pool):
    """A grading process that does not answer within the timeout (here: stopped with SIGSTOP, as a
    computation no signal interrupts would be) is killed; the answer is marked ``timeout`` and the next
    one is graded by a fresh process."""
    assert _in_threads([("\\boxed{7}", "7")])[0]["score"] == 1.0  # starts the process
    (worker,) = fresh_pool._pool.idle
    os.kill(worker.process.pid, signal.SIGSTOP)
    (stuck,) = _in_threads([("\\boxed{7}", "7")])
    assert stuck == {"score": 0.0, "acc": 0.0, "format_ok": 1.0, "timeout": 1.0}
    assert not worker.process.is_alive()
    assert _in_threads([("\\boxed{7}", "7")])[0] == {"score": 1.0, "acc": 1.0, "format_ok": 1.0, "timeout": 0.0}


def test_most_answers_timing_out_stops_the_reward(fresh_pool):
    """More than max_timeout_frac of the recent answers timing out raises (the grader cannot keep up),
    like the speech reward's max_failed_frac; on the main thread the SIGALRM timer marks them too."""
    reward = fresh_pool
    right = [reward.compute_score("m", "\\boxed{7}", "7") for _ in range(reward.TimeoutJudge.MIN_JUDGED - 4)]
    assert all(r["timeout"] == 0.0 and r["score"] == 1.0 for r in right)
    slow = [reward.compute_score("m", SLOW, "7", max_timeout_frac=0.5) for _ in range(4)]
    assert all(r == {"score": 0.0, "acc": 0.0, "format_ok": 1.0, "timeout": 1.0} for r in slow)  # 4 of 8: allowed
    with pytest.raises(reward.MathRewardTimeouts, match="5 of the last 9 answers timed out"):
        reward.compute_score("m", SLOW, "7", max_timeout_frac=0.5)
    with pytest.raises(ValueError, match="max_timeout_frac=2"):
        reward.compute_score("m", "\\boxed{7}", "7", max_timeout_frac=2)


def test_the_timeout_fraction_is_a_trainer_metric():
    """Every answer carries ``timeout``, so the trainer hook logs the step's fraction."""
    from maspo_verl.math.reward import compute_score
    from maspo_verl.plugin.hooks import reward_step_metrics

    infos = [compute_score("m", s, "7") for s in ("\\boxed{7}", "no box", "\\boxed{8}")]
    infos.append({"score": 0.0, "acc": 0.0, "format_ok": 1.0, "timeout": 1.0})
    assert reward_step_metrics(infos)["reward/timeout/mean"] == 0.25
