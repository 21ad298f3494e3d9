"""End-to-end: the documented local commands of docs/agents.md, 2 steps of verl's real trainer on the
multi-turn toy environment in decoupled mode (verl recomputes πold; the rollout samples from a bf16 copy of
the policy and reports its own log-probs):

- ``rollout_is=segment`` with a ``seg_*`` rejection option: the segment metrics in ``metrics.jsonl``, one
  segment per assistant turn, weights near 1 for this small mismatch;
- ``credit=turns``: verl's advantage step read the toy loop's per-turn scores for every sample.

Bad values are refused before Ray starts (no Ray temp dir, the field named)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tests.warm_cli import run_main

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TURNS = 2  # hydra_configs/task/turns.yaml
MISMATCH = [
    "maspo.local_mismatch.logprob_dtype=bf16",
    "++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
]
CORRECTION = [
    "algorithm.rollout_correction.rollout_is=segment",
    "algorithm.rollout_correction.rollout_is_threshold=2.0",
    "algorithm.rollout_correction.rollout_rs=seg_mean_k3",
    "algorithm.rollout_correction.rollout_rs_threshold=0.01",
]
SEGMENT_METRICS = (
    [f"rollout_corr/rollout_is_segment_{stat}" for stat in ("raw_mean", "raw_min", "raw_max", "raw_ess")]
    + [f"rollout_corr/rollout_is_segment_{stat}" for stat in ("mean", "min", "max", "ess", "capped_fraction")]
    + [
        "rollout_corr/segments_per_response",
        "rollout_corr/rollout_rs_segment_rejected_fraction",
        "rollout_corr/rollout_rs_seg_mean_k3_segment_rejected_fraction",
        "rollout_corr/kl",
    ]
)


def test_segment_correction_command_two_steps(local_run):
    run = local_run(["task=turns", "loss=maspo_turns", *MISMATCH, *CORRECTION])
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    assert sorted(run.steps) == [1, 2], context
    for step, m in run.steps.items():
        missing = [k for k in SEGMENT_METRICS if k not in m]
        assert not missing, (step, missing, context)
        assert all(math.isfinite(m[k]) for k in SEGMENT_METRICS), (step, context)
        assert m["rollout_corr/segments_per_response"] == TURNS
        # a bf16 rollout of the tiny model: per-turn weights within a few per mille of 1, none capped
        assert abs(m["rollout_corr/rollout_is_segment_raw_mean"] - 1) < 0.05
        assert (
            0 < m["rollout_corr/rollout_is_segment_ess"] <= 1
            and m["rollout_corr/rollout_is_segment_capped_fraction"] == 0
        )
        assert m["rollout_corr/kl"] != 0  # the rollout is a different policy
        assert math.isfinite(m["actor/pg_loss"])


@pytest.mark.slow
def test_turn_credit_command_two_steps(local_run):
    run = local_run(["task=turns", "loss=maspo_turns", "credit=turns"])
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    assert sorted(run.steps) == [1, 2], context
    for m in run.steps.values():
        assert m["turn_credit/scored_fraction"] == 1.0, context  # every sample's turn_scores reached the estimator
        assert math.isfinite(m["actor/pg_loss"])


def _main(tmp_path, *overrides):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["MASPO_VERL_CACHE"] = str(tmp_path / "cache")
    return run_main(["local=cpu", "task=turns", *overrides], tmp_path, env)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.rollout_correction.rollout_is=turn"], "algorithm.rollout_correction.rollout_is='turn' is invalid"),
        (
            [
                "algorithm.rollout_correction.rollout_rs=seg_avg_k3",
                "algorithm.rollout_correction.rollout_rs_threshold=1",
            ],
            "seg_mean_k3",
        ),
        (
            ["algorithm.rollout_correction.rollout_is=segment", "algorithm.rollout_correction.bypass_mode=true"],
            "algorithm.rollout_correction.bypass_mode=false",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_is=segment",
                "algorithm.rollout_correction.rollout_segment_rule=words",
            ],
            "rollout_segment_rule='words' is invalid",
        ),
        (["credit=turns", "algorithm.turn_credit.lam=-1"], "algorithm.turn_credit.lam=-1"),
    ],
)
def test_bad_values_are_refused_before_ray_starts(tmp_path, overrides, message):
    done = _main(tmp_path, *overrides)
    assert done.returncode != 0
    assert message in done.stderr + done.stdout, done.stderr[-2000:]
    assert "Started a local Ray instance" not in done.stderr + done.stdout
