"""e2e fixtures: ``local_run`` runs ``python -m maspo_verl.main local=cpu ...`` through the lab's runner
(``maspo_verl.lab.engine.runs``: a private Ray cluster stopped afterwards, the run folder in the test's tmp dir,
verl's step metrics from its ``metrics.jsonl``) and returns its ``LocalRun``."""

from __future__ import annotations

import pytest

from maspo_verl.lab.engine.runs import LocalRun, run_local


def manager_overrides(module, name: str) -> list[str]:
    """One training step of full-length responses scored by the test reward manager ``name`` in ``module``."""
    return [
        "reward.reward_manager.source=importlib",
        f"reward.reward_manager.name={name}",
        f"reward.reward_manager.module.path={module}",
        "actor_rollout_ref.rollout.ignore_eos=true",
        "trainer.total_training_steps=1",
    ]


@pytest.fixture(scope="session")
def local_cache_dir(tmp_path_factory):
    """One embedded-asset cache for the whole session (built on first use)."""
    return str(tmp_path_factory.mktemp("maspo_cache"))


@pytest.fixture
def local_run(tmp_path, local_cache_dir):
    """``local_run(overrides, timeout_s=..., own_ray_dir=..., home=...) -> LocalRun``; run folders (console.log
    inside) in tmp_path: ``run``, then ``run1``, ... for a test that runs the trainer more than once."""

    def _run(overrides: list[str], timeout_s: float = 480, own_ray_dir: bool = True, home=None) -> LocalRun:
        run_dir = next(tmp_path / f"run{i or ''}" for i in range(100) if not (tmp_path / f"run{i or ''}").exists())
        env = {"MASPO_VERL_CACHE": local_cache_dir, **({"HOME": str(home)} if home else {})}
        return run_local(overrides, run_dir, timeout_s=timeout_s, env=env, own_ray_dir=own_ray_dir)

    return _run
