"""Settings refused at start-up: the message names the cause (in the closing block too, not Hydra's
wrapper), a misspelt ``policy_loss`` field gets the closest names, the allowed list is wrapped, no
traceback for a refused setting, and no run folder is left by a refused run or a dry run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from maspo_verl.validation import FieldError, close_names, reject_unknown, root_cause

REPO = Path(__file__).resolve().parents[2]
POLICY_LOSS = "actor_rollout_ref.actor.policy_loss"


def _main(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "maspo_verl.main", *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_close_names_and_a_wrapped_allowed_list():
    assert close_names("segment_windw", ["segment_window", "max_segment_len", "min_segment_len"]) == ["segment_window"]
    assert close_names("zzz", ["segment_window"]) == []
    from maspo_verl.main import policy_loss_fields

    allowed = policy_loss_fields()
    assert len(", ".join(allowed)) > 300
    with pytest.raises(ValueError) as caught:
        reject_unknown("policy_loss", ["clip_exponnt", "zzz"], allowed, kind="fields")
    text = str(caught.value)
    assert text.splitlines()[0] == (
        "policy_loss has unknown fields ['clip_exponnt', 'zzz']: clip_exponnt: did you mean `clip_exponent`?"
    )
    assert all(len(line) <= 100 for line in text.splitlines()[1:])
    assert [n.strip() for n in " ".join(text.splitlines()[2:]).split(",")] == allowed


def test_the_closing_block_names_the_field_not_hydras_wrapper(tmp_path, monkeypatch):
    """Hydra wraps the loss config's error in an InstantiationException whose last line is
    ``full_key: ...``; the block shows the field error instead."""
    from hydra.utils import instantiate

    from maspo_verl.local.run_log import closing_block

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    with pytest.raises(Exception) as caught:
        instantiate(OmegaConf.create({"_target_": "maspo_verl.config.GranularLossConfig", "segment_window": 0}))
    assert type(caught.value).__name__ == "InstantiationException"
    assert isinstance(root_cause(caught.value), FieldError)
    config = OmegaConf.create({"trainer": {"logger": ["file"], "total_training_steps": 2, "save_freq": -1}})
    block = closing_block(config, tmp_path, tmp_path / "run.log", 0, 1, error=caught.value).splitlines()
    assert block[1] == "error        FieldError: policy_loss.segment_window=0 is invalid: allowed an integer >= 1"


def test_a_misspelt_field_names_the_closest_and_leaves_nothing(tmp_path):
    out = _main(tmp_path, "local=cpu", f"{POLICY_LOSS}.segment_windw=5")
    assert out.returncode == 2, out.stderr[-3000:]
    assert "segment_windw']: did you mean `segment_window`?" in out.stderr, out.stderr[-3000:]
    assert "To append to your config use +" not in out.stderr
    assert max(len(line) for line in out.stderr.splitlines()) <= 120
    assert list(tmp_path.iterdir()) == []
    added = _main(tmp_path, "local=cpu", f"+{POLICY_LOSS}.segment_windw=5", "maspo.dry_run=true")
    assert added.returncode == 1 and "did you mean `segment_window`?" in added.stderr, added.stderr[-3000:]
    assert "Traceback" not in added.stderr and list(tmp_path.iterdir()) == []


def test_a_bad_loss_setting_is_refused_before_the_run_begins(tmp_path):
    out = _main(tmp_path, "local=cpu", f"{POLICY_LOSS}.segment_window=0")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "maspo_verl: policy_loss.segment_window=0 is invalid: allowed an integer >= 1"
    ), out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "local run FAILED" not in out.stdout + out.stderr
    assert list(tmp_path.iterdir()) == []  # no run folder, no Ray


def test_a_refused_batch_size_prints_the_message_alone_and_leaves_no_run_folder(tmp_path):
    out = _main(tmp_path, "local=cpu", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    assert out.returncode == 1
    assert "ppo_micro_batch_size_per_gpu=3 does not divide the 8 samples" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "HYDRA_FULL_ERROR" not in out.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/<date>/<time> with an empty main.log


def test_a_dry_run_writes_nothing(tmp_path):
    out = _main(tmp_path, "local=cpu", "maspo.dry_run=true")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "config valid; loss section:" in out.stdout
    assert list(tmp_path.iterdir()) == []
