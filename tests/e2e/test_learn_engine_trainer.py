"""End-to-end: ``lab learn --engine lab`` against verl's trainer on the same config (one trainer run, ~1-2 min).

One prompt a step (so one GRPO group: the trainer's request order cannot regroup responses), the part-2 cell's
mismatch (the rollout 2 weight syncs stale), bypass mode, fp32 trainer, our loss at a 2-token window. The engine
must draw the trainer's responses (every step's reward equal), compute its updates (the weights the trainer syncs
to its rollout, dumped by the hf server, equal the engine's to float rounding) and report its metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from maspo_verl.lab.engine import learn_engine as le
from maspo_verl.lab.engine.cells import Cell
from maspo_verl.lab.studies import learn
from maspo_verl.local import learn_tasks as lt
from maspo_verl.local import speechwarm as sw
from maspo_verl.local.hf_rollout import WEIGHTS_DUMP_ENV

pytestmark = pytest.mark.e2e

LENGTH, STEPS, STALE = 8, 5, 2
TINY = {"steps": 3, "batch": 2, "lr": 1e-3, "warmup": 1}


def test_the_lab_engine_computes_the_trainers_run(tmp_path, local_run, monkeypatch):
    warm = sw.ensure_model(seed=0, length=LENGTH, cache_dir=tmp_path / "warm", train_settings=TINY)
    args = SimpleNamespace(batch=1, n=4, bypass=True, fp32_trainer=True, lr=1e-2, steps=STEPS, bands=[], no_adjust=True)
    data = lt.write_dataset(tmp_path / "data", lt.WARM, seed=0, length=LENGTH) | {"model": warm}
    cell = Cell(LENGTH, f"stale{STALE}", 1)
    overrides = learn.overrides_for(args, lt.WARM, "maspo_fixed@segment_window=2", 0, data, cell)
    monkeypatch.setenv(WEIGHTS_DUMP_ENV, str(tmp_path / "syncs"))
    run = local_run(overrides)
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0 and sorted(run.steps) == list(range(1, STEPS + 1)), context
    # the server dumps each sync it applies: with 2 syncs stale, sync k + 3 applies the weights after step k
    dumped = {int(p.name.split("_")[0][4:]) - STALE - 1: torch.load(p) for p in (tmp_path / "syncs").glob("*.pt")}
    assert {0, 1, 2} <= set(dumped), sorted(dumped)

    config = le.compose(overrides)
    le.check(config)
    fn, cfg = le.loss_of(config)
    synced = []
    original = le.Rollout.sync

    def record(self, actor):
        synced.append({k: v.detach().clone() for k, v in actor.state_dict().items()})
        original(self, actor)

    monkeypatch.setattr(le.Rollout, "sync", record)
    steps = le.train(le.Settings.of(config, data["sentence"], lt.WARM), fn, cfg)

    for step in range(1, STEPS + 1):  # the same draws: steps 1-3 from the initial weights, then from step 1's on
        ours, theirs = steps[step], run.steps[step]
        assert ours["critic/score/mean"] == pytest.approx(theirs["critic/score/mean"], abs=1e-6), (step, context)
        for key in ("actor/ppo_kl", "actor/pg_clipfrac", "actor/ratio/segments_per_seq"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5, rel=1e-4), (step, key)
        assert ours["actor/grad_norm"] == pytest.approx(theirs["actor/grad_norm"], rel=1e-4), step
    for k, theirs in sorted(dumped.items()):  # the weights after step k, as the trainer synced them
        ours = synced[k]
        assert theirs.keys() <= ours.keys()
        moved = sum(float((theirs[n] - synced[0][n]).norm() ** 2) for n in theirs) ** 0.5
        off = sum(float((ours[n] - theirs[n]).norm() ** 2) for n in theirs) ** 0.5
        assert off <= 1e-4 * max(moved, 1e-12) + 1e-7, (k, off, moved)
    assert any(not torch.equal(dumped[1][n], dumped[0][n]) for n in dumped[0])  # the updates moved the weights
