"""A local run's folder, its log and its closing block, and the session around verl's trainer that keeps them.

``session`` (driver): every line printed by the driver or forwarded by Ray from a worker goes to
``<run folder>/run.log``, and to the console what ``console.Console`` shows of it; at the end, a closing block says
how many steps ran, the final metrics, and where the metrics (``trainer.logger`` ``file`` backend, in the run
folder), the reward curve (``reward.png`` beside them, with matplotlib), the log, the config and the checkpoints
are, also when the run fails; what the run leaves is removed (``cleanup``). SIGTERM stops a run as Ctrl-C does.

The run folder is Hydra's output folder (``hydra.run.dir``, by default ``outputs/<date>/<time>``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import tempfile
import time
from pathlib import Path

from maspo_verl.local.cleanup import remove_shm_leftovers, shm_names, stop_ray
from maspo_verl.local.console import STEP_KEYS, Captured, Console, format_step, shown_number
from maspo_verl.util import read_step_metrics
from maspo_verl.validation import FieldError, root_cause

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
    said = f"{REWARD_KEY} {shown_number(first)} at step {first_step}, {shown_number(last)} at step {last_step}"
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
    once the console was muted (``console.Console.mute``)."""
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
        shown = [f"{label} {shown_number(last[key])}" for key, label in STEP_KEYS.items() if key in last]
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
    Yields the console (``console.Console``)."""
    out = run_dir()
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "run.log"
    console = Console.of(config, log_path)
    captured = Captured(console)
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
        stop_ray(created_temp_dirs)
        remove_shm_leftovers(shm_before)
        _restore_temp_dir(*temp_before)
        restore_term()
        captured.close_pending()
        _late_step_lines(config, console, captured.originals["stdout"])
        captured.restore()
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
        except SystemExit as exc:  # SIGTERM while ray.init ran: Ray's handler is sys.exit(signum)
            if previous is None or exc.code != signal.SIGTERM:
                raise
            stopped_by.append(signal.SIGTERM.name)
            raise KeyboardInterrupt(stopped_by[-1]) from None
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


def _late_step_lines(config, console: Console, target) -> None:
    """The step lines of the metrics file that never reached the console: Ray forwards a worker's output
    asynchronously, and the legacy trainer's last line (printed just before its actor returns) is lost
    when the driver shuts Ray down."""
    if "console" not in backends(config):
        return
    for step, metrics in sorted(read_step_metrics(metrics_path(config)).items()):
        line = format_step(metrics, step) if step not in console.steps_shown else None
        if line:
            console.line(line, target)
