"""The warm speech model's fingerprint (``speechwarm.fingerprint``): the same weights give the same one, other
weights (another seed, one changed value) another; a ``task=speechwarm`` run says it at start-up and hands it to
its workers, whose every update records it in the step's metrics."""

from __future__ import annotations

import os

import pytest

from maspo_verl.local import environment, speechwarm, tasks
from maspo_verl.local import mode as local_mode
from tests.helpers import compose_config

TINY = {"steps": 3, "batch": 2, "lr": 1e-3, "warmup": 1}


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    return {
        "a": speechwarm.ensure_model(seed=0, length=8, cache_dir=root / "a", train_settings=TINY),
        "b": speechwarm.ensure_model(seed=0, length=8, cache_dir=root / "b", train_settings=TINY),
        "c": speechwarm.ensure_model(seed=1, length=8, cache_dir=root / "c", train_settings=TINY),
    }


def test_the_same_build_has_the_same_fingerprint_and_other_weights_another(warm, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    a = speechwarm.fingerprint(warm["a"])
    assert len(a) == speechwarm.FINGERPRINT_HEX and int(a, 16) >= 0
    assert speechwarm.fingerprint(warm["b"]) == a  # built twice, in two folders
    assert speechwarm.fingerprint(warm["c"]) != a  # another seed
    changed = tmp_path / "changed"
    shutil.copytree(warm["a"], changed)
    weights = load_file(changed / "model.safetensors")
    name = sorted(weights)[0]
    flat = weights[name].view(-1)
    flat[0] = torch.nextafter(flat[0], flat[0] + 1)  # one value, one ulp
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})
    assert speechwarm.fingerprint(changed) != a
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        speechwarm.fingerprint(tmp_path)


def test_the_metric_holds_the_fingerprint_exactly(monkeypatch):
    monkeypatch.setenv(speechwarm.FINGERPRINT_ENV, "ffffffffffff")
    (value,) = speechwarm.fingerprint_metrics().values()
    assert speechwarm.fingerprint_of_metric(value) == "ffffffffffff"
    assert speechwarm.fingerprint_of_metric((value + value) / 2) == "ffffffffffff"  # the mean over two ranks
    monkeypatch.setenv(speechwarm.FINGERPRINT_ENV, "")
    assert speechwarm.fingerprint_metrics() == {}


@pytest.mark.parametrize("task", ["speechwarm", None])
def test_a_speechwarm_run_says_its_fingerprint_and_hands_it_to_its_workers(warm, task, tmp_path, monkeypatch, capsys):
    from verl.plugin.platform import platform_manager

    for key in (*environment.LOCAL_ENV, speechwarm.FINGERPRINT_ENV):
        monkeypatch.setenv(key, os.environ.get(key, ""))
    for key in environment.RUN_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(platform_manager, "_current_platform", platform_manager._current_platform)
    given = ["local=cpu", "maspo.dry_run=true", f"maspo.local_cache_dir={tmp_path}"]
    given += [f"task={task}", "data.max_response_length=8", f"actor_rollout_ref.model.path={warm['a']}"] if task else []
    config = compose_config(*given)
    tasks.prepare_task(config)
    local_mode.prepare_run(config)
    env = config.ray_kwargs.ray_init.runtime_env.env_vars
    said = [line for line in capsys.readouterr().out.splitlines() if "the warm model's fingerprint" in line]
    if task:
        fp = speechwarm.fingerprint(warm["a"])
        assert env[speechwarm.FINGERPRINT_ENV] == fp == os.environ[speechwarm.FINGERPRINT_ENV]
        assert said == [
            f"maspo_verl local: the warm model's fingerprint {fp} (its weights; every step's "
            f"{speechwarm.FINGERPRINT_METRIC} in metrics.jsonl)"
        ]
    else:  # set empty: a value of an earlier run in the shell never reaches this one's workers
        assert env[speechwarm.FINGERPRINT_ENV] == "" and not said
