"""Part 1 of the granularity study re-judged under other equivalence margins (exploratory: the registration fixed
±0.03 final reward). Its registered tests are computed again from its committed runs and tuning choice, the same
code as part 1's report (``granularity.tests``, ``decisions``) with only the margin changed: each test's TOST p
(Holm-adjusted within its family), its outcome, and each family's verdict by the registered rules. The difference
tests (sign-flip p) do not read the margin; a verdict that moves with it moves only through equivalence."""

from __future__ import annotations

import argparse
import re
from dataclasses import replace
from pathlib import Path

from maspo_verl.lab.engine import journal
from maspo_verl.lab.engine import protocol as reg
from maspo_verl.lab.engine.common import default_out, markdown_table, read_csv, write_tables
from maspo_verl.lab.engine.study import Study

STUDY = Study(
    "margins",
    "part 1 of the granularity study re-judged under other equivalence margins, from its committed runs",
    folder="granularity/margins",
    writes=("README.md", "outcomes.csv", "verdicts.csv"),
    reads_only=True,
)


def judged(runs: list[dict], choices: list[dict], margins: list[float]) -> tuple[list[dict], list[dict]]:
    """Per margin (the registered one first), every test's outcome and every verdict (``granularity``'s rules)."""
    outcomes, verdicts = [], []
    for margin in dict.fromkeys([reg.MARGIN, *margins]):
        rows = reg.tests(runs, choices, replace(reg.part1(), margin=margin))
        keys = ("family", "cell", "arm", "vs", "diff", "tost_low", "tost_high", "p_tost_holm", "outcome")
        outcomes += [{"margin": margin, **{k: r.get(k, "") for k in keys}} for r in rows]
        verdicts += [{"margin": margin, **v} for v in reg.decisions(rows, margin)]
    return outcomes, verdicts


def changed(rows: list[dict], key: str, ids: tuple[str, ...], word=lambda v: v) -> list[dict]:
    """The rows whose ``key`` reads otherwise (``word`` of it: what counts) than at the registered margin, beside
    the registered value."""
    registered = {tuple(r[i] for i in ids): r[key] for r in rows if r["margin"] == reg.MARGIN}
    out = []
    for r in rows:
        was = registered[tuple(r[i] for i in ids)]
        if r["margin"] != reg.MARGIN and word(r[key]) != word(was):
            out.append({**{i: r[i] for i in ids}, "margin": f"±{r['margin']}", "registered": was, key: r[key]})
    return out


def _verdict(v: str) -> str:
    """A verdict without its note on the margin (``falsified (below, within ±0.05)``: falsified)."""
    return v.split(" (")[0]


def _outcome(o: str) -> str:
    """An outcome whatever its margin (``within ±0.02`` and ``within ±0.03`` read the same)."""
    return re.sub(r"±[0-9.]+", "±", o)


def run(args: argparse.Namespace, argv: list[str]) -> None:
    out = journal.start(args.out, argv)
    source = Path(args.source)
    runs, choices = read_csv(source / "runs.csv"), read_csv(source / "choice.csv")
    if not runs or not choices:
        raise SystemExit(f"--from {source}: expected part 1's runs.csv and choice.csv there")
    outcomes, verdicts = judged(runs, choices, args.margins)
    write_tables(out, {"outcomes.csv": outcomes, "verdicts.csv": verdicts})
    moved = changed(verdicts, "verdict", ("family", "cell", "arm"), _verdict)
    tests = changed(outcomes, "outcome", ("family", "cell", "arm", "vs"), _outcome)
    others = ", ".join(f"±{m}" for m in dict.fromkeys(args.margins) if m != reg.MARGIN)
    lines = [
        "# The granularity study's part 1 under other equivalence margins",
        "",
        f"Exploratory, not registered: part 1's {len({(r['family'], r['cell'], r['arm'], r['vs']) for r in outcomes})}"
        f" registered tests judged again at margins {others} final reward instead of the registered ±{reg.MARGIN}, "
        f"from the committed runs and tuning choice in `{source.as_posix()}/` by the same code as its report, only "
        "the margin changed (made by `COMMAND.txt`). The difference tests do not read the margin; equivalence "
        "(Holm-adjusted TOST p < 0.05 within the family: the 90 % t-interval inside ± the margin) does.",
        "",
        "## Verdicts that change (a note on the margin alone does not count)",
        "",
        markdown_table(moved) if moved else "None: every verdict is the registered margin's.\n",
        "## Test outcomes that change (the margin's number alone does not count)",
        "",
        markdown_table(tests, digits=4) if tests else "None.\n",
        "All outcomes and verdicts at every margin: `outcomes.csv`, `verdicts.csv`.",
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--from",
        dest="source",
        default=str(default_out(reg.PART1_FOLDER, update_docs=True)),
        help="part 1's results folder (its runs.csv and choice.csv)",
    )
    p.add_argument("--margins", type=float, nargs="+", default=[0.02, 0.05], help="equivalence margins to judge at")
