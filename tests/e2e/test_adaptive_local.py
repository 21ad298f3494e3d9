"""End-to-end: segment_rule=adaptive (``loss=maspo_adaptive``) in verl's real trainer on CPU, on the embedded
byte-level model: the loss logs the chosen lengths and their statistic each step, the inspect files hold the
segments the rule chooses from the written log-ratios, and ``python -m maspo_verl.lab segments`` recomputes them."""

from __future__ import annotations

import json

import pytest
import torch

from maspo_verl.util import read_step_metrics

pytestmark = pytest.mark.e2e

RESPONSE_LEN = 32


@pytest.mark.slow
def test_adaptive_trains_and_logs_its_chosen_lengths(local_run, tmp_path):
    """2 steps of 32-token responses with the shipped band criterion: each row's length a power of two up to 32
    (the row), chosen from its mean log-ratio; the VIF(M) it also logs is measured over M = 4 (8 windows of 4)."""
    from types import SimpleNamespace

    from maspo_verl.core.segments.rules.adaptive import band_of, plain_choice
    from maspo_verl.lab.__main__ import main
    from maspo_verl.lab.engine.presets import discover_presets

    preset = SimpleNamespace(**discover_presets(["maspo_adaptive"])[0].policy_loss)
    band = band_of(preset)
    assert band is not None, "maspo_adaptive ships the band criterion"

    pl = "actor_rollout_ref.actor.policy_loss"
    inspect = tmp_path / "inspect"
    run = local_run(
        [
            "loss=maspo_adaptive",
            "trainer.total_training_steps=2",
            f"data.max_response_length={RESPONSE_LEN}",
            "actor_rollout_ref.rollout.ignore_eos=true",
            f"{pl}.inspect_dir={inspect}",
            f"{pl}.inspect_every=1",
        ]
    )
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    written = read_step_metrics(run.run_dir / "metrics.jsonl")
    for step, metrics in run.steps.items():
        assert 1.0 <= metrics["actor/ratio/adaptive_len"] <= RESPONSE_LEN, context
        assert metrics["actor/ratio/adaptive_bias"] > 0, context
        assert metrics["actor/ratio/adaptive_measured_frac"] > 0, context  # the later mini-batch moved the ratios
        assert 0.0 < metrics["actor/ratio/adaptive_window"] <= 4.0, context
        assert written[step]["actor/ratio/adaptive_len"] == pytest.approx(metrics["actor/ratio/adaptive_len"])
    # the inspected rows: segments every n tokens, n chosen from the written log-ratios (float32, as the loss)
    files = sorted(inspect.iterdir())
    assert files, context
    for path in files:
        doc = json.loads(path.read_text())
        for resp in doc["responses"]:
            n_valid = sum(resp["mask"])
            new = torch.tensor(resp["log_probs"][:n_valid], dtype=torch.float32)
            old = torch.tensor(resp["old_log_probs"][:n_valid], dtype=torch.float32)
            n, _, _ = plain_choice((new - old).double().tolist(), 1, preset.adaptive_max_len, band)
            ids = resp["segment_ids"][:n_valid]
            assert ids == [t // n for t in range(n_valid)], (path.name, n, ids)
    main(["segments", "--from", str(inspect), "--out", str(tmp_path / "report")])
    report = (tmp_path / "report" / "README.md").read_text()
    rows = sum(len(json.loads(p.read_text())["responses"]) for p in files)
    assert f"equal the ones the loss wrote: {rows} / {rows} responses" in report
    assert "adaptive" in report
