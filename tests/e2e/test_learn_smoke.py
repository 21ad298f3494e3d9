"""``python -m maspo_verl.lab learn`` end to end on 2 steps: one trainer run (speech-like task, MASPO
fixed windows + span credit, so the per-token scores travel through verl), in bypass mode with the
rollout server's log-prob noise on and one update per batch, outputs parsed from verl's log."""

from __future__ import annotations

import csv

import pytest

from maspo_verl.lab.__main__ import main

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_learn_command_two_steps(tmp_path, local_cache_dir, monkeypatch):
    monkeypatch.setenv("MASPO_VERL_CACHE", local_cache_dir)
    out = tmp_path / "learn"
    argv = ["learn", "--out", str(out), "--tasks", "speech", "--losses", "maspo_fixed+span", "--seeds", "1"]
    main([*argv, "--steps", "2", "--batch", "4", "--cells", "12/0.3/1", "--bypass", "--fp32-trainer"])
    for name in (
        "README.md",
        "COMMAND.txt",
        "learn_steps.csv",
        "learn_runs.csv",
        "learn_summary.csv",
        "learn_compare.csv",
        "learn_reward.png",
    ):
        assert (out / name).exists(), name
    steps = list(csv.DictReader(open(out / "learn_steps.csv")))
    assert [int(r["step"]) for r in steps] == [1, 2]
    for r in steps:
        assert 0.0 <= float(r["critic/score/mean"]) <= 1.0
        assert float(r["actor/grad_norm"]) > 0
    # one update per batch, fp32 actor: without the instrument old and current log-probs agree to fp32
    # round-off and nothing clips; the server's noise (sigma 0.3, ~0.17 per 3-token window) makes windows clip
    assert sum(float(r["actor/pg_clipfrac"]) for r in steps) > 0
    (run,) = list(csv.DictReader(open(out / "learn_runs.csv")))
    assert run["ok"] == "True" and run["exit_code"] == "0" and run["cell"] == "L12/0.3/U1"
    readme = (out / "README.md").read_text()
    assert "| speech | L12/0.3/U1 | maspo_fixed+span | 1/1 |" in readme
    assert "learn --out" in (out / "COMMAND.txt").read_text()
