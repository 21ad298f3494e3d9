"""Granularity at matched step size (issue 52): the pre-registered study of ``docs/results/granularity/``.

A configuration of the regime grid's engine (``lab/engine/grid.py``: a tabular policy, verl's GRPO advantage, each
loss from verl's registry) and its tuning protocol (``lab/regimes_tuned.py``: every arm's clip band scaled by the
same widths, chosen on tuning seeds), judged on fresh held-out seeds with ``lab/stats.py`` (paired t-intervals,
sign-flip tests, TOST, Holm within each family). ``PREREGISTRATION.md`` in the output folder is the protocol:
the arms, cells, seeds, families and decision rules below are its, and change only with it.

Two phases: ``--phase tune`` runs the tuning seeds and writes each arm's chosen width (``choice.csv``);
``--phase held`` then runs the held-out seeds and reports; ``all`` does both. ``--resume`` keeps the rows already
in ``runs.csv`` and runs only the missing jobs, so the study runs in pieces.

The analysis (``comparisons``, ``tests``, ``decisions`` and the report's sections) reads a part's ``Design``; part 2,
the warm speech model in verl's trainer (``--part 2``), is ``granularity_warm``'s driver on the same analysis.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

from maspo_verl.lab.engine import grid, journal
from maspo_verl.lab.engine.cells import parse_cell
from maspo_verl.lab.engine.common import as_float, finite_mean, markdown_table, read_csv, write_csv
from maspo_verl.lab.engine.presets import Preset, discover_presets, variant, widen
from maspo_verl.lab.engine.protocol import (
    CELLS,
    FIXED,
    HELD_SEEDS,
    SAMPLE_SEED,
    TOKEN,
    TUNE_SEEDS,
    Design,
    bracket_note,
    check_choice,
    comparisons,
    decisions,
    design_table,
    family_sections,
    part1,
    plot,
    tests,
    verdict_section,
)
from maspo_verl.lab.engine.study import Study
from maspo_verl.lab.engine.tuning import choose

STUDY = Study(
    "granularity",  # protocol.PART1_FOLDER
    "pre-registered: token vs windows vs aligned units vs adaptive, each arm's band tuned alike, fresh seeds",
    writes=("README.md", "tests.csv", "decisions.csv", "cells.csv", "design.csv", "tests.png"),
    modes={"part": {2: "granularity_warm", 4: "granularity_vllm"}},
    cells=CELLS,
    tune_seeds=TUNE_SEEDS,
    held_seeds=HELD_SEEDS,
)

OUT = STUDY.folder


def arms(d: Design) -> list[Preset]:
    """The 12 registered arms: H1's windows, H2's unit segments, H3's adaptive criteria."""
    fixed = [variant(f"{FIXED}{w}") for w in d.windows]
    (words,) = discover_presets(["maspo_words"])
    units = [replace(words, name=f"maspo_words~{c}", control=c) for c in ("units", "units_offset", "units_shuffled")]
    adaptive = [variant(n) if "@" in n else discover_presets([n])[0] for n in d.adaptive]
    return fixed + units + adaptive


def jobs_of(d: Design, seeds: tuple[int, ...]) -> list[grid.Job]:
    jobs = [
        grid.Job(task=d.task, preset=widen(p, w), seeds=seeds, **vars(parse_cell(c)))
        for c in d.cells
        for p in arms(d)
        for w in d.settings
    ]
    return sorted(jobs, key=lambda j: -j.length)


def _key(job_or_row) -> tuple:
    if isinstance(job_or_row, dict):
        return job_or_row["cell"], job_or_row["loss"], job_or_row["band"]
    return job_or_row.cell, job_or_row.preset.name, job_or_row.preset.band


def _read_by_tests(choices: list[dict], d: Design) -> set[tuple]:
    """(cell, arm, width) of every job a registered test reads: an arm at its chosen width, unclipped, matched KL."""
    return {(c, a[0], a[1]) for _, c, *arms in comparisons(choices, d) for a in arms}


def _jobs(runs: list[dict], seeds: tuple[int, ...], keys: set | None = None) -> int:
    """How many (cell, arm, width) jobs ``runs`` hold on ``seeds`` (among ``keys``)."""
    done = {_key(r) for r in runs if int(r["seed"]) in seeds}
    return len(done & keys if keys is not None else done)


def tested_first(jobs: list[grid.Job], choices: list[dict], d: Design) -> list[grid.Job]:
    """``jobs`` with those a registered test reads first; the other widths' held-out runs feed no test."""
    needed = _read_by_tests(choices, d)
    return sorted(jobs, key=lambda j: _key(j) not in needed)


def missing(jobs: list[grid.Job], runs: list[dict]) -> list[grid.Job]:
    """The jobs whose seeds are not all in ``runs`` (a resumed study runs only these)."""
    have: dict[tuple, set] = {}
    for r in runs:
        have.setdefault(_key(r), set()).add(int(r["seed"]))
    return [j for j in jobs if not set(j.seeds) <= have.get(_key(j), set())]


# ------------------------------------------------------------------ analysis (the registered tests)


def cells_table(runs: list[dict], choices: list[dict], d: Design) -> list[dict]:
    """Per cell: W = 1's chosen width and held-out final reward, and its drift log-ratios' measured correlation
    (pooled over the held-out job's seeds and steps) beside independent log-ratios'."""
    out = []
    for cell in dict.fromkeys(c["cell"] for c in choices):
        band = next(c["best_band"] for c in choices if (c["cell"], c["loss"]) == (cell, TOKEN))
        mine = [r for r in runs if _key(r) == (cell, TOKEN, band) and int(r["seed"]) in d.held_seeds]
        length = int(mine[0]["length"]) if mine else 1
        metrics = grid.drift_metrics(None) | grid.drift_metrics(None, "seen_")
        out.append(
            {
                "cell": cell,
                "token_width": band,
                "token_final": finite_mean(r["final_reward"] for r in mine),
                "token_gain": finite_mean(as_float(r["final_reward"]) - as_float(r["first_reward"]) for r in mine),
                **{k: as_float(mine[0][k]) if mine else math.nan for k in metrics},
                **grid.null_correlation(length),
            }
        )
    return out


# ------------------------------------------------------------------ the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "The pre-registered granularity study (docs/results/granularity/PREREGISTRATION.md): fixed windows 1..96 "
        "through one code path, unit-aligned / offset / shuffled segments and maspo_adaptive, each arm's clip band "
        "tuned with the same widths on seeds 20000-20031, judged on fresh seeds 30000-30063; paired t-intervals, "
        "sign-flip tests, TOST and Holm per family. --part 2: the warm speech model in verl's trainer, each arm's "
        "learning rate tuned on seeds 200-203 and judged on seeds 300-311, in resumable pieces of `lab learn` "
        "(maspo_verl/lab/studies/granularity_warm.py; folder granularity/warm). --part 4 (exploratory): "
        "SmolLM2-135M in "
        "verl's trainer with the vLLM rollout, grpo, W = 1 and the whole response, each arm's learning rate tuned "
        "on seeds 400-401 and judged on seeds 500-503, pieces on the same engine (granularity_vllm.py; folder "
        "granularity/vllm)."
    )
    p.add_argument(
        "--part", type=int, choices=(1, 2, 4), default=1, help="1: the table-policy grid; 2: the warm model; 4: SmolLM2"
    )
    p.add_argument("--phase", choices=("tune", "held", "all"), default="all", help="tuning seeds, held-out, both")
    p.add_argument("--resume", action="store_true", help="keep --out's runs and run only the missing jobs (pieces)")
    p.add_argument(
        "--pieces", type=int, default=0, help="--part 2 or 4: run at most this many pieces, then stop (0: all)"
    )
    p.add_argument("--report", action="store_true", help="only rebuild the tables and README from --out's runs")
    grid.engine_arguments(p, "Adam learning rate of cells without /lr<x>")
    p.set_defaults(sample_seed=SAMPLE_SEED)


# --part 2 and 4 run granularity_warm's driver and write their folders (the lab CLI swaps the module in)


def run(args: argparse.Namespace, argv: list[str], design: Design | None = None) -> None:
    d = design or part1()
    if args.pieces:
        raise SystemExit("--pieces: parts 2 and 4 only (--part 2, --part 4); part 1 resumes job by job with --resume")
    out = Path(args.out)
    if args.report:
        return report(out, args, d)
    runs = read_csv(out / "runs.csv") if args.resume else []
    if args.resume:
        journal.again(out, argv)
    else:
        journal.start(out, argv)
    args.seeds = len(d.held_seeds)
    if args.phase in ("tune", "all"):
        runs = grid.run_jobs(missing(jobs_of(d, d.tune_seeds), runs), args, out, "runs.csv", kept=runs)
        write_csv(out / "choice.csv", choose(runs, d.held_seeds[0], baseline=TOKEN))
    if args.phase in ("held", "all"):
        if not (out / "choice.csv").is_file():
            raise SystemExit(f"--phase held: {out / 'choice.csv'} is missing: run --phase tune first")
        choices = choose([r for r in runs if int(r["seed"]) in d.tune_seeds], d.held_seeds[0], baseline=TOKEN)
        jobs = tested_first(missing(jobs_of(d, d.held_seeds), runs), choices, d)
        runs = grid.run_jobs(jobs, args, out, "runs.csv", kept=runs)
        report(out, args, d)


def report(out: Path, args, design: Design | None = None) -> None:
    from maspo_verl.lab.engine import common

    d = design or part1()
    runs = read_csv(out / "runs.csv")
    choices = choose([r for r in runs if int(r["seed"]) in d.tune_seeds], d.held_seeds[0], baseline=TOKEN)
    check_choice(out / "choice.csv", choices)
    rows = tests(runs, choices, d)
    verdicts = decisions(rows)
    cells = cells_table(runs, choices, d)
    tables = {"tests.csv": rows, "decisions.csv": verdicts, "cells.csv": cells, "design.csv": design_table(d)}
    common.write_tables(out, tables)
    plot(rows, out / "tests.png", d.families)
    text = readme(runs, choices, rows, verdicts, cells, journal.read(out), journal.deviations(out), d)
    (out / "README.md").write_text(text)
    common.report_written(out)


# the registered parts after part 1: each folder's README holds its own status, tests and deviations (this README
# states none of them, so it stays true as they run)
LATER_PARTS = (
    "Part 2, the warm speech model (`python -m maspo_verl.lab granularity --part 2`, `lab/granularity_warm.py`): "
    "[warm/README.md](warm/README.md).",
    "Part 3, SmolLM2-135M at realistic drift (`python -m maspo_verl.lab smollm2 --granularity`, "
    "`lab/smollm2_granularity.py`): [smollm2/README.md](smollm2/README.md).",
    "Part 4, exploratory SmolLM2-135M RL through verl's vLLM rollout (`python -m maspo_verl.lab granularity --part "
    "4`, `lab/granularity_vllm.py`): [vllm/README.md](vllm/README.md).",
)


def readme(runs, choices, rows, verdicts, cells, command, deviations, d: Design) -> str:
    tune, held, read = d.tune_seeds, d.held_seeds, _read_by_tests(choices, d)
    lines = [
        "# Granularity at matched step size: results of the pre-registered study",
        "",
        "The protocol is [`PREREGISTRATION.md`](PREREGISTRATION.md), committed before any of these runs. Every "
        "registered test of the parts run so far is below, whatever its outcome. Made by "
        "`python -m maspo_verl.lab granularity` (engine `maspo_verl/lab/studies/regimes.py`, "
        "tuning `regimes_tuned.py`, "
        f"tests `stats.py`): {len(runs)} runs ({_jobs(runs, tune)} tuning jobs x {len(tune)} seeds, "
        f"{_jobs(runs, held)} of {len(jobs_of(d, held))} held-out jobs x {len(held)} seeds, among them "
        f"{_jobs(runs, held, read)} of the {len(read)} that a registered test reads), tuning seeds "
        f"{tune[0]}-{tune[-1]}, held-out seeds {held[0]}-{held[-1]}, sample seed {SAMPLE_SEED}.",
        "",
        "```",
        command.strip(),
        "```",
        "",
        *verdict_section(verdicts),
        "## The cells: W = 1 and the measured correlation of its drift log-ratios",
        "",
        "`drift_*`: lag-1 and VIF(n) of log pi after each batch's updates minus the old log-probs (W = 1 at its "
        "chosen width, held-out seeds, pooled); `seen_*`: of the log-ratios each loss call sees; `null_*`: the same "
        "measure of independent log-ratios (centring each row puts it below 1).",
        "",
        markdown_table(cells),
        *family_sections(rows, d),
    ]
    lines += ["## Deviations from the pre-registration", "", *(f"- {x}" for x in deviations), ""]
    lines += [
        "## The other parts",
        "",
        "Each runs in resumable pieces in later sessions; its README says how far it has run, every registered test "
        "its data allow and its deviations:",
        "",
        *(f"- {r}" for r in LATER_PARTS),
        "",
    ]
    lines += [
        "## The widths chosen on the tuning seeds",
        "",
        markdown_table(choices),
        bracket_note(choices, d),
        "",
        "![registered tests](tests.png)",
        "",
        "Files: `runs.csv` (every run: per seed, arm and width), `choice.csv` (written before the held-out runs), "
        "`tests.csv` (every registered test), `decisions.csv`, `cells.csv`, `design.csv` (the registered design).",
        "",
    ]
    return "\n".join(lines)
