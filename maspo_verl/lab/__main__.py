"""python -m maspo_verl.lab <command> [--out DIR | --update-docs] [options]

Each command writes its tables, plots, a README.md (the report), a COMMAND.txt (the command that made
them) and lab.log (its whole console output) to outputs/lab/<folder>/, a scratch folder; --out DIR
writes elsewhere, --update-docs to the committed docs/results/<folder>/ of the checkout it runs in (no
lab.log there). On the console: its progress, the report's title and where the files are.
`<command> --help` lists its knobs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import sys
from pathlib import Path

from maspo_verl.local.run_log import Interrupted

LOG = "lab.log"  # each command's whole console output, in its folder


def _require_environment() -> None:
    """What every command needs (matplotlib: the `lab` extra, for the plots at the end of a run), checked at once."""
    missing = [m for m in ("torch", "verl", "hydra", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"python -m maspo_verl.lab: {sys.executable} lacks {', '.join(missing)}: activate the project venv "
            "(source .venv/bin/activate, after bash .ci/setup) or install maspo-verl with the lab extra "
            "(pip install -e '.[lab,local]' in the checkout)"
        )


def parse(argv: list[str]) -> argparse.Namespace:
    """The lab CLI's arguments of ``argv`` (``engine.study.parse``, this module's text as ``--help``'s)."""
    from maspo_verl.lab.engine import study

    return study.parse(argv, __doc__)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    _require_environment()
    from maspo_verl.lab.engine import common

    args = parse(argv)
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # torch.profiler's USDT start/stop marker lines: none
    # the whole console output in the folder (not in the committed one: --update-docs)
    with (
        _terminate_as_interrupt(),
        contextlib.nullcontext() if args.update_docs else common.full_log(Path(args.out) / LOG),
    ):
        args.module.run(args, argv)
    out = Path(args.out).resolve()
    print(f"results: {out}/ ({', '.join(sorted(p.name for p in out.iterdir() if p.is_file()))})")


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (``kill``, a scheduler's stop) ends a command as Ctrl-C does: its clean-up runs, so a trainer run
    it started is stopped with its Ray cluster and its temp folders go (Python's default ends it at once and
    leaves the run behind)."""

    def handler(signum, frame):
        raise Interrupted(signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: no handler can be set
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as exc:
        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        print(f"python -m maspo_verl.lab: stopped by {stop}", file=sys.stderr)
        sys.exit(stop.exit_status)
