"""The regime grid: every loss preset on long, correlated responses under a real rollout mismatch, on the grid's
engine (``maspo_verl.lab.engine.grid``: its tasks, mismatches and per-run measures).

Per run: final reward (last ``--last`` steps), reward AUC (mean over all steps), steps to step 0's reward +
``--gain`` (3-step moving average; not reached: steps + 1), collapse (non-finite loss or gradient, or the
final reward ``COLLAPSE_DROP`` below the best 3-step average), the gradient norm of the seed's table (mean over
updates), verl's ``actor/pg_clipfrac`` (per cell and step, a mean over the seeds of the call) (``grid``). Paired
(same-seed, same initial table and target) t-intervals and sign-flip tests (Holm within each metric) of each
preset minus ``grpo``.

Writes ``outputs/lab/regimes/`` (``--update-docs``: ``docs/results/regimes/``): README, ``regimes_runs.csv``
(per seed), ``regimes_curves.csv`` (per step, mean over seeds), ``regimes_summary.csv``,
``regimes_compare.csv`` (paired differences vs grpo), ``regimes_mismatch.csv`` (log-ratio spreads),
``regimes_skipped.csv``, plots, ``COMMAND.txt``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from maspo_verl.lab.engine import journal, stats
from maspo_verl.lab.engine.cells import parse_mismatch
from maspo_verl.lab.engine.common import as_float, markdown_table, pyplot, read_csv, write_tables
from maspo_verl.lab.engine.grid import TASKS, Job, engine_arguments, probe, run_jobs
from maspo_verl.lab.engine.presets import Preset, discover_presets
from maspo_verl.lab.engine.stats import mean_interval
from maspo_verl.lab.engine.study import Study

STUDY = Study(
    "regimes",
    "fast grid: every loss preset x length x rollout mismatch x updates per batch, 20+ seeds, vs grpo",
    writes=(
        "README.md",
        "regimes_summary.csv",
        "regimes_compare.csv",
        "regimes_mismatch.csv",
        "regimes_curves.png",
        "regimes_auc_vs_grpo.png",
        "regimes_final_vs_grpo.png",
    ),
)
MISMATCHES = ("none", "bf16", "stale2", "noise0.2")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "The regime grid: tasks x lengths x mismatch x updates per batch x every loss preset "
        "(hydra_configs/loss/*.yaml, composed as the trainer composes them), --seeds seeds each, paired "
        "t-intervals vs grpo. Mismatch: none | bf16 | fp16 (rollout table rounded) | stale<K> (rollout K "
        "updates behind) | noise<SIGMA> (Gaussian noise on the reported log-probs)."
    )
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--lengths", nargs="+", type=int, default=[16, 96, 384], help="response tokens")
    p.add_argument(
        "--mismatch",
        nargs="+",
        default=list(MISMATCHES),
        help="none | bf16 | fp16 | stale<K> | noise<SIGMA> (rollout vs trained policy; old log-probs = rollout's)",
    )
    p.add_argument("--updates", nargs="+", type=int, default=[1, 4], help="optimizer updates (mini-batches) per batch")
    p.add_argument("--presets", nargs="+", default=None, help="loss presets (default: every hydra_configs/loss/*.yaml)")
    p.add_argument("--seeds", type=int, default=20, help="seeds per cell (initial table and target)")
    engine_arguments(p)
    p.add_argument("--report", action="store_true", help="only rebuild the README, tables and plots from --out's CSVs")


def jobs_of(args, presets: list[Preset]) -> list[Job]:
    for m in args.mismatch:
        parse_mismatch(m)
    for u in args.updates:
        if u < 1 or (args.groups * args.group_size) % u:
            raise SystemExit(f"--updates {u}: must divide the batch ({args.groups} x {args.group_size})")
    if min(args.lengths) < 3:
        raise SystemExit("--lengths: at least 3 tokens")
    # longest first: the pool's last jobs are short
    return [
        Job(task, length, m, u, p)
        for length in sorted(args.lengths, reverse=True)
        for task in args.tasks
        for u in sorted(args.updates, reverse=True)
        for m in args.mismatch
        for p in presets
    ]


def run(args: argparse.Namespace, argv: list[str]) -> None:
    from maspo_verl.lab.engine import common

    out = Path(args.out)
    if args.report:  # the tables and README again from the CSVs in --out
        return _report(out, args)
    journal.start(out, argv)
    presets = discover_presets(args.presets)
    skipped, runnable = [], {}
    for task in args.tasks:
        for p in presets:
            why = probe(p, task)
            if why:
                skipped.append({"task": task, "loss": p.name, "reason": why})
                common.log(f"regimes: skipped {p.name} on {task}: {why}")
            else:
                runnable.setdefault(task, []).append(p)
    common.write_csv(out / "regimes_skipped.csv", skipped or [{"task": "", "loss": "", "reason": ""}])
    jobs = [j for j in jobs_of(args, presets) if j.preset in runnable.get(j.task, [])]
    run_jobs(jobs, args, out, "regimes_runs.csv", "regimes_curves.csv")
    _report(out, args)


def _report(out: Path, args) -> None:
    from maspo_verl.lab.engine import common

    write(out, args)
    common.report_written(out)


# ------------------------------------------------------------------ report
BASELINE = "grpo"
METRICS = ("final_reward", "auc", "steps_to_target_c")  # compared with grpo, paired by seed
COMPARE_COLUMNS = (
    "task",
    "cell",
    "length",
    "mismatch",
    "updates",
    "loss",
    "metric",
    "seeds",
    "diff",
    "low",
    "high",
    "p_signflip",
    "p_holm",
    "supported",
    "supported_holm",
)


def _cells(runs: list[dict]) -> list[tuple]:
    """(task, cell, length, mismatch, updates) in the order of the grid."""
    seen = {}
    for r in runs:
        seen.setdefault(
            (r["task"], r["cell"]), (r["task"], r["cell"], int(r["length"]), r["mismatch"], int(r["updates"]))
        )
    return sorted(seen.values(), key=lambda c: (c[0], c[2], c[4], c[3]))


def _losses(runs: list[dict]) -> list[str]:
    names = sorted({r["loss"] for r in runs})
    return sorted(names, key=lambda n: (n != BASELINE, n))


def summarise(runs: list[dict]) -> list[dict]:
    out = []
    for task, cell, *_ in _cells(runs):
        for loss in _losses(runs):
            mine = [r for r in runs if (r["task"], r["cell"], r["loss"]) == (task, cell, loss)]
            if not mine:
                continue
            row = {"task": task, "cell": cell, "loss": loss, "seeds": len(mine)}
            for key in ("final_reward", "auc", "steps_to_target_c"):
                m, lo, hi = mean_interval([as_float(r[key]) for r in mine])
                row[key] = (
                    f"{m:.3f} [{lo:.3f}, {hi:.3f}]" if key != "steps_to_target_c" else f"{m:.1f} [{lo:.1f}, {hi:.1f}]"
                )
            row["reached"] = f"{sum(r['steps_to_target'] not in ('', None) for r in mine)}/{len(mine)}"
            row["collapses"] = sum(r["collapse"] == "True" for r in mine)
            row["clipfrac"] = float(np.mean([as_float(r["clipfrac"]) for r in mine]))
            row["grad_norm"] = float(np.mean([as_float(r["grad_norm"]) for r in mine]))
            row["logratio_sd"] = float(np.mean([as_float(r["logratio_sd"]) for r in mine]))
            out.append(row)
    return out


def compare(runs: list[dict]) -> list[dict]:
    """Each preset minus grpo in the same cell, paired by seed: mean, 95 % t-interval (*supported*: excludes 0),
    sign-flip p and its Holm adjustment over every comparison of the metric (*supported_holm*: below 0.05)."""
    by = {(r["task"], r["cell"], r["loss"], r["seed"]): r for r in runs}
    rows = []
    for task, cell, length, mismatch, updates in _cells(runs):
        for loss in _losses(runs):
            if loss == BASELINE:
                continue
            seeds = sorted(
                {int(r["seed"]) for r in runs if (r["task"], r["cell"], r["loss"]) == (task, cell, loss)}
                & {int(r["seed"]) for r in runs if (r["task"], r["cell"], r["loss"]) == (task, cell, BASELINE)}
            )
            if len(seeds) < 2:
                continue
            for metric in METRICS:
                d = np.array(
                    [
                        as_float(by[(task, cell, loss, str(s))][metric])
                        - as_float(by[(task, cell, BASELINE, str(s))][metric])
                        for s in seeds
                    ]
                )
                d = d[np.isfinite(d)]
                if d.size < 2:
                    continue
                test = stats.paired_summary(d)
                lo, hi = test["low"], test["high"]
                rows.append(
                    {
                        "task": task,
                        "cell": cell,
                        "length": length,
                        "mismatch": mismatch,
                        "updates": updates,
                        "loss": loss,
                        "metric": metric,
                        "seeds": int(d.size),
                        "diff": float(d.mean()),
                        "low": lo,
                        "high": hi,
                        "p_signflip": test["p_signflip"],
                        "supported": bool(lo > 0 or hi < 0),
                    }
                )
    for metric in METRICS:
        mine = [r for r in rows if r["metric"] == metric]
        for r, p in zip(mine, stats.holm([r["p_signflip"] for r in mine]), strict=True):
            r["p_holm"], r["supported_holm"] = p, p < 0.05
    return [{k: r[k] for k in COMPARE_COLUMNS} for r in rows]


def mismatch_table(runs: list[dict]) -> list[dict]:
    """The measured token-level log-ratio spread (sd of log pi_theta - old log-prob at each batch's first
    update) per condition, grpo's runs, mean over seeds and steps."""
    out = {}
    for r in runs:
        if r["loss"] != BASELINE:
            continue
        key = (r["task"], r["mismatch"], int(r["length"]), int(r["updates"]))
        out.setdefault(key, []).append(as_float(r["logratio_sd"]))
    rows = []
    for (task, mismatch, length, updates), v in sorted(
        out.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3])
    ):
        rows.append(
            {"task": task, "mismatch": mismatch, "length": length, "updates": updates, "logratio_sd": float(np.mean(v))}
        )
    return rows


def _fmt(c: dict) -> str:
    return f"{c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"


def statements(comparisons: list[dict], metric: str) -> list[str]:
    """Cell by cell: the presets whose paired difference in ``metric`` excludes 0 (** also after Holm)."""
    lines = []
    cells = dict.fromkeys((c["task"], c["cell"]) for c in comparisons)
    for task, cell in cells:
        rows = [c for c in comparisons if (c["task"], c["cell"], c["metric"]) == (task, cell, metric)]
        up = [
            f"{c['loss']} {_fmt(c)}{'**' if c['supported_holm'] else ''}"
            for c in rows
            if c["supported"] and c["diff"] > 0
        ]
        down = [
            f"{c['loss']} {_fmt(c)}{'**' if c['supported_holm'] else ''}"
            for c in rows
            if c["supported"] and c["diff"] < 0
        ]
        if not up and not down:
            lines.append(f"- {task} {cell}: no difference supported")
            continue
        text = f"- {task} {cell}:"
        if up:
            text += " above grpo: " + "; ".join(up) + "."
        if down:
            text += " below grpo: " + "; ".join(down) + "."
        lines.append(text)
    return lines


def plot_heatmap(comparisons: list[dict], metric: str, path: Path) -> None:
    plt = pyplot()
    tasks = list(dict.fromkeys(c["task"] for c in comparisons))
    losses = sorted({c["loss"] for c in comparisons})
    fig, axes = plt.subplots(len(tasks), 1, figsize=(16, 3.2 * len(tasks) + 1), squeeze=False)
    for ax, task in zip(axes[:, 0], tasks, strict=True):
        rows = [c for c in comparisons if c["task"] == task and c["metric"] == metric]
        cells = sorted({(c["length"], c["updates"], c["mismatch"], c["cell"]) for c in rows})
        grid = np.full((len(losses), len(cells)), np.nan)
        for c in rows:
            grid[losses.index(c["loss"]), cells.index((c["length"], c["updates"], c["mismatch"], c["cell"]))] = c[
                "diff"
            ]
        lim = np.nanmax(np.abs(grid)) if np.isfinite(grid).any() else 1.0
        im = ax.imshow(grid, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
        for c in rows:
            if c["supported"]:
                i, j = losses.index(c["loss"]), cells.index((c["length"], c["updates"], c["mismatch"], c["cell"]))
                ax.text(j, i, "**" if c["supported_holm"] else "*", ha="center", va="center", fontsize=8)
        ax.set_yticks(range(len(losses)), losses, fontsize=7)
        ax.set_xticks(range(len(cells)), [c[3] for c in cells], rotation=60, ha="right", fontsize=7)
        ax.set_title(
            f"{task}-like task: {metric} minus grpo's, paired by seed (* 95 % t-interval excludes 0, ** Holm)",
            fontsize=9,
        )
        fig.colorbar(im, ax=ax, fraction=0.02)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_curves(curves: list[dict], path: Path) -> None:
    """Reward per step (mean over seeds) of every preset in the longest cells with 1 update per batch."""
    plt = pyplot()
    if not curves:
        return
    longest = max(int(c["cell"].split("/")[0][1:]) for c in curves)
    panels = sorted(
        {(c["task"], c["cell"]) for c in curves if c["cell"].startswith(f"L{longest}/") and c["cell"].endswith("/U1")}
    )
    cols = min(4, len(panels)) or 1
    rows_n = math.ceil(len(panels) / cols) or 1
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.6 * rows_n), squeeze=False)
    for ax, (task, cell) in zip(axes.flat, panels, strict=False):
        for loss in sorted({c["loss"] for c in curves}, key=lambda n: (n != BASELINE, n)):
            pts = sorted(
                (int(c["step"]), as_float(c["reward"]))
                for c in curves
                if (c["task"], c["cell"], c["loss"]) == (task, cell, loss)
            )
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(
                    xs, ys, label=loss, lw=2.0 if loss == BASELINE else 1.0, color="k" if loss == BASELINE else None
                )
        ax.set_title(f"{task} {cell}: reward (mean over seeds)", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(out: Path, args) -> None:
    runs = read_csv(out / "regimes_runs.csv")
    curves = read_csv(out / "regimes_curves.csv")
    skipped = [r for r in read_csv(out / "regimes_skipped.csv") if r.get("loss")]
    summary = summarise(runs)
    comparisons = compare(runs)
    spreads = mismatch_table(runs)
    tables = {"regimes_summary.csv": summary, "regimes_compare.csv": comparisons, "regimes_mismatch.csv": spreads}
    write_tables(out, tables)
    plot_heatmap(comparisons, "final_reward", out / "regimes_final_vs_grpo.png")
    plot_heatmap(comparisons, "auc", out / "regimes_auc_vs_grpo.png")
    plot_curves(curves, out / "regimes_curves.png")
    command = journal.read(out)
    (out / "README.md").write_text(readme(args, runs, summary, comparisons, spreads, skipped, command))


def _count(comparisons, metric, sign=None, strict=False) -> int:
    key = "supported_holm" if strict else "supported"
    return sum(
        c[key] and c["metric"] == metric and (sign is None or (c["diff"] > 0) == (sign > 0)) for c in comparisons
    )


def readme(args, runs, summary, comparisons, spreads, skipped, command) -> str:
    n_cmp = sum(c["metric"] == "final_reward" for c in comparisons)
    seeds = sorted({int(r["seed"]) for r in runs})
    timing = [line for line in command.splitlines() if line.startswith(("run time", "  ", "machine", "python", "date"))]
    spread_rows = [
        {k: r[k] for k in ("task", "mismatch", "length", "updates")} | {"logratio_sd": r["logratio_sd"]}
        for r in spreads
    ]
    lines = [
        "# The regime grid: every loss preset on long, correlated responses under a real rollout mismatch",
        "",
        "Made by the command in `COMMAND.txt` (`python -m maspo_verl.lab regimes`, engine "
        f"`maspo_verl/lab/studies/regimes.py`): {len(runs)} runs ({len(seeds)} seeds per cell).",
        "",
        "```",
        *timing,
        "```",
        "",
        "## Setup",
        "",
        "- **Presets**: every `hydra_configs/loss/*.yaml`, composed as `python -m maspo_verl.main loss=<name>` "
        "composes it (the trainer's Hydra config, `maspo_verl.reference.compose_config`, "
        "`maspo_verl.main.loss_section`), the loss fetched from verl's registry (`get_policy_loss_fn`) and called "
        "as verl's `ppo_loss` calls it (response ids, word ids and the vocabulary's text in scope). "
        "Nothing is tuned per preset: clip ranges, aggregation, rules and thresholds are the shipped ones.",
        "- **Policy**: one position-dependent bigram logit table per seed (8 symbols), exact log-probs; Adam, lr "
        f"{args.lr:g}; {args.steps} steps of {args.groups} groups x {args.group_size} responses; verl's "
        "`compute_grpo_outcome_advantage`. Seeds are a batch dimension (each its own table and Adam state).",
        "- **speech-like task** (correlated tokens): 50 Hz, units of 3-15 frames (log-normal, median 6 = 120 ms), "
        "XCodec2-like ids in Llasa's range (8 FSQ codes >= 12 apart in digit L1, so `tokenval` finds runs), a "
        "persistent initial policy (self-transition logit +3); reward = fraction of units with more than half of "
        "their frames right (units, not tokens, are scored). The runs of a response are its ASR words (`words`).",
        "- **text-like task** (independent tokens): words and '.' (sentences of 4-11 words), weak random initial "
        "dependence; reward = fraction of tokens right; `delimiters` (`maspo_steps`) cuts at '. '.",
        "- **Mismatch** (the responses come from a rollout policy; its log-probs are the old log-probs, as verl's "
        "bypass mode): `none` (the trained policy, fp32), `bf16` (the trained table rounded to bfloat16: weights "
        "and logits of the rollout), `stale2` (the table as it was 2 optimizer updates earlier, asynchronous RL), "
        "`noise0.2` (the trained policy's samples, Gaussian noise sigma 0.2 on each reported log-prob: the "
        "instrument of the earlier `learn_mismatch` study, perturbed numbers rather than a policy mismatch).",
        "- **Updates per batch**: U mini-batches, one optimizer update each. With U = 1 and no mismatch every "
        "ratio is 1 and every preset follows the same gradient (a sanity check: their differences are 0).",
        f"- **Metrics** per seed: final reward (mean of the last {args.last} steps), reward AUC (mean over all "
        f"steps: speed), steps to step 0's reward + {args.gain:g} (3-step moving average; not reached: "
        f"{args.steps + 1}), collapses (non-finite loss or gradient, or the final reward {0.1:g} below the best "
        "3-step average), gradient norm of the seed's table (mean over updates); verl's `actor/pg_clipfrac` per "
        "cell. Paired by seed (same initial table, target and first batch): each preset minus grpo, 95 % "
        "t-interval (*supported*: excludes 0) and the two-sided sign-flip test (200 000 random sign vectors above "
        "20 seeds, exact enumeration up to 20), Holm-adjusted over every comparison of the metric (`supported_holm`, "
        "`**`: adjusted p < 0.05).",
        "",
        "## Skipped presets",
        "",
        (
            markdown_table(skipped, ["task", "loss", "reason"])
            if skipped
            else "None: every preset ran on both tasks with the inputs the engine provides (response ids, word ids, "
            "the vocabulary's text).\n"
        ),
        "Notes: on these single-turn responses `maspo_turns` has one segment per response (the whole response: "
        "a sequence ratio with the segment clip schedule); on the speech-like task the codec ids carry no text, "
        "so `maspo_steps` cuts only at its `max_segment_len`.",
        "",
        "## Measured mismatch: token-level log-ratio spread",
        "",
        "sd over tokens of log pi_theta - old log-prob at each batch's first update (grpo's runs, mean over seeds "
        "and steps). With U = 4 the later mini-batches drift further; this is the spread the first update sees.",
        "",
        markdown_table(spread_rows, digits=4),
        "## How many differences the intervals support",
        "",
        f"{n_cmp} preset-vs-grpo comparisons per metric. Final reward: {_count(comparisons, 'final_reward', 1)} above "
        f"grpo, {_count(comparisons, 'final_reward', -1)} below (95 % t-interval); after Holm: "
        f"{_count(comparisons, 'final_reward', 1, True)} above, {_count(comparisons, 'final_reward', -1, True)} below. "
        f"AUC: {_count(comparisons, 'auc', 1)} above, {_count(comparisons, 'auc', -1)} below (95 %); after Holm: "
        f"{_count(comparisons, 'auc', 1, True)} above, {_count(comparisons, 'auc', -1, True)} below. By chance about "
        f"{0.05 * n_cmp:.0f} of the {n_cmp} would pass at 95 % unadjusted; Holm keeps the chance of any false one "
        "below 5 % (the U = 1, no-mismatch cells are identical by construction and pass none).",
        "",
        "### Final reward vs grpo, cell by cell (`**`: also after Holm)",
        "",
        *statements(comparisons, "final_reward"),
        "",
        "### Reward AUC (speed) vs grpo, cell by cell",
        "",
        *statements(comparisons, "auc"),
        "",
        "## Summary table",
        "",
        "Means over seeds with 95 % t-intervals.",
        "",
        markdown_table(summary),
        "Files: `regimes_runs.csv` (per seed), `regimes_curves.csv` (per step, mean over seeds), "
        "`regimes_summary.csv`, `regimes_compare.csv` (every paired difference), `regimes_mismatch.csv`, "
        "`regimes_skipped.csv`; plots `regimes_final_vs_grpo.png`, `regimes_auc_vs_grpo.png` (paired "
        "differences, every cell), `regimes_curves.png` (reward per step, longest responses, 1 update per batch).",
        "",
    ]
    return "\n".join(lines)
