"""The drift-correlation study (``lab.studies.drift``): its data have the structure they claim, the measurement
reads the correlation of the update's log-ratios, and the command writes its tables."""

import argparse
import csv
import math
from dataclasses import replace

import torch

from maspo_verl.lab.__main__ import main
from maspo_verl.lab.studies import drift


def _runs_of(row: torch.Tensor) -> list[int]:
    change = torch.nonzero(row[1:] != row[:-1]).flatten().tolist()
    edges = [0, *(c + 1 for c in change), len(row)]
    return [b - a for a, b in zip(edges, edges[1:], strict=False)]


def test_the_data_have_their_structure():
    runs = drift.batch("runs", 8, 96, seed=0)
    assert runs.shape == (8, 96) and bool((runs % drift.UNIT_ID == 0).all())
    for row in runs:
        assert all(3 <= n <= 15 for n in _runs_of(row)[:-1])  # units of 3-15 frames (the last cut at the end)
    jitter = drift.batch("jitter", 8, 96, seed=0)
    moved = jitter != runs
    assert 0.15 < float(moved.float().mean()) < 0.45  # about 0.3 of the frames
    # a moved frame differs in exactly one base-4 digit, by one step
    for a, b in zip(runs[moved].tolist(), jitter[moved].tolist(), strict=True):
        steps = [abs((a >> 2 * k & 3) - (b >> 2 * k & 3)) for k in range(4)]
        assert sorted(steps) == [0, 0, 0, 1]
    iid = drift.batch("iid", 64, 96, seed=0)
    assert len(set(iid.flatten().tolist())) > 200
    assert torch.equal(drift.batch("runs", 8, 96, seed=0), runs)  # deterministic


def test_the_measurement_reads_the_updates_log_ratios(monkeypatch):
    """An update gives finite correlation sums of its log-ratios; an update that changes nothing (lr 0) gives no
    spread and no metric (all log-ratios 0), not a VIF of 0 or 1."""
    args = argparse.Namespace(seed=0, device="cpu", tokens=48, batch=8, repeats=2)
    c = replace(drift.BASE, warm_steps=0)
    model = drift.model_of("tiny", "cpu")
    sums, sd = drift.measure(model, c, args, 0)
    assert sd > 0 and math.isfinite(float(sums["corr_tokens"][1]))
    # zero lr: the update changes nothing, so there is no log-ratio spread to measure
    row = drift.run_condition(replace(c, lr=0.0, name="still"), args, {})
    assert row["delta_sd"] == 0.0 and math.isnan(row["vif15"])


def test_the_command_writes_its_table(tmp_path):
    main(["drift", "--out", str(tmp_path), "--conditions", "random_init", "data_iid", "--repeats", "1",
          "--batch", "4", "--tokens", "24"])  # fmt: skip
    for name in ("README.md", "COMMAND.txt", "drift.csv", "drift_vif.png"):
        assert (tmp_path / name).is_file(), name
    with open(tmp_path / "drift.csv") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"random_init", "data_iid"}
    assert rows["random_init"]["warm_steps"] == "0" and rows["data_iid"]["data"] == "iid"
    assert "independent log-ratios in 24-token rows" in (tmp_path / "README.md").read_text()
