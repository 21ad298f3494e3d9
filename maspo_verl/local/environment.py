"""The local mode's environment, for the driver (os.environ) and every Ray worker (runtime_env): the variables that
make verl run on the host (``LOCAL_ENV``), a run's own (``run_env``: threads, tracking files, caches), and the
precision for this CPU (``fit_dtype``)."""

from __future__ import annotations

import os

# Environment of the local mode, for the driver (os.environ) and every Ray worker (runtime_env).
LOCAL_ENV = {
    "MASPO_VERL_LOCAL": "cpu",  # makes `import verl` (plugin) call activate() in each worker
    "VERL_PLATFORM": "cpu",  # picks PlatformCPU in verl's platform registry
    "VERL_ENGINE_DEVICE": "cuda",  # verl registers its FSDP engine for cuda/npu only
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_DEDUP_LOGS": "0",
}

# what a run adds to LOCAL_ENV where the user has not set it (run_env), and its own temp folder
# (ray_cluster.configure)
RUN_ENV = (
    "TQ_NUM_THREADS", "OMP_NUM_THREADS", "VERL_FILE_LOGGER_PATH", "TENSORBOARD_DIR", "WANDB_DIR", "HF_DATASETS_CACHE",
    "TMPDIR",
)  # fmt: skip


def run_env(config) -> dict[str, str]:
    """Environment of a run, on top of ``LOCAL_ENV``, unless the user set it: TransferQueue's thread
    count within the physical cores (it warns in every process otherwise), the trainer workers' threads
    (``ray_cluster.threads_env``: Ray would give each one), the tracking backends' files in the run folder,
    the datasets cache in the local mode's cache (nothing new in HOME)."""
    import psutil

    from maspo_verl.local.ray_cluster import threads_env, trainer_workers
    from maspo_verl.local.run_log import tracking_env

    env = {**tracking_env(config), **threads_env(trainer_workers(config))}
    if not (os.environ.get("HF_DATASETS_CACHE") or os.environ.get("HF_HOME")):
        # verl's dataset caches the parquet it reads; in the local mode's cache, not ~/.cache/huggingface
        from maspo_verl.util import default_cache_dir

        cache = config.get("maspo", {}).get("local_cache_dir") or default_cache_dir()
        env["HF_DATASETS_CACHE"] = os.path.join(os.path.expanduser(str(cache)), "hf_datasets")
    if not os.environ.get("TQ_NUM_THREADS"):
        env["TQ_NUM_THREADS"] = str(min(8, psutil.cpu_count(logical=False) or os.cpu_count() or 1))
    return env


def set_environment(config, mismatch, engine: str, warm: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """Set the run's environment in the driver: ``LOCAL_ENV``, ``run_env``, the test instrument ``mismatch``, the
    rollout ``engine`` and the warm model's fingerprint ``warm``, less what a Ray job sets (it keeps its own). Returns
    (what every Ray worker gets, the mode's own before the job's)."""
    from maspo_verl.local import ray_cluster, speechwarm
    from maspo_verl.local.mismatch import MISMATCH_ENV
    from maspo_verl.local.vllm_cpu import ENGINE_ENV

    # the mismatch and fingerprint variables always set: a stale shell value never leaks in
    mode_env = {**LOCAL_ENV, **run_env(config), MISMATCH_ENV: mismatch.to_env(), ENGINE_ENV: engine}
    mode_env[speechwarm.FINGERPRINT_ENV] = warm or ""
    env = ray_cluster.local_env(mode_env, ray_cluster.job_env_vars())  # what a Ray job sets, it keeps
    os.environ.update(env)
    return env, mode_env


def fit_dtype(config) -> str | None:
    """The fastest precision for this CPU where the command line sets none (``cpu_dtype.fit``): its line, or None."""
    from maspo_verl.local import cpu_dtype

    return cpu_dtype.fit(config)


def threads_line(config, mode_env: dict[str, str]) -> str:
    """The start-up line of the trainer workers' threads (``ray_cluster.threads_line``)."""
    from maspo_verl.local.ray_cluster import THREADS_ENV, trainer_workers
    from maspo_verl.local.ray_cluster import threads_line as line

    return line(trainer_workers(config), os.environ[THREADS_ENV], THREADS_ENV not in mode_env)
