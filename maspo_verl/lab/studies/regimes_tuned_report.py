"""Tables, plot and README of ``python -m maspo_verl.lab regimes_tuned`` from its per-seed runs.

``tuned_compare.csv`` and ``tuned_cells.csv`` are what ``docs/choosing.md`` is generated from
(``maspo_verl.choosing``).
"""

from __future__ import annotations

from pathlib import Path

from maspo_verl.lab.engine import journal
from maspo_verl.lab.engine.common import markdown_table, pyplot, write_tables
from maspo_verl.lab.engine.grid import CONTROL

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
