"""The journal of an output folder: its ``COMMAND.txt``, the one record of how the folder was made. It opens with
the command line, the date, the versions and the machine; a resumed or re-run command, each piece a study runs,
and each run's time with the machine's load are appended as they happen. Reports quote it (``read``)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

NAME = "COMMAND.txt"
DEVIATIONS = "DEVIATIONS.md"  # a results folder's hand-written history (``deviations``)
PROG = "python -m maspo_verl.lab"


def command_line(argv: Sequence[str]) -> str:
    """The lab command line of ``argv``, quoted so that a shell runs it again."""
    return f"{PROG} {shlex.join(argv)}"


def _versions() -> str:
    """python, torch and verl (transformers where verl is not installed, as on a lent GPU machine)."""
    import torch

    try:
        import verl

        last = f"verl {verl.__version__}"
    except ImportError:
        import transformers

        last = f"transformers {transformers.__version__}"
    return f"python {platform.python_version()}, torch {torch.__version__}, {last}"


def _machine() -> str:
    import torch

    cuda = f"yes: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no"
    return (
        f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch threads {torch.get_num_threads()}, "
        f"cuda {cuda}"
    )


def start(out: str | os.PathLike, argv: Sequence[str], name: str = NAME) -> Path:
    """Create the folder and begin its journal: the command line, date (UTC), versions and machine."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    lines = [command_line(argv), "", f"date (UTC): {now}", _versions(), _machine()]
    (path / name).write_text("\n".join(lines) + "\n")
    return path


def note(out: str | os.PathLike, text: str) -> None:
    """Append a line (or lines) to the folder's journal."""
    with open(Path(out) / NAME, "a") as f:
        f.write(text + "\n")


def again(out: str | os.PathLike, argv: Sequence[str], how: str = "resumed") -> Path:
    """A command that goes on in a folder already made: its line appended (``how``: resumed, re-ran ...), or the
    journal begun where there is none yet."""
    path = Path(out)
    if not (path / NAME).is_file():
        return start(path, argv)
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    note(path, f"\n{how}: {command_line(argv)}\ndate (UTC): {now}")
    return path


def read(out: str | os.PathLike) -> str:
    """The folder's journal, or "" where it has none."""
    path = Path(out) / NAME
    return path.read_text() if path.is_file() else ""


def deviations(out: str | os.PathLike) -> list[str]:
    """What happened as a results folder's runs ran (its machine, commits, stops and resumes), from the folder's
    hand-written DEVIATIONS.md (one ``- `` line each; none where it has none): a run's history is its folder's."""
    path = Path(out) / DEVIATIONS
    return [line[2:] for line in path.read_text().splitlines() if line.startswith("- ")] if path.is_file() else []


def load() -> str:
    """The machine's load now (``uptime``'s line, or the load averages where it cannot run)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_time(
    out: str | os.PathLike, seconds: float, what: str = "", loads: Sequence[str] = (), every: str = ""
) -> None:
    """Append how long the runs took (``what``: processes, jobs, device) and the load sampled during them."""
    lines = [f"run time: {seconds:.0f} s ({seconds / 60:.1f} min)" + (f", {what}" if what else "")]
    if len(loads) == 1:
        lines.append(f"machine load at the end: {loads[0]}")
    elif loads:
        lines.append(f"machine load during the run (uptime, sampled {every}):")
        lines += [f"  {line}" for line in loads]
    note(out, "\n".join(lines))
