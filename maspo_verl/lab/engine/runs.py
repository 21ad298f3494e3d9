"""One local trainer run: ``python -m maspo_verl.main local=cpu <overrides>`` in a subprocess, and what it left.

The one runner of ``lab learn``, ``lab steptime``, ``lab reward`` and the e2e tests. Each run has its
own run folder (``hydra.run.dir``: verl's ``metrics.jsonl``, the local mode's ``run.log``, Hydra's
``.hydra/config.yaml``) and its own private Ray cluster (``address: local``) in a temp dir unique to
the run: ours, or with ``own_ray_dir=False`` the one the local mode creates and removes itself.
Afterwards every process of that run is stopped: the trainer's process group, then any process
whose command line names the run's Ray temp dir (raylet, GCS, workers). Nothing outside that run is
touched, so other Ray clusters on the machine survive.

The console output goes to ``<run folder>/console.log``, each line prefixed with the seconds since
launch. The per-step metrics are verl's ``file`` logger's (``metrics.jsonl``, every metric at full
precision), else its console lines ``step:N - key:value - ...`` (a run with the console logger only).
"""

from __future__ import annotations

import ast
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from maspo_verl.lab.engine import stats
from maspo_verl.lab.engine.common import read_csv
from maspo_verl.util import read_step_metrics

METRICS_FILE = "metrics.jsonl"  # verl's ``file`` logger in the run folder (the local mode's default)
CONSOLE_LOG = "console.log"
VALIDATION = "val-core/"  # verl's main validation metrics (val-core/<data source>/<metric>/...)
STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
WRAPPED = re.compile(r"^[A-Za-z_][\w.]*\((.*)\)$")
RAY_TEMP_DIR = re.compile(r"ray_temp_dir=(\S+)")
# seconds since launch at which the console first showed each marker
MILESTONES = {
    "ray_init": "maspo_verl local=",  # driver composed + validated the config, Ray starts now
    "ray_started": "Started a local Ray instance",
    "workers_ready": "reward loop manager initialized",
    "training_done": "Final validation metrics",
}


@dataclass
class LocalRun:
    """What one run left: exit code (None: stopped at the timeout), console text, per-step metrics."""

    returncode: int | None
    log: str  # the console output, each line prefixed with ``[   12.3s] ``
    wall_s: float
    run_dir: Path  # hydra.run.dir: metrics.jsonl, run.log, .hydra/config.yaml
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    milestones: dict[str, float] = field(default_factory=dict)  # see MILESTONES; also first_step, last_step, exit
    ray_dir: str | None = None  # the run's Ray temp dir
    ray_dir_left: bool = False  # whether it still existed when the trainer had exited
    # CPU seconds (user + system) of the run's processes (``_RunCPU``): a lower bound, close for long-lived ones
    cpu_s: float = float("nan")

    def tail(self, n: int = 120) -> str:
        return "\n".join(self.log.splitlines()[-n:])

    @property
    def config_text(self) -> str:
        """The composed config as Hydra saved it in the run folder."""
        return (self.run_dir / ".hydra" / "config.yaml").read_text()

    @property
    def full_log(self) -> str:
        """Everything the trainer printed, the lines the short console leaves out included (run.log)."""
        path = self.run_dir / "run.log"
        return path.read_text(errors="replace") if path.is_file() else self.log

    @property
    def some_step_had_a_gradient(self) -> bool:
        """Not every step has one: a step whose groups all scored alike has zero advantages."""
        return any(m.get("actor/grad_norm", 0.0) > 0 for m in self.steps.values())


def parse_steps(log_text: str) -> dict[int, dict[str, float]]:
    """verl's console logger prints ``step:N - key:value - key:value ...`` once per step."""
    steps: dict[int, dict[str, float]] = {}
    for raw in log_text.splitlines():
        m = STEP_LINE.search(ANSI.sub("", raw))
        if not m:
            continue
        metrics = {}
        for item in m.group(2).split(" - "):
            key, sep, value = item.rpartition(":")
            if not sep:
                continue
            value = WRAPPED.sub(r"\1", value.strip())
            try:
                metrics[key.strip()] = float(ast.literal_eval(value))
            except (ValueError, SyntaxError, TypeError):
                continue
        steps[int(m.group(1))] = metrics
    return steps


def read_metrics(run_dir: Path, log_text: str = "") -> dict[int, dict[str, float]]:
    """The numeric metrics of each step: from the run folder's ``metrics.jsonl``, else the console's step lines."""
    steps = read_step_metrics(Path(run_dir) / METRICS_FILE)
    if not steps:
        return parse_steps(log_text)
    return {s: {k: float(v) for k, v in data.items() if isinstance(v, int | float)} for s, data in steps.items()}


# what a run does not inherit from the process that starts it
INHERITED_NOT = (
    "RAY_ADDRESS",
    "RAY_JOB_CONFIG_JSON_ENV_VAR",
    "VERL_FILE_LOGGER_PATH",
    "VERL_FILE_LOGGER_ROOT",
    "TENSORBOARD_DIR",
    "WANDB_DIR",
)


# The lab's studies (and the e2e tests run through this runner) were measured with the transformers rollout and the
# actor's own old log-probs, the local mode's defaults before it ran verl's vLLM rollout with bypass mode
# (tests/e2e/test_local_vllm.py runs that): kept, where the overrides do not choose.
RUNNER_DEFAULTS = ("actor_rollout_ref.rollout.name=hf", "algorithm.rollout_correction.bypass_mode=false")


def pinned(overrides: list[str]) -> list[str]:
    """``overrides`` after the runner's defaults that they do not set (``RUNNER_DEFAULTS``)."""
    chosen = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    return [*(d for d in RUNNER_DEFAULTS if d.split("=", 1)[0] not in chosen), *overrides]


def local_command(overrides: list[str], run_dir: Path, ray_dir: str | None = None) -> list[str]:
    """``python -m maspo_verl.main local=cpu`` with the run folder, the Ray temp dir and ``overrides``."""
    ray = [f"+ray_kwargs.ray_init._temp_dir={ray_dir}"] if ray_dir else []
    return [sys.executable, "-m", "maspo_verl.main", "local=cpu", f"hydra.run.dir={run_dir}", *ray, *pinned(overrides)]


def run_local(
    overrides: list[str],
    run_dir: str | os.PathLike,
    timeout_s: float = 900,
    env: dict[str, str] | None = None,
    own_ray_dir: bool = True,
    cwd: str | os.PathLike | None = None,
) -> LocalRun:
    """One local-mode trainer run with ``run_dir`` as its run folder; ``env`` adds to the inherited environment;
    ``cwd``: where it runs (``python -m`` finds the package there first)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / CONSOLE_LOG
    # short: Ray's socket paths are length-limited
    ray_dir = tempfile.mkdtemp(prefix="mvl_ray_", dir="/tmp") if own_ray_dir else None
    # a private cluster: no address for the local mode to join; the run's tracking files in its own run folder,
    # not where an earlier local run in this process pointed them (the local mode sets these in its driver)
    environ = {k: v for k, v in os.environ.items() if k not in INHERITED_NOT}
    environ |= {"PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", **(env or {})}
    cmd = local_command(overrides, run_dir, ray_dir)
    start, cpu = time.monotonic(), _children_cpu()
    milestones: dict[str, float] = {}
    # everything after the start inside the try: a stop (SIGTERM, Ctrl-C) that lands at any point stops the run
    proc = polled = reader = None
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environ, start_new_session=True, cwd=cwd
        )
        poller = _RunCPU(proc.pid, ray_dir)
        poller.start()
        polled = poller  # started (a stop inside ``start`` leaves it None: nothing to join)
        copier = threading.Thread(target=_copy_log, args=(proc.stdout, log_path, start, milestones), daemon=True)
        copier.start()
        reader = copier
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        milestones["exit"] = time.monotonic() - start
        if ray_dir is None and log_path.exists():  # the one the local mode named in its start line
            named = RAY_TEMP_DIR.search(log_path.read_text(errors="replace"))
            ray_dir = named.group(1) if named else None
        left = ray_dir is not None and os.path.exists(ray_dir)
        if polled is not None:
            polled.last()
        if proc is not None:
            stop_run(proc, ray_dir)
        if reader is not None:
            reader.join(timeout=15)
        if ray_dir is not None:
            shutil.rmtree(ray_dir, ignore_errors=True)
    log = log_path.read_text(errors="replace")
    return LocalRun(
        returncode=returncode,
        log=log,
        wall_s=time.monotonic() - start,
        run_dir=run_dir,
        steps=read_metrics(run_dir, log),
        milestones=milestones,
        ray_dir=ray_dir,
        ray_dir_left=left,
        cpu_s=max(_children_cpu() - cpu, polled.seconds()),
    )


def _children_cpu() -> float:
    """User + system CPU seconds of this process's reaped children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _RunCPU(threading.Thread):
    """The CPU seconds of one run's processes, polled: each process of the trainer's session or naming the run's
    Ray temp dir (its workers, raylet), at its last reading. The kernel's count of reaped children misses those
    Ray's raylet reaps or that are killed unreaped; this misses what a process spends after its last poll."""

    def __init__(self, session: int, ray_dir: str | None, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.session, self.marker, self.every_s = session, (ray_dir or "").encode(), every_s
        self.halt, self.seen = threading.Event(), {}
        self.tick = os.sysconf("SC_CLK_TCK")

    def poll(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    stat = f.read()
                fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) ": state is field 3
                ours = int(fields[3]) == self.session
                if not ours and self.marker:
                    with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                        ours = self.marker in f.read()
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            if ours:
                self.seen[int(entry.name)] = (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime

    def run(self) -> None:
        while not self.halt.wait(self.every_s):
            self.poll()

    def last(self) -> None:
        """Stop polling after one last reading (before the run's leftovers are stopped)."""
        self.halt.set()
        self.join()
        self.poll()

    def seconds(self) -> float:
        return sum(self.seen.values())


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


def stop_run(proc: subprocess.Popen, ray_dir: str | None) -> None:
    """Stop the run's process group, then any process of its private Ray cluster (named by its temp dir; none to
    look for without one)."""
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
    for attempt in range(10 if ray_dir else 0):
        left = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if ray_dir in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                        left.append(int(entry.name))
                except OSError:
                    continue
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGTERM if attempt < 5 else signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(1)


def slug(text: str) -> str:
    """``text`` as a Hydra override value and a folder name: a variant's ``@``, ``=`` and ``,``, and the cell's
    ``/``, become ``_``."""
    return re.sub(r"[^\w.+-]", "_", text)


INT_COLUMNS = ("seed", "length", "updates", "step", "steps", "exit_code", "steps_to_target", "steps_to_target_c")
TEXT_COLUMNS = ("task", "cell", "mismatch", "loss", "collapse", "band", "rollout", stats.FINGERPRINT)


def load_rows(path: Path) -> list[dict]:
    """Rows of a learn CSV as the run wrote them (ints, bools, None for empty, floats); [] where it is missing."""
    rows = []
    for raw in read_csv(path):
        row = {}
        for key, value in raw.items():
            if key in TEXT_COLUMNS:
                row[key] = value
            elif value in ("True", "False"):
                row[key] = value == "True"
            elif value == "":
                row[key] = None if key in INT_COLUMNS else float("nan")
            else:
                row[key] = int(value) if key in INT_COLUMNS else float(value)
        rows.append(row)
    return rows
