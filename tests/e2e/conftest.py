"""e2e fixtures: run ``python -m maspo_verl.main local=cpu ...`` in a subprocess and read verl's step metrics.

The trainer starts its own private Ray cluster (``address: local``) in a temp dir unique to the
run; afterwards every process of that run is stopped: the process group of the trainer, then any
process whose command line names the run's Ray temp dir (raylet, GCS, workers). Nothing outside
that run is touched, so other Ray clusters on the machine survive.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
WRAPPED = re.compile(r"^[A-Za-z_][\w.]*\((.*)\)$")


@dataclass
class LocalRun:
    returncode: int | None
    log: str
    wall_s: float
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    # seconds since launch at which the trainer log showed each milestone (see MILESTONES)
    milestones: dict[str, float] = field(default_factory=dict)

    def tail(self, n: int = 120) -> str:
        return "\n".join(self.log.splitlines()[-n:])


def manager_overrides(module: Path, name: str) -> list[str]:
    """One training step of full-length responses scored by the test reward manager ``name`` in ``module``."""
    return [
        "reward.reward_manager.source=importlib",
        f"reward.reward_manager.name={name}",
        f"reward.reward_manager.module.path={module}",
        "actor_rollout_ref.rollout.ignore_eos=true",
        "trainer.total_training_steps=1",
    ]


def parse_steps(log: str) -> dict[int, dict[str, float]]:
    """verl's console logger prints ``step:N - key:value - key:value ...`` once per step."""
    steps: dict[int, dict[str, float]] = {}
    for raw in log.splitlines():
        line = ANSI.sub("", raw)
        m = STEP_LINE.search(line)
        if not m:
            continue
        metrics: dict[str, float] = {}
        for item in m.group(2).split(" - "):
            key, sep, value = item.rpartition(":")
            if not sep:
                continue
            value = WRAPPED.sub(r"\1", value.strip())  # the legacy trainer prints np.float64(x)
            try:
                metrics[key.strip()] = float(ast.literal_eval(value))
            except (ValueError, SyntaxError, TypeError):
                try:
                    metrics[key.strip()] = float(value)
                except ValueError:
                    continue
        steps[int(m.group(1))] = metrics
    return steps


def _pids_naming(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def stop_run(proc: subprocess.Popen, ray_dir: str) -> None:
    """Stop the trainer's process group, then every leftover process of this run's Ray cluster."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=15)
            break
        except subprocess.TimeoutExpired:
            continue
    deadline = time.monotonic() + 20
    while True:
        leftovers = _pids_naming(ray_dir)
        if not leftovers:
            return
        sig = signal.SIGTERM if time.monotonic() < deadline - 10 else signal.SIGKILL
        for pid in leftovers:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            return
        time.sleep(1)


def run_local(overrides: list[str], log_path: Path, timeout_s: float = 420, cache_dir: str | None = None) -> LocalRun:
    ray_dir = tempfile.mkdtemp(prefix="mvl_ray_", dir="/tmp")  # short: Ray's socket paths are length-limited
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
        f"+ray_kwargs.ray_init._temp_dir={ray_dir}",
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
        stop_run(proc, ray_dir)
        reader.join(timeout=15)
        shutil.rmtree(ray_dir, ignore_errors=True)
    wall = time.monotonic() - start
    log = log_path.read_text(errors="replace")
    return LocalRun(returncode=returncode, log=log, wall_s=wall, steps=parse_steps(log), milestones=milestones)


MILESTONES = {
    "ray_init": "ray init kwargs:",  # driver composed + validated the config, Ray starts now
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

    def _run(overrides: list[str], timeout_s: float = 480) -> LocalRun:
        return run_local(overrides, tmp_path / "trainer.log", timeout_s=timeout_s, cache_dir=local_cache_dir)

    return _run
