"""End-to-end: verl 0.9.1's real trainer (main_ppo, Ray, FSDP2, agent loop, ppo_loss) on CPU, 2 steps.

Each test runs ``python -m maspo_verl.main local=cpu loss=<preset> ...`` on the embedded tiny model
and toy data, and checks verl's logged step metrics (not just the exit code). ~1.5-2 min each on
2 cores, most of it Ray and worker start-up. On failure the tail of the trainer log is printed.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from maspo_verl.lab.engine.runs import parse_steps
from maspo_verl.local.console import STEP_KEYS
from maspo_verl.plugin.engine_mismatch import PREFIX as ENGINE_MISMATCH
from maspo_verl.util import read_step_metrics as read_metrics
from tests.e2e.conftest import manager_overrides

pytestmark = pytest.mark.e2e

STEPS = 2
RESPONSE_LEN = 32
COMMON = [
    f"trainer.total_training_steps={STEPS}",
    f"data.max_response_length={RESPONSE_LEN}",
    # every response runs to max length, so segment statistics are exact
    "actor_rollout_ref.rollout.ignore_eos=true",
]


def _run(local_run, overrides: list[str], **kwargs):
    run = local_run(COMMON + overrides, **kwargs)
    step_times = [m.get("timing_s/step", 0.0) for _, m in sorted(run.steps.items())]
    ms = {k: round(v, 1) for k, v in run.milestones.items()}
    print(
        f"\nlocal run {overrides}: rc={run.returncode} wall={run.wall_s:.1f}s "
        f"step times={[round(t, 1) for t in step_times]}s milestones(s since launch)={ms}"
    )
    return run


def _check_common(run) -> None:
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    assert sorted(run.steps) == list(range(1, STEPS + 1)), f"logged steps {sorted(run.steps)}{context}"
    for step, metrics in run.steps.items():
        for key in (
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/pg_clipfrac",
            "actor/ratio/clipfrac_low",
            "actor/ratio/clipfrac_high",
            "actor/ratio/clipfrac_dual",
            "response_length/mean",
        ):
            assert key in metrics, f"step {step}: {key} missing from {sorted(metrics)}{context}"
        assert math.isfinite(metrics["actor/pg_loss"]), f"step {step}: pg_loss {metrics['actor/pg_loss']}{context}"
        grad = metrics["actor/grad_norm"]
        assert math.isfinite(grad), f"step {step}: grad_norm {grad}{context}"
        assert metrics["response_length/mean"] == pytest.approx(RESPONSE_LEN), context
        for key in ("actor/ratio/clipfrac_low", "actor/ratio/clipfrac_high", "actor/ratio/clipfrac_dual"):
            assert 0.0 <= metrics[key] <= 1.0, f"step {step}: {key}={metrics[key]}{context}"
    assert run.some_step_had_a_gradient, context


def _check_readable_log(run) -> None:
    """The console is short, its step lines agree with the metrics file, it ends with the closing block
    (which names the files and repeats the last step's metrics), and the Ray temp dir is gone."""
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    # the lines printed, without the fixture's time prefix (a progress bar's carriage returns, read back
    # as line ends, continue its line)
    console = re.findall(r"^\[ *[\d.]+s\] (.*)$", run.log, flags=re.M)
    assert len(console) <= 150, f"{len(console)} lines{context}"
    metrics_file = run.run_dir / "metrics.jsonl"
    assert sorted(read_metrics(metrics_file)) == list(range(1, STEPS + 1)), context
    # one short step line per step, in verl's format, with the file's values to 4 significant digits
    shown = parse_steps(run.log)
    assert sorted(shown) == list(range(1, STEPS + 1)), context
    for step, values in shown.items():
        assert set(values) == {k for k in STEP_KEYS if k in run.steps[step]}, context
        for key, value in values.items():
            assert value == pytest.approx(run.steps[step][key], rel=1e-3, abs=1e-12), (step, key, context)
        # short, but for the engine mismatch's columns that bypass mode adds (tests/e2e/test_local_vllm.py)
        for line in (line for line in console if f"step:{step} -" in line):
            items = [item for item in line.split(" - ") if not item.startswith(f"actor/{ENGINE_MISMATCH}")]
            assert len(" - ".join(items)) < 300, context
    # the closing block is last
    start = next(i for i, line in enumerate(console) if line.startswith("==== maspo_verl local run"))
    block = console[start:]
    assert block[0].startswith(f"==== maspo_verl local run done: {STEPS} of {STEPS} steps in "), context
    # STEPS >= 2 trained steps: a reward line (the plot beside the metrics file)
    assert [line.split()[0] for line in block[1:]] == ["final", "metrics", "reward", "log", "config", "checkpoints"]
    assert (metrics_file.parent / "reward.png").is_file() and "reward.png" in block[3], block
    last = run.steps[STEPS]
    final = dict(item.rsplit(" ", 1) for item in block[1].split(": ", 1)[1].split(" | "))
    assert {label: float(v) for label, v in final.items()} == pytest.approx(
        {label: last[key] for key, label in STEP_KEYS.items() if key in last}, rel=1e-3
    ), block
    assert str(metrics_file.relative_to(run.run_dir)) in block[2] and (run.run_dir / "run.log").is_file(), block
    # verl's known-harmless start-up warnings: left out of the console, kept in run.log; no Python warning (verl's
    # or another's) reaches the console before the first step line
    assert "engine is not available" not in run.log and "engine is not available" in run.full_log, context
    first = next(i for i, line in enumerate(console) if re.search(r"(^|\) )step:1 - ", line))
    warned = [line for line in console[:first] if re.search(r"\w*Warning: ", line)]
    assert not warned, f"{warned}{context}"
    assert run.ray_dir and run.ray_dir.startswith("/tmp/maspo_ray_") and not run.ray_dir_left, run.ray_dir


def test_maspo_tokenval_bypass_v1(local_run, tmp_path):
    """Token-id segmentation (ids reach the loss through our ppo_loss wrapper) with the HF server's
    log-probs as old log-probs (bypass mode). The run as the README shows it (the local mode's own Ray temp
    dir): a short log that ends with the closing block. Run from an empty HOME, which it leaves empty (the
    private Ray cluster's token lives in its temp dir, not in ~/.ray). (Exact fixed-window segment counts in a
    trainer run: tests/e2e/test_ray_jobs.py.)"""
    max_len = 8
    home = tmp_path / "home"
    home.mkdir()
    run = _run(
        local_run,
        [
            "loss=maspo_tokenval",
            "actor_rollout_ref.actor.policy_loss.min_segment_len=2",
            f"actor_rollout_ref.actor.policy_loss.max_segment_len={max_len}",
            "algorithm.rollout_correction.bypass_mode=true",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
        ],
        own_ray_dir=False,
        home=home,
    )
    _check_common(run)
    _check_readable_log(run)
    left = sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file())
    assert left == [], f"{left}\n{run.tail()}"
    assert "maspo_verl local: tokenval codec range set to the embedded byte ids" in run.log
    for step, metrics in run.steps.items():
        context = f"step {step}\n--- trainer log tail ---\n{run.tail()}"
        seg_len = metrics["actor/ratio/segment_len_mean"]
        per_seq = metrics["actor/ratio/segments_per_seq"]
        assert 1.0 <= seg_len <= max_len, context
        # max_segment_len forces at least ceil(32 / 8) = 4 segments per response
        assert per_seq >= RESPONSE_LEN / max_len - 1e-6, context
        assert per_seq * seg_len == pytest.approx(RESPONSE_LEN, rel=0.15), context
        # bypass: old log-probs are the HF server's, so ratios are not exactly 1 as in the on-policy
        # first mini-batch (where verl recomputes old log-probs with the actor itself)
        assert (metrics["actor/ratio/min"], metrics["actor/ratio/max"]) != (1.0, 1.0), context


@pytest.mark.slow
def test_ctpo_legacy_trainer(local_run):
    """CTPO (prefix ratios, no segments) on the legacy trainer (trainer.use_v1=False), whose TaskRunner
    prints the resolved config when asked (maspo.print_config=true)."""
    run = _run(local_run, ["loss=ctpo", "trainer.use_v1=false", "maspo.print_config=true"])
    _check_common(run)
    # a step line for every step, the last one too (Ray may not forward it before the driver stops it)
    for text in (run.log, (run.run_dir / "run.log").read_text()):
        assert sorted(parse_steps(text)) == list(range(1, STEPS + 1)), run.tail()
    assert "'actor_rollout_ref'" in run.log and "'maspo'" in run.log and len(run.log.splitlines()) > 500, run.tail()
    for step, metrics in run.steps.items():
        assert "actor/ratio/segments_per_seq" not in metrics, f"step {step}: ctpo has no segments"


@pytest.mark.slow  # (tests/core: gmpo equals verl's geo_mean; its preset composes with verl's config)
def test_gmpo_trains(local_run):
    """GMPO (one geometric-mean ratio per response, per-token clip before sharing): trains with a gradient, one set
    per response, no dual clip."""
    run = _run(local_run, ["loss=gmpo"])
    _check_common(run)
    for step, metrics in run.steps.items():
        context = f"step {step}\n--- trainer log tail ---\n{run.tail()}"
        assert metrics["actor/ratio/segments_per_seq"] == pytest.approx(1.0), context
        assert metrics["actor/ratio/clipfrac_dual"] == 0.0, context


@pytest.mark.slow  # (the speech e2e test runs span credit on per-token scores)
@pytest.mark.parametrize("lam", [0.0, 0.4])
def test_per_token_scores_reach_the_span_credit_estimator(lam, local_run):
    """A reward manager returning per-token scores (equal utterance scores, so GRPO gives 0): the agent
    loop's rm_scores carry them (our hook, in the Ray agent-loop workers) and maspo_span_grpo turns them
    into advantages of exactly +-lam; with lam=0 they are verl's GRPO zeros."""
    manager = Path(__file__).with_name("reward_managers.py")
    run = local_run(
        [
            "algorithm.adv_estimator=maspo_span_grpo",
            f"algorithm.span_credit.lam={lam}",
            *manager_overrides(manager, "HalfSpanRewardManager"),
        ]
    )
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    metrics = run.steps[1]
    assert metrics["critic/score/mean"] == pytest.approx(0.5, abs=1e-5), context  # sum of the token scores
    assert metrics["critic/advantages/max"] == pytest.approx(lam, abs=1e-5), context
    assert metrics["critic/advantages/min"] == pytest.approx(-lam, abs=1e-5), context
