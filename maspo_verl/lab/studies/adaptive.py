"""Does ``maspo_adaptive`` hold its own against the best fixed window, untuned? ``python -m maspo_verl.lab adaptive``.

Reads finished runs and writes the comparison (no training here):

- ``--grid``: a ``regimes_tuned`` folder (its ``tuned_runs.csv``) that ran ``grpo``, ``maspo_adaptive`` (and any
  variants ``maspo_adaptive@<field>=<value>``, e.g. the other criterion, each judged the same way) and fixed
  windows ``maspo_fixed@segment_window=<W>``. Each preset's clip band is chosen per cell on the tuning seeds
  (``tuning.choose``: the same width budget for every preset); the best fixed window of a cell is the one
  whose chosen band has the best tuning mean; adaptive, at its own chosen band and with its shipped settings (no
  tuning of its length), is judged against that window and against grpo on the held-out seeds, paired by seed
  (``stats.paired``: 95 % t-interval, sign-flip p). *Within the interval* means the 95 % interval of
  adaptive minus the best fixed window contains 0 or lies above it.
- ``--warm`` (optional): a ``lab learn`` folder on the warm-started speech model (``learn_runs.csv``) holding
  grpo, the adaptive presets and fixed windows, with a subfolder ``--warm-tuning`` of fixed windows run on other
  seeds: the best window W* is the one with the best mean final reward there (ties: the shorter); each adaptive
  variant's final reward minus W*'s and minus grpo's, paired by seed, 95 % t-interval, exact sign-flip p.
- ``--smollm2`` (optional): a ``smollm2`` folder whose ``gradient.csv`` holds the same presets: the gradient
  quality (cosine to the on-policy GRPO gradient, relative variance) per mismatch, with the lengths adaptive chose.

Writes to ``--out``: ``grid.csv`` (per cell), ``warm.csv``, ``smollm2.csv``, ``adaptive_vs_fixed.png``, README.md,
COMMAND.txt.
``docs/choosing.md`` shows the grid table (``maspo_verl.choosing``).
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import numpy as np

from maspo_verl.lab.engine import journal, stats
from maspo_verl.lab.engine.common import finite_mean, markdown_table, number, read_csv, write_csv
from maspo_verl.lab.engine.study import Study

STUDY = Study(
    "adaptive",
    "maspo_adaptive (untuned) against the best fixed window per cell, from a regimes_tuned and a smollm2 run",
    writes=("README.md", "grid.csv", "warm.csv", "smollm2.csv", "adaptive_vs_fixed.png"),
    reads_only=True,
)

OUT = STUDY.folder
ADAPTIVE = "maspo_adaptive"
FIXED = "maspo_fixed@segment_window="


def _rows(path: Path) -> list[dict]:
    rows = read_csv(path)
    if not rows:
        raise SystemExit(f"lab adaptive: {path} is missing or holds no rows")
    return rows


def window_of(loss: str) -> int | None:
    return int(loss[len(FIXED) :]) if loss.startswith(FIXED) else None


def is_adaptive(loss: str) -> bool:
    """The shipped preset or one of its variants (``maspo_adaptive@...``)."""
    return loss == ADAPTIVE or loss.startswith(ADAPTIVE + "@")


def label(loss: str) -> str:
    """How a table names an adaptive variant: "as shipped", or its changed fields."""
    return "as shipped" if loss == ADAPTIVE else loss.partition("@")[2]


def grid_rows(runs: list[dict], tune: int) -> list[dict]:
    """Per (task, cell) and adaptive variant: the best fixed window (tuning seeds), the variant's held-out
    difference to it and to grpo, and the lengths it chose (mean over its runs at its chosen band)."""
    from maspo_verl.lab.engine.presets import BASELINE
    from maspo_verl.lab.engine.tuning import choose

    choices = choose(runs, tune)
    pick = {(c["task"], c["cell"], c["loss"]): c for c in choices}
    held = stats.held(runs, tune)
    out = []
    variants = sorted({c["loss"] for c in choices if is_adaptive(c["loss"])}, key=lambda n: (n != ADAPTIVE, n))
    for (task, cell), name in itertools.product(sorted({(c["task"], c["cell"]) for c in choices}), variants):
        fixed = [c for c in choices if (c["task"], c["cell"]) == (task, cell) and window_of(c["loss"])]
        own, base = pick.get((task, cell, name)), pick.get((task, cell, BASELINE))
        if not fixed or own is None or base is None:
            continue
        best = max(fixed, key=lambda c: (c["tune_final"], -window_of(c["loss"])))  # ties: the shorter window
        mine = (name, own["best_band"])
        vs_fixed = stats.paired(held, task, cell, mine, (best["loss"], best["best_band"]))
        vs_grpo = stats.paired(held, task, cell, mine, (BASELINE, base["best_band"]))
        fixed_vs_grpo = stats.paired(held, task, cell, (best["loss"], best["best_band"]), (BASELINE, base["best_band"]))
        at_band = [
            r for r in runs if (r["task"], r["cell"], r["loss"], r["band"]) == (task, cell, name, own["best_band"])
        ]
        grpo_runs = [
            r for r in runs if (r["task"], r["cell"], r["loss"], r["band"]) == (task, cell, BASELINE, base["best_band"])
        ]
        out.append(
            {
                "task": task,
                "cell": cell,
                "adaptive": name,
                "best_window": window_of(best["loss"]),
                "best_window_band": best["best_band"],
                "adaptive_band": own["best_band"],
                "adaptive_len": finite_mean(r.get("adaptive_len") for r in at_band),
                "adaptive_vif": finite_mean(r.get("adaptive_vif") for r in at_band),
                "adaptive_bias": finite_mean(r.get("adaptive_bias") for r in at_band),
                "drift_vif15": finite_mean(r.get("drift_vif15") for r in grpo_runs),
                "vs_fixed": vs_fixed.get("diff", math.nan),
                "vs_fixed_low": vs_fixed.get("low", math.nan),
                "vs_fixed_high": vs_fixed.get("high", math.nan),
                "within": bool(vs_fixed) and vs_fixed["high"] >= 0,
                "vs_grpo": vs_grpo.get("diff", math.nan),
                "vs_grpo_low": vs_grpo.get("low", math.nan),
                "vs_grpo_high": vs_grpo.get("high", math.nan),
                "fixed_vs_grpo": fixed_vs_grpo.get("diff", math.nan),
                "fixed_vs_grpo_low": fixed_vs_grpo.get("low", math.nan),
                "fixed_vs_grpo_high": fixed_vs_grpo.get("high", math.nan),
                "seeds": vs_fixed.get("seeds", 0),
            }
        )
    return out


def _final(runs: list[dict], loss: str) -> dict[str, float]:
    """{seed: final reward} of a loss's finished runs."""
    return {r["seed"]: float(r["final_reward"]) for r in runs if r["loss"] == loss and r.get("ok") == "True"}


def best_window(tuning: list[dict]) -> str:
    """The fixed window with the best mean final reward on the tuning seeds (ties: the shorter window)."""
    windows = {r["loss"] for r in tuning if window_of(r["loss"])}
    if not windows:
        raise SystemExit("lab adaptive --warm: the tuning runs hold no maspo_fixed@segment_window=<W>")
    return max(windows, key=lambda w: (np.mean(list(_final(tuning, w).values()) or [-math.inf]), -window_of(w)))


def warm_rows(runs: list[dict], tuning: list[dict]) -> list[dict]:
    """Per adaptive variant in ``runs``: its final reward minus the best window's (chosen on ``tuning``) and minus
    grpo's, paired by seed (95 % t-interval, exact sign-flip p), and its mean chosen length."""
    from maspo_verl.lab.engine import stats
    from maspo_verl.lab.engine.presets import BASELINE

    best = best_window(tuning)
    out = []
    for name in sorted({r["loss"] for r in runs if is_adaptive(r["loss"])}, key=lambda n: (n != ADAPTIVE, n)):
        mine = _final(runs, name)
        row = {"adaptive": name, "best_window": window_of(best), "seeds": len(mine)}
        for key, other in (("vs_fixed", best), ("vs_grpo", BASELINE)):
            theirs = _final(runs, other)
            test = stats.paired_summary([mine[s] - theirs[s] for s in sorted(set(mine) & set(theirs))])
            row[key], row[f"{key}_low"], row[f"{key}_high"] = test["diff"], test["low"], test["high"]
            row[f"{key}_p"] = test["p_signflip"]
        row["within"] = row["vs_fixed_high"] >= 0
        row["adaptive_len"] = finite_mean(r.get("actor/ratio/adaptive_len") for r in runs if r["loss"] == name)
        out.append(row)
    return out


def smollm2_rows(path: Path) -> list[dict]:
    keep = ("mismatch", "preset", "clipfrac", "cos_mean", "cos_sd", "rel_var", "segment_len", "adaptive_len")
    shown = [r for r in _rows(path) if r.get("preset", "").startswith(("grpo", ADAPTIVE, "maspo_fixed"))]
    return [{k: r.get(k, "") for k in keep} for r in shown]


def plot(out: Path, rows: list[dict]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    x = np.arange(len(rows))
    for k, (key, legend) in enumerate(
        [
            ("vs_fixed", "adaptive − best fixed window"),
            ("vs_grpo", "adaptive − grpo"),
            ("fixed_vs_grpo", "best fixed − grpo"),
        ]
    ):
        mid = np.array([r[key] for r in rows])
        err = np.array([[r[key] - r[f"{key}_low"] for r in rows], [r[f"{key}_high"] - r[key] for r in rows]])
        ax.errorbar(x + (k - 1) * 0.2, mid, yerr=err, fmt="o", capsize=3, label=legend)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(x, [f"{r['cell']}\n{label(r['adaptive'])}\n(W*={r['best_window']})" for r in rows], fontsize=6)
    ax.set_ylabel("held-out final reward difference")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "adaptive_vs_fixed.png", dpi=120)
    plt.close(fig)
    return "adaptive_vs_fixed.png"


GRID_KEYS = (
    "cell", "adaptive", "best_window", "best_window_band", "adaptive_band", "adaptive_len", "adaptive_vif",
    "adaptive_bias", "drift_vif15",
    "vs_fixed", "vs_fixed_low", "vs_fixed_high", "within", "vs_grpo", "vs_grpo_low", "vs_grpo_high",
)  # fmt: skip


def run(args: argparse.Namespace, argv: list[str]) -> None:
    out = journal.start(args.out, argv)
    grid_dir = Path(args.grid)
    runs = _rows(grid_dir / "tuned_runs.csv")
    rows = grid_rows(runs, args.tune_seeds)
    write_csv(out / "grid.csv", rows)
    figure = plot(out, rows) if rows else None
    lines = [
        "# Adaptive segment length against the best fixed window, untuned",
        "",
        f"Made by `COMMAND.txt` from the `regimes_tuned` run in `{args.grid_name or grid_dir.name}/` "
        f"(its command, machine and time in its `COMMAND.txt`). Every preset's clip band is chosen per cell on tuning "
        f"seeds 0-{args.tune_seeds - 1}; the best fixed window W* per cell is the `maspo_fixed@segment_window=W` "
        "with the best tuning mean at its chosen band; `maspo_adaptive` (band criterion) and its variants run with "
        "their shipped length settings at their own chosen band. No length knob is tuned, but the band criterion "
        "reads the band, so tuning its band tunes its lengths (x k on the band: n up to x k^2; `inf`: the longest "
        "window). Held-out seeds reused: these held-out seeds (and the warm model's 0-4 and SmolLM2's seed 1 below) "
        "had judged the correlation criterion before the band criterion was written, so for the band criterion "
        "they were a validation set, not a fresh test (that is `granularity/`'s pre-registered H3). Differences of "
        "final reward on the held-out seeds, paired by seed, with 95 % t-intervals and sign-flip p. *within*: "
        "adaptive's interval against W* reaches 0 or above.",
        "",
        markdown_table([{k: r[k] for k in GRID_KEYS} for r in rows], GRID_KEYS),
    ]
    for name in dict.fromkeys(r["adaptive"] for r in rows):
        mine = [r for r in rows if r["adaptive"] == name]
        within = sum(r["within"] for r in mine)
        lines += [
            f"`{name}` ({label(name)}) is within the best fixed window's interval in {within} of {len(mine)} cells; "
            "the cells where it is not: " + (", ".join(r["cell"] for r in mine if not r["within"]) or "none") + ". "
            f"Its mean chosen length over the cells is {finite_mean(r['adaptive_len'] for r in mine):.2f} tokens, its "
            f"mean measured VIF(M) {finite_mean(r['adaptive_vif'] for r in mine):.2f} (drift VIF(15) column: grpo's "
            "drift log-ratios per cell; 1 = independent).",
            "",
        ]
    if figure:
        lines += [f"![adaptive vs fixed]({figure})", ""]
    if args.warm:
        warm_dir = Path(args.warm)
        tuning = _rows(warm_dir / args.warm_tuning / "learn_runs.csv")
        warm = warm_rows(_rows(warm_dir / "learn_runs.csv"), tuning)
        write_csv(out / "warm.csv", warm)
        seeds = sorted({int(r["seed"]) for r in tuning})
        lines += [
            "## The warm-started speech model in verl's trainer",
            "",
            f"From the `lab learn` run in `{args.warm_name or args.warm}/` (its `COMMAND.txt`; each preset at its "
            "band tuned in the grid's cell L96/stale2/U4): the best fixed window W* chosen on tuning seeds "
            f"{', '.join(map(str, seeds))} (`{args.warm_tuning}/`, the fixed windows at their grid bands), then "
            "every adaptive variant's final reward minus W*'s and minus grpo's on the held-out seeds, paired by "
            "seed, 95 % t-interval, exact sign-flip p; `adaptive_len` its mean chosen length.",
            "",
            markdown_table(warm, WARM_KEYS),
        ]
    if args.smollm2:
        sm = smollm2_rows(Path(args.smollm2) / "gradient.csv")
        write_csv(out / "smollm2.csv", sm)
        lines += [
            "## SmolLM2-135M gradient quality",
            "",
            f"From the `smollm2` run in `{args.smollm2_name or args.smollm2}/` (its `COMMAND.txt`): each preset's "
            "band calibrated to the same clip fraction, cosine of its policy gradient to the on-policy GRPO "
            "gradient of the whole batch over resampled half-batches (mean, sd) and relative variance; "
            "`segment_len` and `adaptive_len` "
            "are the loss's mean segment length and adaptive's mean chosen n on the whole batch.",
            "",
            markdown_table([{k: number(v) for k, v in r.items()} for r in sm]),
        ]
    (out / "README.md").write_text("\n".join(lines) + "\n")


WARM_KEYS = (
    "adaptive", "best_window", "seeds", "adaptive_len", "vs_fixed", "vs_fixed_low", "vs_fixed_high", "vs_fixed_p",
    "within", "vs_grpo", "vs_grpo_low", "vs_grpo_high", "vs_grpo_p",
)  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grid", required=True, help="a regimes_tuned output folder with maspo_adaptive and fixed windows")
    p.add_argument("--grid-name", default=None, help="how the README names the grid folder")
    p.add_argument("--tune-seeds", type=int, default=16, help="the grid's --tune-seeds")
    p.add_argument("--warm", default=None, help="a lab learn folder on the warm-started model (speechwarm)")
    p.add_argument("--warm-name", default=None, help="how the README names the warm folder")
    p.add_argument("--warm-tuning", default="windows_tuning", help="its subfolder of fixed windows on tuning seeds")
    p.add_argument("--smollm2", default=None, help="a smollm2 output folder whose gradient.csv holds the presets")
    p.add_argument("--smollm2-name", default=None, help="how the README names the smollm2 folder")
