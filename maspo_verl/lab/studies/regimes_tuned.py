"""The regime grid with a fair protocol: every preset's clip band tuned with the same budget, judged on held-out seeds.

The engine is the regime grid's (``maspo_verl.lab.engine.grid``: a tabular policy, verl's GRPO advantage, each
preset's loss from verl's registry as the trainer composes it). What this study adds:

- **the same tuning budget for every preset**: its shipped clip band scaled by each of ``--widths`` (default
  0.25, 1, 4, 16 and ``inf``, no clip at all), the ratio-space ``clip_ratio_low/high`` or the log-space
  ``log_clip_low/high`` alike (``widen``); the dual clip stays as shipped, and is off with ``inf``;
- **tuning and held-out seeds**: seeds ``0 .. T-1`` (``--tune-seeds``) choose each preset's width per cell and
  task (best mean final reward); seeds ``T .. T+H-1`` (``--held-seeds``: other initial tables, targets and
  samples) judge it, paired by seed against ``grpo`` at its own chosen width;
- **matched KL**: a second choice, the width whose mean KL per update (verl's ``actor/ppo_kl``) on the tuning
  seeds is nearest grpo's at its chosen width, judged the same way;
- **no clip**: every preset with ``inf`` against grpo with ``inf``; a cell *needs a trust region* where grpo at its
  chosen finite width beats unclipped grpo on held-out seeds (95 % interval);
- **alignment vs averaging**: ``maspo_words~shuffled``, the ``words`` rule fed each response's own runs (its
  units) in a random order (the same length histogram, not aligned), against ``maspo_words``;
- **the measured correlation per cell**: lag-1 and VIF(5/15/50) of the drift log-ratios (log pi after a batch's
  updates minus the old log-probs, ``maspo_verl.core.losses``) and VIF over the units, of grpo at its
  chosen width, pooled over its seeds and steps.

Cells (``--cells``): ``L<tokens>/<mismatch>/U<updates per batch>[/lr<Adam lr>]`` (mismatch as in ``regimes``).
Writes ``outputs/lab/regimes_tuned/`` (``--update-docs``: ``docs/results/regimes_tuned/``): ``tuned_runs.csv``
(per seed and width), ``tuned_choice.csv`` (each preset's chosen widths), ``tuned_compare.csv`` (held-out
paired differences), ``tuned_cells.csv`` (per cell: the correlation, grpo's gain, whether a trust region is
needed), README, plot, ``COMMAND.txt``. ``docs/choosing.md`` is generated from them (``maspo_verl.choosing``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from maspo_verl.lab.engine import grid, journal, stats
from maspo_verl.lab.engine.cells import parse_cell
from maspo_verl.lab.engine.common import as_float as _f
from maspo_verl.lab.engine.common import markdown_table, pyplot, write_tables
from maspo_verl.lab.engine.presets import BASELINE, CONTROL, UNCLIPPED, presets_of, widen
from maspo_verl.lab.engine.study import Study
from maspo_verl.lab.engine.tuning import choose

STUDY = Study(
    "regimes_tuned",
    "the regime grid, fair: each preset's clip band tuned (same budget), judged on held-out seeds",
    writes=("README.md", "tuned_choice.csv", "tuned_compare.csv", "tuned_cells.csv", "tuned_vs_grpo.png"),
    cells=("L96/none/U4", "L96/stale2/U4", "L96/noise0.2/U1", "L96/none/U4/lr1", "L96/stale2/U4/lr1", "L384/stale2/U4"),
)

OUT = STUDY.folder
WIDTHS = ("0.25", "1", "4", "16", "inf")
CELLS = STUDY.cells  # the default --cells


def jobs_of(args) -> list[grid.Job]:
    if args.groups * args.group_size % max(parse_cell(c).updates for c in args.cells):
        raise SystemExit("--cells: each U must divide the batch (--groups x --group-size)")
    from maspo_verl.util import preset_names

    presets = presets_of(args.presets or [*preset_names(), CONTROL])
    jobs = []
    for cell in args.cells:
        for task in args.tasks:
            for p in presets:
                for w in args.widths:
                    jobs.append(grid.Job(task=task, preset=widen(p, w), **vars(parse_cell(cell))))
    return sorted(jobs, key=lambda j: -j.length)


# ------------------------------------------------------------------ analysis


def compare(runs: list[dict], choices: list[dict], tune: int) -> list[dict]:
    """Held-out paired differences: each loss vs grpo at their chosen widths (``tuned``), at matched KL
    (``matched_kl``), unclipped (``unclipped``), as shipped (``shipped``, width 1); the control vs maspo_words."""
    held = stats.held(runs, tune)
    pick = {(c["task"], c["cell"], c["loss"]): c for c in choices}
    gain = grpo_gain(runs, choices, tune)
    rows = []
    for c in choices:
        task, cell, loss = c["task"], c["cell"], c["loss"]
        base = pick.get((task, cell, BASELINE))
        if base is None:
            continue
        comparisons = [
            ("tuned", (loss, c["best_band"]), (BASELINE, base["best_band"])),
            ("matched_kl", (loss, c["kl_band"]), (BASELINE, base["best_band"])),
            ("unclipped", (loss, UNCLIPPED), (BASELINE, UNCLIPPED)),
            ("shipped", (loss, "1"), (BASELINE, "1")),
        ]
        if loss == CONTROL and (task, cell, "maspo_words") in pick:
            comparisons.append(
                (
                    "shuffled_vs_aligned",
                    (loss, c["best_band"]),
                    ("maspo_words", pick[(task, cell, "maspo_words")]["best_band"]),
                )
            )
        for name, a, b in comparisons:
            if loss == BASELINE and name != "shuffled_vs_aligned":
                continue
            row = stats.paired(held, task, cell, a, b)
            if not row:
                continue
            g = gain.get((task, cell), float("nan"))
            rows.append(
                {
                    "task": task, "cell": cell, "loss": loss, "comparison": name, "band": a[1], "baseline": b[0],
                    "baseline_band": b[1], **row, "grpo_gain": g,
                    "diff_over_gain": row["diff"] / g if g > 0 else float("nan"),
                }
            )  # fmt: skip
    return stats.with_holm(rows)


def grpo_gain(runs: list[dict], choices: list[dict], tune: int) -> dict[tuple, float]:
    """grpo's held-out gain (final minus first reward, mean over seeds) at its chosen width, per (task, cell)."""
    out = {}
    for c in choices:
        if c["loss"] != BASELINE:
            continue
        mine = [
            _f(r["final_reward"]) - _f(r["first_reward"])
            for r in runs
            if (r["task"], r["cell"], r["loss"], r["band"]) == (c["task"], c["cell"], BASELINE, c["best_band"])
            and int(r["seed"]) >= tune
        ]
        out[(c["task"], c["cell"])] = float(np.mean(mine)) if mine else float("nan")
    return out


def cells_table(runs: list[dict], choices: list[dict], tune: int) -> list[dict]:
    """Per (task, cell): grpo's chosen width, its held-out gain, its drift correlation; whether a trust region is
    needed (grpo at its best finite width minus unclipped grpo, held out)."""
    held = stats.held(runs, tune)
    gain = grpo_gain(runs, choices, tune)
    rows = []
    for c in choices:
        if c["loss"] != BASELINE:
            continue
        task, cell = c["task"], c["cell"]
        mine = [
            r for r in runs if (r["task"], r["cell"], r["loss"], r["band"]) == (task, cell, BASELINE, c["best_band"])
        ]
        tuning: dict[str, list[float]] = {}  # grpo's finite widths in this cell: final rewards on the tuning seeds
        for r in runs:
            if (
                (r["task"], r["cell"], r["loss"]) == (task, cell, BASELINE)
                and r["band"] != UNCLIPPED
                and int(r["seed"]) < tune
            ):
                tuning.setdefault(r["band"], []).append(_f(r["final_reward"]))
        finite = [(float(np.mean(v)), w) for w, v in tuning.items()]
        trust = stats.paired(held, task, cell, (BASELINE, max(finite)[1]), (BASELINE, UNCLIPPED)) if finite else {}
        unclipped = [
            r for r in runs if (r["task"], r["cell"], r["loss"], r["band"]) == (task, cell, BASELINE, UNCLIPPED)
        ]
        rows.append(
            {
                "task": task,
                "cell": cell,
                "grpo_band": c["best_band"],
                "grpo_gain": gain.get((task, cell), float("nan")),
                "grpo_final": float(np.mean([_f(r["final_reward"]) for r in mine if int(r["seed"]) >= tune])),
                **{
                    k: _f(mine[0][k]) if mine else float("nan")
                    for k in grid.drift_metrics(None) | grid.drift_metrics(None, "seen_")
                },
                **grid.null_correlation(int(mine[0]["length"]) if mine else 1),
                "clip_minus_noclip": trust.get("diff", float("nan")),
                "clip_minus_noclip_low": trust.get("low", float("nan")),
                "clip_minus_noclip_high": trust.get("high", float("nan")),
                "trust_region_needed": bool(trust.get("supported") and trust["diff"] > 0),
                "unclipped_collapses": sum(str(r["collapse"]) == "True" for r in unclipped),
                "runs": len(unclipped),
            }
        )
    return rows


# ------------------------------------------------------------------ the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "The regime grid with a fair protocol: each preset's clip band scaled by the same --widths (inf: no clip), "
        "chosen per cell on --tune-seeds, judged on --held-seeds against grpo at its own chosen width; matched-KL "
        "and unclipped comparisons; a shuffled-runs control of maspo_words; the drift log-ratios' lag-1 and VIF."
    )
    p.add_argument("--tasks", nargs="+", default=list(grid.TASKS), choices=grid.TASKS)
    p.add_argument("--cells", nargs="+", default=list(CELLS), help="L<tokens>/<mismatch>/U<updates>[/lr<lr>]")
    p.add_argument(
        "--presets", nargs="+", default=None, help=f"loss presets (and {CONTROL}; default: every preset and it)"
    )
    p.add_argument("--widths", nargs="+", default=list(WIDTHS), choices=list(WIDTHS), help="band scales (inf: no clip)")
    p.add_argument("--tune-seeds", type=int, default=20, help="seeds 0..N-1 choose the widths")
    p.add_argument("--held-seeds", type=int, default=20, help="the next N seeds judge them")
    grid.engine_arguments(p, "Adam learning rate (a cell's /lr<x> replaces it)")
    p.add_argument("--report", action="store_true", help="only rebuild the README and tables from --out's runs")
    p.add_argument(
        "--redo",
        nargs="+",
        default=None,
        help="re-run only these presets' jobs and replace their rows in --out's tuned_runs.csv (same seeds and cells; "
        "recorded in COMMAND.txt)",
    )


def run(args: argparse.Namespace, argv: list[str]) -> None:

    out = Path(args.out)
    if args.report:
        return report(out, args)
    if "inf" not in args.widths or "1" not in args.widths:
        raise SystemExit("--widths: include 1 (as shipped) and inf (no clip), the comparisons need both")
    kept = []
    if args.redo:  # the other presets' runs stay; the command that re-made these is recorded under the first
        kept = [r for r in _read_runs(out) if r["loss"] not in args.redo]
        journal.again(out, argv, "re-ran (--redo)")
    else:
        journal.start(out, argv)
    jobs = [j for j in jobs_of(args) if not args.redo or j.preset.name in args.redo]
    args.seeds = args.tune_seeds + args.held_seeds
    grid.run_jobs(jobs, args, out, "tuned_runs.csv", kept=kept)
    report(out, args)


def _read_runs(out: Path) -> list[dict]:
    import csv

    with open(out / "tuned_runs.csv", newline="") as f:
        return list(csv.DictReader(f))


def report(out: Path, args) -> None:
    from maspo_verl.lab.engine import common

    runs = _read_runs(out)
    choices = choose(runs, args.tune_seeds)
    rows, cells = compare(runs, choices, args.tune_seeds), cells_table(runs, choices, args.tune_seeds)
    write(out, args, runs, choices, rows, cells)
    common.report_written(out)


# ------------------------------------------------------------------ report
COMPARISONS = (
    ("tuned", "each at its width chosen on the tuning seeds"),
    ("matched_kl", "the preset at the width whose KL per update is nearest grpo's (grpo at its chosen width)"),
    ("unclipped", "both unclipped"),
    ("shipped", "both as shipped (width 1)"),
    ("shuffled_vs_aligned", f"`{CONTROL}` (runs shuffled) minus `maspo_words` (runs), each at its chosen width"),
)


def _mark(r: dict) -> str:
    d = float(r["diff"])
    text = f"{d:+.3f} [{float(r['low']):+.3f}, {float(r['high']):+.3f}]"
    if r["supported"] in (True, "True"):
        text = f"**{text}**" + ("‡" if r["supported_holm"] in (True, "True") else "")
    return text


def plot(rows: list[dict], path: Path) -> None:
    tuned = [r for r in rows if r["comparison"] == "tuned"]
    if not tuned:
        return
    plt = pyplot()
    keys = sorted({(r["task"], r["cell"]) for r in tuned})
    losses = sorted({r["loss"] for r in tuned})
    fig, ax = plt.subplots(figsize=(1.2 + 1.6 * len(keys), 3.8))
    w = 0.8 / max(len(losses), 1)
    for i, loss in enumerate(losses):
        xs, ys, lo, hi = [], [], [], []
        for k, key in enumerate(keys):
            r = next((r for r in tuned if (r["task"], r["cell"], r["loss"]) == (*key, loss)), None)
            if r is None:
                continue
            xs.append(k + (i - (len(losses) - 1) / 2) * w)
            ys.append(float(r["diff"]))
            lo.append(float(r["diff"]) - float(r["low"]))
            hi.append(float(r["high"]) - float(r["diff"]))
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", ms=4, capsize=2, label=loss)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xticks(range(len(keys)), [f"{t[0].upper()} {c}" for t, c in keys], rotation=20, ha="right")
    ax.set_ylabel("held-out final reward - grpo's (tuned bands)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, args, runs: list[dict], choices: list[dict], rows: list[dict], cells: list[dict]) -> None:
    """The tables, plot and README from the runs and ``regimes_tuned``'s choice, comparisons and cells."""
    write_tables(out, {"tuned_choice.csv": choices, "tuned_compare.csv": rows, "tuned_cells.csv": cells})
    plot(rows, out / "tuned_vs_grpo.png")
    (out / "README.md").write_text(readme(args, runs, choices, rows, cells, journal.read(out)))


def readme(args, runs, choices, rows, cells, command) -> str:
    seeds = sorted({int(r["seed"]) for r in runs})
    held = [s for s in seeds if s >= args.tune_seeds]
    widths = sorted({r["band"] for r in runs}, key=lambda w: float(w))
    lines = [
        "# The regime grid with tuned clip bands, judged on held-out seeds",
        "",
        f"Made by the command in `COMMAND.txt` (`python -m maspo_verl.lab regimes_tuned`, engine "
        "`maspo_verl/lab/studies/regimes_tuned.py` on `maspo_verl/lab/studies/regimes.py`): "
        f"{len(runs)} runs. Every preset's "
        f"shipped clip band scaled by each of {', '.join(widths)} (inf: no clip), the same budget for each; the "
        f"width chosen per cell on tuning seeds 0-{args.tune_seeds - 1} (best mean final reward), judged on "
        f"held-out seeds {held[0] if held else '-'}-{held[-1] if held else '-'} (other tables, targets and "
        "samples), paired by seed against grpo at its own chosen width. Intervals: 95 % t-interval over held-out "
        "seeds; **bold** excludes 0, ‡ also significant after Holm's correction (exact sign-flip p over the held-out "
        "seeds, adjusted within each table below).",
        "",
        "The policy is a per-position logit table (no shared parameters); its log-ratios still move together "
        "where the same responses pull neighbouring entries (runs of one symbol share their advantage): read the "
        "VIF columns against `null_*`, the same measure of independent log-ratios, before reading any gap as a "
        "granularity effect.",
        "",
        "```",
        command.strip(),
        "```",
        "",
        "## Per cell: grpo, the measured correlation, and whether a trust region is needed",
        "",
        "`drift_*`: lag-1 and VIF(n) of log pi after each batch's updates minus the old log-probs (grpo at its "
        "chosen width, pooled over seeds and steps; 1 = independent); `drift_vif_units`: over the target's "
        "units (runs of one symbol). `clip_minus_noclip`: grpo at its best finite width minus unclipped grpo "
        "(held out); a trust region is needed where that is above 0.",
        "",
        markdown_table(cells),
    ]
    for name, what in COMPARISONS:
        mine = [r for r in rows if r["comparison"] == name]
        if not mine:
            continue
        table = [
            {
                "task": r["task"],
                "cell": r["cell"],
                "loss": r["loss"],
                "width": r["band"],
                "vs": f"{r['baseline']} x{r['baseline_band']}",
                "diff [95 %]": _mark(r),
                "/ grpo's gain": float(r["diff_over_gain"]),
                "seeds": r["seeds"],
            }
            for r in mine
        ]
        lines += [f"## {name}: {what}", "", markdown_table(table)]
    chosen = {}
    for c in choices:
        chosen.setdefault(c["loss"], []).append(c["best_band"])
    lines += [
        "## The widths chosen on the tuning seeds",
        "",
        *(
            f"- `{loss}`: " + ", ".join(f"x{w} {b.count(w)}" for w in sorted(set(b), key=float))
            for loss, b in sorted(chosen.items())
        ),
        "",
        "Per cell and width: `tuned_choice.csv`; every run: `tuned_runs.csv`.",
        "",
        "![held-out differences vs grpo](tuned_vs_grpo.png)",
        "",
    ]
    n_sup = sum(r["supported"] in (True, "True") for r in rows if r["comparison"] == "tuned")
    n_all = sum(r["comparison"] == "tuned" for r in rows)
    lines.insert(4, f"Tuned comparisons whose 95 % held-out interval excludes 0: {n_sup} of {n_all}.\n")
    return "\n".join(lines)
