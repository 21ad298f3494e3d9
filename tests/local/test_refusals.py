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
from tests.warm_cli import run_main

REPO = Path(__file__).resolve().parents[2]
POLICY_LOSS = "actor_rollout_ref.actor.policy_loss"


def _main(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return run_main(overrides, cwd, env)


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
    # the batch check runs before the local mode starts Ray (no start line, no Ray temp dir)
    assert "ray_temp_dir=" not in out.stdout + out.stderr and "Started a local Ray" not in out.stdout + out.stderr


def test_a_dry_run_writes_nothing(tmp_path):
    out = _main(tmp_path, "local=cpu", "maspo.dry_run=true")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "config valid; loss section:" in out.stdout
    assert "maspo_verl local: this machine: " in out.stdout and "logical GPU" in out.stdout
    assert list(tmp_path.iterdir()) == []


# ---- the preflight: what the config names on this machine, refused before Ray starts -------------------------------


def _preflight_case(root: Path, case: str) -> tuple[list[str], str, str]:
    """(overrides, the field the first line names, what it says to do) of one preflight refusal; every other
    path of the config exists and has the expected shape."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    model = root / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = root / "train.parquet"
    pq.write_table(pa.table({"prompt": ["x"], "question": ["y"]}), data)
    reward = root / "reward.py"
    reward.write_text("def compute_score(*args, **kwargs):\n    return 0.0\n")
    paths = {
        "actor_rollout_ref.model.path": str(model),
        "data.train_files": str(data),
        "data.val_files": str(data),
        "reward.custom_reward_function.path": str(reward),
        "reward.custom_reward_function.name": "compute_score",
    }
    local = ["local=cpu"]
    if case == "model":
        paths["actor_rollout_ref.model.path"], fix = str(root / "no_model"), "no such folder: set it to a local model"
    elif case == "data":
        paths["data.train_files"], fix = str(root / "no.parquet"), "no such file: set it to a data file"
    elif case == "prompt_key":
        paths["data.prompt_key"], fix = "messages", "has no column data.prompt_key='messages'"
    elif case == "reward":
        paths["reward.custom_reward_function.name"], fix = "score", "defines no function 'score'"
    else:  # the GPU command (no local=cpu) asking for more GPUs than any node here has (64: batch sizes it divides)
        local, fix = ["loss=grpo", "trainer.n_gpus_per_node=64"], "add local=cpu"
    field = {"model": "actor_rollout_ref.model.path", "data": "data.train_files", "prompt_key": "data.train_files",
             "reward": "reward.custom_reward_function.name", "gpus": "trainer.n_gpus_per_node"}[case]  # fmt: skip
    return [*local, *(f"{k}={v}" for k, v in paths.items())], field, fix


@pytest.mark.parametrize("case", ["model", "data", "prompt_key", "reward", "gpus"])
def test_the_preflight_refuses_before_ray_and_the_dry_run_the_same(tmp_path, case):
    """Every problem refused the same by a run and a dry run, but the GPUs: a dry run checks the config, not
    the node it runs on (a login node has none), so there it is one note."""
    overrides, field, fix = _preflight_case(tmp_path, case)
    ray_dir = tmp_path / "ray"  # where Ray would start its cluster (no `ray start` cluster to join there)
    cwd = tmp_path / "run"
    cwd.mkdir()
    for extra in ([], ["maspo.dry_run=true"]):
        out = _main(cwd, *overrides, f"+ray_kwargs.ray_init._temp_dir={ray_dir}", *extra)
        if case == "gpus" and extra:
            assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
            notes = [line for line in out.stdout.splitlines() if "n_gpus_per_node" in line]
            assert notes == [
                "maspo_verl preflight: trainer.n_gpus_per_node=64: this machine has no CUDA GPUs; not "
                "checked in a dry run (the run needs them on its node, or a Ray cluster to join)"
            ], notes
            assert "config valid; loss section:" in out.stdout
            assert list(cwd.iterdir()) == [] and not ray_dir.exists()
            continue
        assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
        first = out.stderr.strip().splitlines()[0]
        assert first.startswith(f"maspo_verl: {field}=") and fix in first, (extra, out.stderr[-3000:])
        assert "Traceback" not in out.stderr and "config valid" not in out.stdout
        assert list(cwd.iterdir()) == [] and not ray_dir.exists()  # no run folder, no Ray


def test_the_readme_gpu_command_dry_run_on_a_laptop(tmp_path):
    """The README's GPU quickstart command with maspo.dry_run=true, on a machine without GPUs whose Hub answers
    (a listening port stands in for it): before the data is prepared it is refused at the first missing
    path (the GPUs not among the problems), after it passes with one note on the GPUs; no folder left."""
    import re
    import socket

    import pyarrow as pa
    import pyarrow.parquet as pq

    readme = (REPO / "README.md").read_text()
    block = readme.split("## Quickstart on GPU nodes", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    (command,) = [line for line in re.sub(r"\\\n\s*", " ", block).splitlines() if "maspo_verl.main " in line]
    args = command.split("#")[0].split()
    home = tmp_path / "home"
    home.mkdir()
    given = [a.replace("$HOME", str(home)) for a in args[args.index("maspo_verl.main") + 1 :]]
    hub = socket.create_server(("127.0.0.1", 0))
    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper() and k != "HF_HUB_OFFLINE"}
    env.update(HOME=str(home), HF_ENDPOINT=f"http://127.0.0.1:{hub.getsockname()[1]}")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])

    def dry_run():
        return subprocess.run([sys.executable, "-m", "maspo_verl.main", *given, "maspo.dry_run=true"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)  # fmt: skip

    with hub:
        out = dry_run()
        assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
        lines = out.stderr.strip().splitlines()
        fix = "no such file: set it to a data file (.parquet, e.g. python -m maspo_verl.math.prepare)"
        data = home / "data" / "maspo_math"
        assert lines[0] == f"maspo_verl: data.train_files={data}/math_train.parquet: {fix}", lines
        assert lines[1:3] == ["1 more:", f"- data.val_files={data}/math500_test.parquet: {fix}"], lines
        assert "n_gpus_per_node" not in out.stderr and "Traceback" not in out.stderr
        for name in ("math_train", "math500_test"):  # what math.prepare writes (its columns)
            (home / "data" / "maspo_math").mkdir(parents=True, exist_ok=True)
            pq.write_table(
                pa.table({"prompt": ["x"], "data_source": ["math"]}), home / "data" / "maspo_math" / f"{name}.parquet"
            )
        out = dry_run()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "maspo_verl preflight: trainer.n_gpus_per_node=8: this machine has no CUDA GPUs; not checked" in out.stdout
    assert "config valid; loss section:" in out.stdout and "loss_mode: maspo" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]


def test_a_misspelt_verl_key_names_the_closest_keys(tmp_path):
    for extra in ([], ["maspo.dry_run=true"]):
        out = _main(tmp_path, "local=cpu", "trainer.total_trainig_steps=3", *extra)
        assert out.returncode == 2, out.stderr[-3000:]
        lines = out.stderr.strip().splitlines()
        assert lines[0] == (
            "maspo_verl: trainer has unknown keys ['total_trainig_steps']: did you mean `total_training_steps`?"
        ), out.stderr[-3000:]
        assert "To append to your config use" not in out.stderr and "Traceback" not in out.stderr
        assert lines[-1] == "(a key verl's config does not have is added with +trainer.total_trainig_steps=3)"
        assert list(tmp_path.iterdir()) == []


def test_a_misspelt_config_group_option_names_the_closest_options(tmp_path):
    out = _main(tmp_path, "local=cpu", "loss=maspo_fixd")
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert lines[0] == (
        "maspo_verl: config group 'loss' has unknown loss options ['maspo_fixd']: did you mean `maspo_fixed`?"
    ), out.stderr[-3000:]
    assert "maspo_turns" in out.stderr and "Traceback" not in out.stderr  # the allowed options follow
    assert list(tmp_path.iterdir()) == []
