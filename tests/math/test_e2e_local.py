"""End-to-end (slow, `-m e2e`): verl's real trainer in the local CPU mode (`local=cpu`, embedded tiny
model) on a tiny sample of *prepared math data*, with the math recipe's reward and loss overrides
(CTPO-LA with bypass_mode=true and rollout log-probs as old log-probs), 2 steps.

What it proves beyond the dry runs: our parquet files load through verl's RLHFDataset, the reward
is found through `pkg://maspo_verl.math.reward` and graded inside verl's reward loop (an executor
thread, hence our process pool), validation metrics come out per data source, and the losses train
under bypass mode. The random model never writes \\boxed{}, so every score is 0 (and so are GRPO
advantages): this checks plumbing, not learning.
"""

from __future__ import annotations

import math

import pytest

from maspo_verl.lab.engine.runs import run_local

pytestmark = pytest.mark.e2e


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["ctpo"])  # CTPO-LA; gspo passes too (one run: a slow test)
def test_math_recipe_two_local_steps(loss, prepared_dir, tmp_path, tmp_path_factory):
    d = prepared_dir
    overrides = [
        f"loss={loss}",
        "algorithm.rollout_correction.bypass_mode=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "recipe=math",  # the recipe's preset (math-verify reward); local=cpu overrides its GPU settings
        f"data.train_files=['{d / 'gsm8k_train.parquet'}','{d / 'math_train.parquet'}']",
        f"data.val_files=['{d / 'math500_test.parquet'}','{d / 'aime25_test.parquet'}']",
        "data.max_prompt_length=384",
        "data.max_response_length=32",
        "trainer.total_training_steps=2",
        "trainer.total_epochs=2",  # 4 training prompts = one batch per epoch
        "trainer.test_freq=2",
        "trainer.val_before_train=false",
        "trainer.logger=['console','file']",  # file: every metric (the reward's too) in the run folder
    ]
    cache = {"MASPO_VERL_CACHE": str(tmp_path_factory.mktemp("cache"))}
    run = run_local(overrides, tmp_path / "run", timeout_s=600, env=cache)
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    assert sorted(run.steps) == [1, 2], f"logged steps {sorted(run.steps)}{context}"
    for metrics in run.steps.values():
        assert math.isfinite(metrics["actor/pg_loss"]), context
        assert metrics["critic/score/mean"] == 0.0, context  # graded by our reward: no \boxed{} -> 0
        assert metrics["reward/timeout/mean"] == 0.0, context  # the step's fraction of timed-out answers
    last = run.steps[2]
    for source in ("math500", "aime25"):
        assert any(key.startswith(f"val-core/{source}/acc/") for key in last), f"{source}: {sorted(last)}{context}"
