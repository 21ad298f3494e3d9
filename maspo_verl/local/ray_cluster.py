"""Which Ray cluster the local mode uses, and the environment its workers get.

- A cluster address given (``ray_kwargs.ray_init.address``, else ``RAY_ADDRESS``, which Ray sets
  for the entrypoint of every ``ray job submit`` job): join that cluster. Its workers can fetch the
  job's ``working_dir``, and ``ray.init`` gets no ``num_cpus``/``num_gpus``/``_temp_dir`` (Ray
  refuses the first two when connecting; a fresh temp dir names no node of that cluster).
- No address, or ``address=local``: a private cluster in its own temp dir. Ray >= 2.52 turns token
  authentication on for a new ``ray.init`` cluster and, without a token, writes one to
  ``~/.ray/auth_token``, after which every ``ray start`` from that HOME turns it on too; a private
  cluster's token is a file in its temp dir instead (``private_token_env``), unless the user set up
  authentication (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or a token in HOME).

Environment: inside a job, the job's runtime env already sets its ``env_vars`` for the driver and
every worker, and Ray refuses a ``ray.init(runtime_env=...)`` naming any of the same variables. The
local mode therefore adds only the variables the job does not set. The job may set the ones the
mode depends on (``REQUIRED``) only to the same value; for the others (tokenizer threads, log
de-duplication) the job's value wins, in the driver and in the workers alike.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from pathlib import Path

from maspo_verl.local.mismatch import MISMATCH_ENV

# Ray sets this for a job's entrypoint: {"runtime_env": {...}, "metadata": {...}}.
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
# Local-mode variables the job's runtime env may not set to another value.
REQUIRED = ("MASPO_VERL_LOCAL", "VERL_PLATFORM", "VERL_ENGINE_DEVICE", MISMATCH_ENV)
# ray.init arguments of a private cluster only (Ray refuses num_cpus/num_gpus when connecting).
PRIVATE_ONLY = ("num_cpus", "num_gpus", "include_dashboard")


def _unset(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip() in ("", "null", "None"))


def cluster_address(ray_init) -> str | None:
    """The address of the Ray cluster to join, or None for a private local cluster."""
    address = ray_init.get("address")
    source = "ray_kwargs.ray_init.address"
    if _unset(address):
        address, source = os.environ.get("RAY_ADDRESS", ""), "RAY_ADDRESS"
    address = str(address or "").strip()
    if address in ("", "local"):
        return None
    if address.startswith(("http://", "https://")):
        raise ValueError(
            f"{source}={address!r} is a dashboard (job submission) address; ray.init needs the cluster "
            "address (HOST:6379, or 'auto' on a node of the cluster). Submit with `ray job submit` "
            "(Ray then sets RAY_ADDRESS for the job), or unset RAY_ADDRESS for a private local cluster."
        )
    return address


def job_env_vars() -> dict[str, str]:
    """The env_vars of the runtime env of the Ray job this process is the entrypoint of ({} outside a job)."""
    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return {}
    runtime_env = json.loads(raw).get("runtime_env") or {}
    return {str(k): str(v) for k, v in (runtime_env.get("env_vars") or {}).items()}


def local_env(mode_env: dict[str, str], job_env: dict[str, str]) -> dict[str, str]:
    """The variables of ``mode_env`` the local mode sets itself: those the job's runtime env does not.

    Raises ValueError if the job sets one of ``REQUIRED`` to another value.
    """
    for key in REQUIRED:
        if key in job_env and key in mode_env and job_env[key] != mode_env[key]:
            raise ValueError(
                f"the Ray job's runtime env sets {key}={job_env[key]!r}, the local mode needs "
                f"{key}={mode_env[key]!r}: drop it from the job's env_vars"
            )
    return {key: value for key, value in mode_env.items() if key not in job_env}


def configure_ray_init(ray_init, worker_env: dict[str, str], new_temp_dir) -> str | None:
    """Set up ``ray_init`` (a mutable DictConfig, or dict) to join a given cluster or start a private one.

    ``worker_env``: variables added to ``runtime_env.env_vars`` (entries already there win).
    ``new_temp_dir``: called for a private cluster's temp dir when none is set; None: leave it unset.
    Returns the joined address, or None for a private cluster.
    """
    address = cluster_address(ray_init)
    if address is None:
        ray_init["address"] = "local"
        if new_temp_dir is not None and _unset(ray_init.get("_temp_dir")):
            ray_init["_temp_dir"] = new_temp_dir()
    else:
        ray_init["address"] = address
        for key in PRIVATE_ONLY:
            if key in ray_init:
                ray_init.pop(key)
    if ray_init.get("runtime_env") is None:
        ray_init["runtime_env"] = {}
    env_vars = dict(ray_init["runtime_env"].get("env_vars") or {})
    ray_init["runtime_env"]["env_vars"] = {**worker_env, **env_vars}
    return address


# what the user sets up Ray's token authentication with; any of them set: Ray's own behaviour
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def private_token_env(temp_dir: str, environ=None, home: Path | None = None) -> dict[str, str]:
    """``{"RAY_AUTH_TOKEN_PATH": <temp_dir>/auth_token}`` with a new token written there (owner-only), so a
    private cluster keeps token authentication and writes nothing into HOME; {} where the user set it up."""
    environ = os.environ if environ is None else environ
    home = Path.home() if home is None else home
    if any(environ.get(key) for key in AUTH_ENV) or (home / ".ray" / "auth_token").exists():
        return {}
    path = Path(temp_dir) / "auth_token"
    path.touch(mode=0o600)
    path.write_text(secrets.token_hex(32))
    return {"RAY_AUTH_TOKEN_PATH": str(path)}


def run_cpus() -> int:
    """The CPU cores this process, and so the run, may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# Ray sets OMP_NUM_THREADS in each actor it starts to the actor's CPUs, 1 where the actor asks none (verl's
# workers), unless it is set (``ray._private.utils.set_omp_num_threads_if_unset``): the trainer's update then runs
# on one core. A value in the workers' environment from the start (``runtime_env.env_vars``) is kept.
THREADS_ENV = "OMP_NUM_THREADS"


def worker_threads(cpus: int, workers: int) -> int:
    """The threads of each of ``workers`` trainer worker processes sharing ``cpus`` cores (their updates run at
    the same time; the rollout's engines run between them): max(1, cpus // workers)."""
    return max(1, int(cpus) // max(1, int(workers)))


def threads_env(workers: int, environ=None, cpus: int | None = None) -> dict[str, str]:
    """``{OMP_NUM_THREADS: ...}`` for the run's workers (``worker_threads`` of the run's cores); {} where the user
    set it (theirs then reaches the workers: Ray keeps a value that is set)."""
    environ = os.environ if environ is None else environ
    if environ.get(THREADS_ENV):
        return {}
    return {THREADS_ENV: str(worker_threads(run_cpus() if cpus is None else cpus, workers))}


THREADS_METRIC = "torch_threads"  # of the actor update's worker, as verl logs it: actor/torch_threads


def thread_metrics() -> dict[str, float]:
    """The intra-op threads torch runs the actor update on, in the worker that runs it."""
    import torch

    return {THREADS_METRIC: float(torch.get_num_threads())}


def threads_line(workers: int, value: str, chosen: bool) -> str:
    """What the start-up lines say of the trainer workers' threads (``chosen``: the user's value)."""
    why = "yours" if chosen else f"the run's {run_cpus()} CPU cores / {workers}; Ray's default is 1"
    return f"trainer workers: {workers}, each with {THREADS_ENV}={value} ({why})"


def machine_line(ray_init, cpus: int | None = None, gpus: int | None = None) -> str:
    """What this machine has, and what a private cluster's Ray is told it has (logical resources that verl's
    resource-pool checks count: one "GPU" per trainer worker, CPUs for its actors): so that the run's log,
    which holds verl's ``ray init kwargs``, is not read as the machine's. ``cpus``/``gpus``: this machine's
    (default: the CPU cores this process may use, torch's CUDA device count)."""
    if cpus is None:
        cpus = run_cpus()
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    machine = f"this machine: {cpus} CPU core{'s' * (cpus != 1)}, " + (
        f"{gpus} CUDA GPU{'s' * (gpus != 1)} (unused: the local mode runs on CPU)" if gpus else "no GPU"
    )
    if _unset(ray_init.get("num_cpus")) and _unset(ray_init.get("num_gpus")):
        return machine  # a joined cluster: its own resources
    n_gpus = ray_init.get("num_gpus")
    logical = f"{ray_init.get('num_cpus')} logical CPUs and {n_gpus} logical GPU{'s' * (n_gpus != 1)}"
    return f"{machine}; the private Ray cluster counts {logical} (for verl's resource checks; no GPU is used)"


# temp dirs of private Ray clusters this process started (removed by the session)
CREATED_TEMP_DIRS: list[str] = []


def trainer_workers(config) -> int:
    """The trainer's worker processes (its data-parallel ranks): ``trainer.nnodes * trainer.n_gpus_per_node``."""
    return int(config.trainer.nnodes) * int(config.trainer.n_gpus_per_node)


def configure(config, env: dict[str, str]) -> None:
    """Ray: the given cluster (RAY_ADDRESS, set inside `ray job submit`), else a private one in its own temp dir (none
    in a dry run); the local env (``env``) in every worker."""
    new_temp_dir = None if config.maspo.get("dry_run") else _private_temp_dir
    address = configure_ray_init(config.ray_kwargs.ray_init, env, new_temp_dir)
    if address is None:
        _fit_private_cluster(config)
        if new_temp_dir is not None:  # a token in the cluster's temp dir, none in HOME
            os.environ.update(private_token_env(config.ray_kwargs.ray_init._temp_dir))
            _run_temp_folder(config.ray_kwargs.ray_init)


def _fit_private_cluster(config) -> None:
    """A private cluster gets at least one logical GPU per trainer worker (``trainer.nnodes *
    n_gpus_per_node``; the ranks run FSDP on gloo), for verl's resource-pool checks."""
    ray_init = config.ray_kwargs.ray_init
    workers = trainer_workers(config)
    if int(ray_init.get("num_gpus") or 0) < workers:
        ray_init.num_gpus = workers


def _private_temp_dir() -> str:
    folder = tempfile.mkdtemp(prefix="maspo_ray_", dir="/tmp")  # short: Ray's socket paths are length-limited
    CREATED_TEMP_DIRS.append(folder)
    return folder


RUN_TMP = "tmp"  # the run's temp folder, inside its private cluster's temp dir


def _run_temp_folder(ray_init) -> None:
    """A run on a private cluster keeps its temp files in its own folder, ``<cluster temp dir>/tmp``, removed with
    the cluster's temp dir however the run ends: ``TMPDIR`` of the driver and of every Ray worker and the processes
    they start (vLLM's ZMQ sockets, verl's checkpoint locks, multiprocessing's folders would otherwise stay in the
    system's temp dir). Short: a unix socket's path holds at most 107 bytes. A ``TMPDIR`` in the user's
    ``runtime_env`` wins in the workers."""
    folder = os.path.join(str(ray_init._temp_dir), RUN_TMP)
    os.makedirs(folder, exist_ok=True)
    os.environ["TMPDIR"] = folder
    tempfile.tempdir = None  # the driver's tempfile reads TMPDIR again
    env_vars = ray_init.runtime_env.env_vars
    if "TMPDIR" not in env_vars:
        env_vars["TMPDIR"] = folder
