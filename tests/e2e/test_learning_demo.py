"""The README's CPU run that learns (``python -m maspo_verl.lab learn ...``, 15 steps on the speech-like toy
task), run as printed: the reward rises over its steps, and the local run draws ``reward.png`` beside its
``metrics.jsonl``. About 3-4 minutes on 2 cores, so marked slow (a 2-step lab run: test_learn_smoke.py)."""

from __future__ import annotations

import csv
import statistics
import tempfile

import pytest

from maspo_verl.lab.__main__ import main
from tests.test_readme_ci import readme_learning_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_readme_learning_run_learns_and_draws_its_curve(tmp_path, local_cache_dir, monkeypatch):
    monkeypatch.setenv("MASPO_VERL_CACHE", local_cache_dir)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the lab's run folders, here
    out = tmp_path / "learn"
    main([*readme_learning_command().split()[3:], "--out", str(out)])  # from `learn` on
    rewards = [float(r["critic/score/mean"]) for r in csv.DictReader(open(out / "learn_steps.csv"))]
    assert len(rewards) == 15
    # measured twice: 0.36 at step 1, 0.46-0.48 over the last 3 steps (a step's mean of 32 responses is noisy)
    assert statistics.fmean(rewards[-3:]) > rewards[0] + 0.05, rewards
    (plot,) = tmp_path.glob("maspo_learn_logs_*/*/reward.png")
    assert (plot.parent / "metrics.jsonl").is_file() and plot.read_bytes()[:4] == b"\x89PNG"
