"""Output folders, tables and plotting helpers shared by the lab commands."""

from __future__ import annotations

import contextlib
import csv
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def default_out(folder: str, update_docs: bool = False) -> Path:
    """Where a command writes without ``--out``: a scratch folder, or with ``--update-docs`` the committed
    results of the checkout in the working directory."""
    return Path("docs", "results", folder) if update_docs else Path("outputs", "lab", folder)


class _Tee:
    """A text stream that writes to ``stream`` and to ``log``."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.log.write(text)
        return self.stream.write(text)

    def flush(self):
        self.log.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def full_log(path: Path):
    """Everything the command prints (stdout and stderr) also goes to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as log:
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(sys.stdout, log), _Tee(sys.stderr, log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved


def report_written(out: Path) -> None:
    """The report's title and its path (the whole report is in the file, not on the console)."""
    readme = Path(out) / "README.md"
    title = next((line[2:].strip() for line in readme.read_text().splitlines() if line.startswith("# ")), "report")
    print(f"{title}: {readme.resolve()}")


def read_csv(path: Path) -> list[dict]:
    """The rows of a CSV file with a header ([] when the file does not exist)."""
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def number(text: str):
    """A CSV cell as an int or a float where it reads as one, else as it is."""
    try:
        return int(text)
    except (TypeError, ValueError):
        try:
            return float(text)
        except (TypeError, ValueError):
            return text


def as_float(v) -> float:
    """A number or CSV cell as a float, NaN where it does not read as one."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def finite_mean(values) -> float:
    """The mean of the finite numbers among ``values`` (numbers or CSV cells), NaN when there are none: a metric
    a loss call did not report (NaN) does not count, as verl averages a metric over the calls that report it."""
    finite = [x for x in map(as_float, values) if math.isfinite(x)]
    return sum(finite) / len(finite) if finite else math.nan


def write_csv(path: Path, rows: list[dict]) -> None:
    """The rows under the union of their keys, in order of first appearance (a key a row lacks: empty)."""
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    part = Path(path).with_name(Path(path).name + ".part")
    with open(part, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    os.replace(part, path)  # a stopped run or a reader never sees half a file


def write_tables(out: Path, tables: dict[str, list[dict]]) -> None:
    """Each ``name: rows`` of ``tables`` as ``out/name`` (``write_csv``)."""
    for name, rows in tables.items():
        write_csv(Path(out) / name, rows)


def fmt(v, digits: int = 3) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v != 0 and (abs(v) < 10 ** (-digits) or abs(v) >= 10**5):
            return f"{v:.{digits - 1}e}"
        return f"{v:.{digits}f}"
    return str(v)


def markdown_table(rows: list[dict], keys: Sequence[str] | None = None, digits: int = 3) -> str:
    if not rows:
        return "(no rows)\n"
    keys = list(keys or rows[0])
    out = ["| " + " | ".join(keys) + " |", "|" + "|".join("---" for _ in keys) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(r.get(k, ""), digits) for k in keys) + " |")
    return "\n".join(out) + "\n"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
