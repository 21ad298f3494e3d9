"""The local mode's Ray set-up (maspo_verl.local.ray_cluster): join a given cluster or start a private
one, and a worker environment Ray can merge with a job's runtime env.

The merge is checked with Ray's own ``_merge_runtime_env`` (what ``ray.init`` runs inside a job) on
the runtime env verl's ``run_ppo`` would pass, built with verl's own ``get_ppo_ray_runtime_env``;
the job's runtime env is the one recipes/cluster/ray_submit.sh submits (its dry run)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from omegaconf import OmegaConf
from ray.runtime_env.runtime_env import _merge_runtime_env
from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

from maspo_verl.local import environment, ray_cluster
from maspo_verl.local import mode as local_mode
from tests.helpers import compose_config, run_script

USER_PATHS = [
    "actor_rollout_ref.model.path=/models/tiny",
    "data.train_files=/data/train.parquet",
    "data.val_files=/data/val.parquet",
    "reward.custom_reward_function.path=/data/reward.py",
]


def _compose(overrides):
    return compose_config(*overrides)


@pytest.fixture
def env(monkeypatch):
    """A clean process environment for prepare() (restored afterwards)."""
    from verl.plugin.platform import platform_manager

    for key in (*environment.LOCAL_ENV, *environment.RUN_ENV, "RAY_ADDRESS", ray_cluster.JOB_CONFIG_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(platform_manager, "_current_platform", platform_manager._current_platform)
    return monkeypatch


def _prepare(overrides, tmp_path):
    config = _compose(["local=cpu", *USER_PATHS, *overrides])
    local_mode.prepare_run(config)
    return config.ray_kwargs.ray_init


def test_private_cluster_without_an_address(env, tmp_path):
    ray_init = _prepare([], tmp_path)
    try:
        assert ray_init.address == "local"
        assert os.path.isdir(ray_init._temp_dir) and os.path.basename(ray_init._temp_dir).startswith("maspo_ray_")
        assert (ray_init.num_cpus, ray_init.num_gpus) == (16, 1)
    finally:
        shutil.rmtree(ray_init._temp_dir)  # the private token is written there


def test_trainer_workers_share_the_runs_cores_unless_the_user_set_their_threads(env, tmp_path, capsys):
    """Each trainer worker gets max(1, cores // workers) threads (``OMP_NUM_THREADS``, Ray's default 1), in the
    driver and every worker, said in the start-up lines; a value the user set is theirs (the workers inherit it)."""
    rule = ray_cluster.worker_threads
    assert [rule(2, 1), rule(2, 2), rule(2, 3), rule(16, 3), rule(1, 1), rule(8, 0)] == [2, 1, 1, 5, 1, 8]
    ray_init = _prepare(["trainer.n_gpus_per_node=2"], tmp_path)
    shutil.rmtree(ray_init._temp_dir)
    expected = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert ray_init.runtime_env.env_vars.OMP_NUM_THREADS == expected == os.environ["OMP_NUM_THREADS"]
    assert f"trainer workers: 2, each with OMP_NUM_THREADS={expected} (the run's " in capsys.readouterr().out
    env.setenv("OMP_NUM_THREADS", "3")
    ray_init = _prepare([], tmp_path)
    shutil.rmtree(ray_init._temp_dir)
    assert "OMP_NUM_THREADS" not in ray_init.runtime_env.env_vars and os.environ["OMP_NUM_THREADS"] == "3"
    assert "trainer workers: 1, each with OMP_NUM_THREADS=3 (yours)" in capsys.readouterr().out


@pytest.mark.parametrize("via", ["RAY_ADDRESS", "override"])
def test_joins_a_given_cluster(env, tmp_path, via):
    """Inside `ray job submit` Ray sets RAY_ADDRESS: join it, with nothing ray.init refuses when connecting
    (num_cpus/num_gpus) and no private temp dir (it would name no node of that cluster)."""
    overrides = []
    if via == "RAY_ADDRESS":
        env.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    else:
        overrides = ["ray_kwargs.ray_init.address=10.1.2.3:6379"]
    ray_init = _prepare(overrides, tmp_path)
    assert ray_init.address == "10.1.2.3:6379"
    assert "_temp_dir" not in ray_init
    for key in ("num_cpus", "num_gpus", "include_dashboard"):
        assert key not in ray_init, key
    assert ray_init.runtime_env.env_vars.MASPO_VERL_LOCAL == "cpu"


def test_address_local_keeps_a_private_cluster(env, tmp_path):
    env.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    ray_init = _prepare(["ray_kwargs.ray_init.address=local", "maspo.dry_run=true"], tmp_path)
    assert ray_init.address == "local" and ray_init.num_gpus == 1


def test_dashboard_address_is_refused_by_name(env, tmp_path):
    env.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    with pytest.raises(ValueError, match="RAY_ADDRESS='http://127.0.0.1:8265' is a dashboard"):
        _prepare([], tmp_path)


def _job_runtime_env(**script_env) -> dict:
    out = run_script("recipes/cluster/ray_submit.sh", DRY_RUN="1", PIP_SPEC="", **script_env)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("runtime_env: "))
    return json.loads(line[len("runtime_env: ") :])


def _enter_job(env, runtime_env: dict) -> None:
    """What Ray's job supervisor gives the entrypoint: the job's variables, its config, RAY_ADDRESS."""
    for key, value in runtime_env.get("env_vars", {}).items():
        env.setenv(key, value)
    env.setenv(ray_cluster.JOB_CONFIG_ENV, json.dumps({"runtime_env": runtime_env, "metadata": {}}))
    env.setenv("RAY_ADDRESS", "127.0.0.1:6379")


def _driver_runtime_env(config) -> dict:
    """The runtime_env verl's run_ppo passes to ray.init (its own defaults merged with ray_init's)."""
    ray_init = config.ray_kwargs.ray_init
    merged = OmegaConf.merge(get_ppo_ray_runtime_env(config), ray_init.get("runtime_env", {}))
    return OmegaConf.to_container(merged)


@pytest.mark.parametrize("job_sets", [{}, {"TOKENIZERS_PARALLELISM": "true", "RAY_DEDUP_LOGS": "1"}])
def test_local_mode_merges_with_the_jobs_runtime_env(env, tmp_path, job_sets):
    """ray.init inside a job refuses a runtime env naming any variable the job's runtime env sets; the
    local mode adds only the others, and where the job sets one, the job's value holds everywhere."""
    job = _job_runtime_env(WANDB_MODE="offline")
    job["env_vars"].update(job_sets)
    _enter_job(env, job)
    config = _compose(["local=cpu", *USER_PATHS])
    local_mode.prepare_run(config)
    driver = _driver_runtime_env(config)
    merged = _merge_runtime_env(job, driver)
    assert merged is not None, f"Ray refuses: job {job['env_vars']} vs driver {driver.get('env_vars')}"
    workers = merged["env_vars"]
    for key, value in environment.LOCAL_ENV.items():
        expected = job_sets.get(key, value)
        assert workers[key] == expected and os.environ[key] == expected, key
    assert workers["WANDB_MODE"] == "offline"


def test_job_setting_a_required_variable_differently_is_refused(env, tmp_path):
    job = _job_runtime_env()
    job["env_vars"]["VERL_PLATFORM"] = "cuda"
    _enter_job(env, job)
    with pytest.raises(ValueError, match="VERL_PLATFORM='cuda'.*needs VERL_PLATFORM='cpu'"):
        _prepare([], tmp_path)


def test_a_private_clusters_token_lives_in_its_temp_dir_not_in_home(tmp_path):
    from maspo_verl.local.ray_cluster import private_token_env

    home, temp = tmp_path / "home", tmp_path / "ray"
    home.mkdir()
    temp.mkdir()
    env = private_token_env(str(temp), environ={}, home=home)
    token = temp / "auth_token"
    assert env == {"RAY_AUTH_TOKEN_PATH": str(token)} and len(token.read_text()) == 64
    assert token.stat().st_mode & 0o077 == 0 and list(home.iterdir()) == []
    assert private_token_env(str(temp), environ=env, home=home) == {}  # set up: Ray's own behaviour
    assert private_token_env(str(temp), environ={"RAY_AUTH_MODE": "disabled"}, home=home) == {}
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("x")
    assert private_token_env(str(temp), environ={}, home=home) == {}


def test_the_machine_line_says_the_machine_and_the_clusters_logical_resources_apart():
    """run.log holds verl's ``ray init kwargs`` (16 logical CPUs, 1 logical GPU): our line says what the
    machine has beside it."""
    from maspo_verl.local.ray_cluster import machine_line

    private = {"address": "local", "num_cpus": 16, "num_gpus": 1}
    assert machine_line(private, cpus=2, gpus=0) == (
        "this machine: 2 CPU cores, no GPU; the private Ray cluster counts 16 logical CPUs and 1 logical GPU "
        "(for verl's resource checks; no GPU is used)"
    )
    assert machine_line({"address": "10.0.0.1:6379"}, cpus=8, gpus=1) == (
        "this machine: 8 CPU cores, 1 CUDA GPU (unused: the local mode runs on CPU)"
    )
    import os

    here = machine_line(private)  # the real count: the cores this process may use
    assert here.startswith(f"this machine: {len(os.sched_getaffinity(0))} CPU core")
