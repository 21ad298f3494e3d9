"""e2e fixtures: run ``python -m maspo_verl.main local=cpu ...`` in a subprocess and read verl's step metrics.

The trainer starts its own private Ray cluster (``address: local``) in a temp dir unique to the
run (ours, or with ``own_ray_dir=False`` the one the local mode creates and removes itself);
afterwards every process of that run is stopped: the process group of the trainer, then any
process whose command line names the run's Ray temp dir (raylet, GCS, workers). Nothing outside
that run is touched, so other Ray clusters on the machine survive.

The run folder (``hydra.run.dir``) is in the test's tmp dir; the step metrics are read from the
``file`` logger's ``metrics.jsonl`` there (every metric), else from the console's step lines.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# verl's step-line parser and the process-group/Ray-cluster stopper are the lab's (``lab learn``)
from maspo_verl.lab.learn import ANSI, STEP_LINE, parse_steps, stop_run  # noqa: F401
from maspo_verl.util import read_step_metrics as read_metrics

RAY_TEMP_DIR = re.compile(r"ray_temp_dir=(\S+)")


@dataclass
class LocalRun:
    returncode: int | None
    log: str
    wall_s: float
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    # seconds since launch at which the trainer log showed each milestone (see MILESTONES)
    milestones: dict[str, float] = field(default_factory=dict)
    run_dir: Path | None = None  # hydra.run.dir: metrics.jsonl, run.log
    ray_dir: str | None = None  # the run's Ray temp dir
    ray_dir_left: bool = False  # whether it still existed when the trainer had exited

    def tail(self, n: int = 120) -> str:
        return "\n".join(self.log.splitlines()[-n:])

    @property
    def config_text(self) -> str:
        """The composed config as Hydra saved it in the run folder."""
        return (self.run_dir / ".hydra" / "config.yaml").read_text()

    @property
    def some_step_had_a_gradient(self) -> bool:
        """Not every step has one: a step whose groups all scored alike has zero advantages."""
        return any(m.get("actor/grad_norm", 0.0) > 0 for m in self.steps.values())

    @property
    def full_log(self) -> str:
        """Everything the trainer printed, the lines the short console leaves out included (run.log)."""
        path = self.run_dir / "run.log"
        return path.read_text(errors="replace") if path.is_file() else self.log


def manager_overrides(module: Path, name: str) -> list[str]:
    """One training step of full-length responses scored by the test reward manager ``name`` in ``module``."""
    return [
        "reward.reward_manager.source=importlib",
        f"reward.reward_manager.name={name}",
        f"reward.reward_manager.module.path={module}",
        "actor_rollout_ref.rollout.ignore_eos=true",
        "trainer.total_training_steps=1",
    ]


def run_local(
    overrides: list[str],
    log_path: Path,
    timeout_s: float = 420,
    cache_dir: str | None = None,
    own_ray_dir: bool = True,
) -> LocalRun:
    # short: Ray's socket paths are length-limited
    ray_dir = tempfile.mkdtemp(prefix="mvl_ray_", dir="/tmp") if own_ray_dir else None
    run_dir = log_path.parent / f"{log_path.stem}_run"
    # a private cluster: no address for the local mode to join
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_JOB_CONFIG_JSON_ENV_VAR")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["HYDRA_FULL_ERROR"] = "1"
    if cache_dir:
        env["MASPO_VERL_CACHE"] = cache_dir
    cmd = [
        sys.executable,
        "-m",
        "maspo_verl.main",
        "local=cpu",
        f"hydra.run.dir={run_dir}",
        *([f"+ray_kwargs.ray_init._temp_dir={ray_dir}"] if ray_dir else []),
        *overrides,
    ]
    start = time.monotonic()
    returncode = None
    milestones: dict[str, float] = {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    reader = threading.Thread(target=_copy_log, args=(proc.stdout, log_path, start, milestones), daemon=True)
    reader.start()
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        milestones["exit"] = time.monotonic() - start
        if ray_dir is None:  # the one the local mode named in its start line (read long before the exit)
            named = RAY_TEMP_DIR.search(log_path.read_text(errors="replace"))
            ray_dir = named.group(1) if named else None
        left = ray_dir is not None and os.path.exists(ray_dir)
        if ray_dir is not None:
            stop_run(proc, ray_dir)
        reader.join(timeout=15)
        if ray_dir is not None:
            shutil.rmtree(ray_dir, ignore_errors=True)
    wall = time.monotonic() - start
    log = log_path.read_text(errors="replace")
    steps = read_metrics(run_dir / "metrics.jsonl") or parse_steps(log)
    return LocalRun(
        returncode=returncode,
        log=log,
        wall_s=wall,
        steps=steps,
        milestones=milestones,
        run_dir=run_dir,
        ray_dir=ray_dir,
        ray_dir_left=left,
    )


MILESTONES = {
    "ray_init": "maspo_verl local=",  # driver composed + validated the config, Ray starts now
    "ray_started": "Started a local Ray instance",
    "workers_ready": "reward loop manager initialized",
    "training_done": "Final validation metrics",
}


def _copy_log(stream, log_path: Path, start: float, milestones: dict[str, float]) -> None:
    """Copy the trainer's output to ``log_path``, each line prefixed with seconds since start."""
    with open(log_path, "w", errors="replace") as out:
        for raw in iter(stream.readline, b""):
            now = time.monotonic() - start
            line = raw.decode(errors="replace").rstrip("\n")
            out.write(f"[{now:7.1f}s] {line}\n")
            out.flush()
            for name, marker in MILESTONES.items():
                if name not in milestones and marker in line:
                    milestones[name] = now
            if STEP_LINE.search(ANSI.sub("", line)):
                milestones.setdefault("first_step", now)
                milestones["last_step"] = now
    stream.close()


@pytest.fixture(scope="session")
def local_cache_dir(tmp_path_factory):
    """One embedded-asset cache for the whole session (built on first use)."""
    return str(tmp_path_factory.mktemp("maspo_cache"))


@pytest.fixture
def local_run(tmp_path, local_cache_dir):
    """``local_run(overrides, timeout_s=...) -> LocalRun``; the trainer log is kept in tmp_path."""

    def _run(overrides: list[str], timeout_s: float = 480, own_ray_dir: bool = True) -> LocalRun:
        log = tmp_path / "trainer.log"
        for i in range(1, 100):  # a test may run the trainer more than once
            if not log.exists():
                break
            log = tmp_path / f"trainer{i}.log"
        return run_local(overrides, log, timeout_s=timeout_s, cache_dir=local_cache_dir, own_ray_dir=own_ray_dir)

    return _run
