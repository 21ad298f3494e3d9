"""``docs/choosing.md``, a guide to choosing a loss preset, made from the committed result tables.

Every number on the page comes from a CSV under ``docs/results/``: the regime grid's paired comparisons
(``regimes/regimes_compare.csv``), the trainer studies' (``learn_compare.csv`` of ``learn_mismatch/``,
``learn_turns/``, ``regimes_trainer/`` and ``regimes_trainer_gspo/``). ``python -m maspo_verl generate``
rewrites the page and ``--check`` (``tests/test_reference.py``) fails when it is out of date with them.
Standard library only.
"""

from __future__ import annotations

import csv
from pathlib import Path

BASELINE = "grpo"
PAGE = Path("docs", "choosing.md")
RESULTS = Path("docs", "results")
GRID = "regimes"
GRID_CSV = RESULTS / GRID / "regimes_compare.csv"
GRID_SUMMARY = RESULTS / GRID / "regimes_summary.csv"
GRID_RUNS = RESULTS / GRID / "regimes_runs.csv"
# the grid's regimes: (column header, cell); both tasks are shown in each (S: speech-like, correlated tokens;
# T: text-like, independent tokens)
GRID_COLUMNS = (
    ("16 tokens, 4 updates/batch", "L16/none/U4"),
    ("96 tokens, 4 updates/batch", "L96/none/U4"),
    ("384 tokens, 4 updates/batch", "L384/none/U4"),
    ("384 tokens, bf16 rollout, 1 update", "L384/bf16/U1"),
    ("384 tokens, rollout 2 updates stale, 1 update", "L384/stale2/U1"),
    ("384 tokens, stale rollout + 4 updates", "L384/stale2/U4"),
    ("384 tokens, log-prob noise σ 0.2, 1 update", "L384/noise0.2/U1"),
)
# the grid's cells re-run in verl's trainer, one folder per command (lab learn)
CONFIRMATIONS = ("regimes_trainer", "regimes_trainer_gspo")
# trainer studies (lab learn): folder -> column header; every (task, cell) in their learn_compare.csv
TRAINER = (
    ("learn_mismatch", "trainer: speech-like, 12 tokens"),
    ("learn_turns", "trainer: multi-turn agent, 4-token turns"),
    *((folder, "trainer: the grid's cells confirmed") for folder in CONFIRMATIONS),
)
TASK_LETTER = {"speech": "S", "text": "T"}


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _yes(v) -> bool:
    return str(v) == "True"


def _mark(diff: float, supported: bool, strict: bool = False) -> str:
    if not supported:
        return f"≈ ({diff:+.3f})"
    arrow = "▲" if diff > 0 else "▼"
    return f"**{arrow} {diff:+.3f}**" + ("‡" if strict else "")


def grid_cell(rows: list[dict], loss: str, cell: str) -> str:
    parts = []
    for task in ("speech", "text"):
        r = next(
            (r for r in rows if (r["task"], r["cell"], r["loss"], r["metric"]) == (task, cell, loss, "final_reward")),
            None,
        )
        if r is not None:
            mark = _mark(float(r["diff"]), _yes(r["supported"]), _yes(r["supported_999"]))
            parts.append(f"{TASK_LETTER[task]} {mark}")
    return "<br>".join(parts) if parts else "not run"


def trainer_cell(rows: list[dict], loss: str) -> str:
    parts = []
    for r in rows:
        if r["loss"] == loss and r["comparison"] == "vs_grpo" and r["metric"] == "final_reward":
            parts.append(f"{r['task']} {r['cell']}: {_mark(float(r['diff']), _yes(r['interval_excludes_0']))}")
    return "<br>".join(parts) if parts else "not run"


def grid_cell_of(trainer_cell: str) -> str:
    """The grid's name of a ``lab learn`` cell: ``L96/0.2/U4`` -> ``L96/noise0.2/U4`` (a number is the noise sigma)."""
    length, mismatch, updates = trainer_cell.split("/")
    try:
        mismatch = f"noise{float(mismatch):g}"
    except ValueError:
        pass
    return f"{length}/{mismatch}/{updates}"


def baseline_progress(root: Path, folder: str) -> list[str]:
    """How far ``grpo`` itself got, step 1 -> final reward (means over seeds), in the trainer and in the grid's
    cell: a difference between presets means little where the baseline did not learn."""
    grid_runs = _read(root / GRID_RUNS)
    lines = []
    trainer_runs = [r for r in _read(root / RESULTS / folder / "learn_runs.csv") if r["loss"] == BASELINE]
    for task, cell in sorted({(r["task"], r["cell"]) for r in trainer_runs}):
        mine = [r for r in trainer_runs if (r["task"], r["cell"]) == (task, cell) and _yes(r["ok"])]
        grid = [r for r in grid_runs if (r["task"], r["cell"], r["loss"]) == (task, grid_cell_of(cell), BASELINE)]
        if not mine or not grid:
            continue

        def progress(rows: list[dict]) -> str:
            first = sum(float(r["first_reward"]) for r in rows) / len(rows)
            final = sum(float(r["final_reward"]) for r in rows) / len(rows)
            return f"{first:.3f} -> {final:.3f}"

        lines.append(
            f"- `{BASELINE}` itself, {task} {cell}, reward at step 1 -> final (mean over seeds): trainer "
            f"{progress(mine)} ({len(mine)} seeds); grid {progress(grid)} ({len(grid)} seeds)."
        )
    return lines


def agreement(grid: list[dict], trainer: list[dict]) -> list[str]:
    """Each trainer comparison (final reward vs grpo) next to the grid's in the same cell and task."""
    lines = []
    for r in trainer:
        if r["comparison"] != "vs_grpo" or r["metric"] != "final_reward":
            continue
        cell = grid_cell_of(r["cell"])
        g = next(
            (
                c
                for c in grid
                if (c["task"], c["cell"], c["loss"], c["metric"]) == (r["task"], cell, r["loss"], "final_reward")
            ),
            None,
        )
        here = f"{float(r['diff']):+.3f} [{float(r['low']):+.3f}, {float(r['high']):+.3f}] ({r['seeds']} seeds)"
        if g is None:
            lines.append(f"- `{r['loss']}` {r['task']} {r['cell']}: trainer {here}; the grid has no such cell.")
            continue
        there = f"{float(g['diff']):+.3f} [{float(g['low']):+.3f}, {float(g['high']):+.3f}]"
        t_sup, g_sup = _yes(r["interval_excludes_0"]), _yes(g["supported"])
        same_sign = (float(r["diff"]) > 0) == (float(g["diff"]) > 0)
        if t_sup and g_sup:
            verdict = (
                "agrees (both supported, same sign)" if same_sign else "disagrees (both supported, opposite signs)"
            )
        elif g_sup:
            verdict = "does not confirm it (the trainer's interval includes 0" + (
                ", its mean on the grid's side)" if same_sign else ", its mean on the other side)"
            )
        elif t_sup:
            verdict = "finds a difference the grid does not"
        else:
            verdict = "agrees: no difference supported in either"
        few = " (under 5 seeds: the percentile interval is too narrow, a lead only)" if int(r["seeds"]) < 5 else ""
        lines.append(f"- `{r['loss']}` {r['task']} {r['cell']}: trainer {here}; grid {cell} {there}: {verdict}{few}.")
    return lines


def clipping(summary: list[dict], loss: str) -> str:
    """The preset's mean clip fraction and gradient norm over the grid's longest cells, next to grpo's."""
    if not summary:
        return ""
    longest = max(int(r["cell"].split("/")[0][1:]) for r in summary)

    def mean(name: str, key: str) -> float:
        v = [float(r[key]) for r in summary if r["loss"] == name and r["cell"].startswith(f"L{longest}/")]
        return sum(v) / len(v) if v else float("nan")

    grad = mean(loss, "grad_norm") / mean(BASELINE, "grad_norm")
    return (
        f" At {longest} tokens (mean over its cells) it clips {mean(loss, 'clipfrac'):.3f} of the tokens (grpo "
        f"{mean(BASELINE, 'clipfrac'):.3f}), gradient norm {grad:.2f}x grpo's."
    )


def presets(root: Path) -> list[str]:
    names = sorted(p.stem for p in (root / "hydra_configs" / "loss").glob("*.yaml"))
    return sorted(names, key=lambda n: (n != BASELINE, n))


def tally(rows: list[dict], loss: str, metric: str = "final_reward") -> tuple[int, int, int, int, int]:
    """(comparisons, above at 95 %, below at 95 %, above at 99.9 %, below at 99.9 %) over the whole grid."""
    mine = [r for r in rows if r["loss"] == loss and r["metric"] == metric]
    up = [r for r in mine if _yes(r["supported"]) and float(r["diff"]) > 0]
    down = [r for r in mine if _yes(r["supported"]) and float(r["diff"]) < 0]
    return (
        len(mine),
        len(up),
        len(down),
        sum(_yes(r["supported_999"]) for r in up),
        sum(_yes(r["supported_999"]) for r in down),
    )


def _where(rows: list[dict], loss: str, sign: int) -> str:
    """The cells where ``loss``'s final reward is above (sign 1) / below (-1) grpo's at 99.9 %, largest first."""
    hits = [
        r
        for r in rows
        if r["loss"] == loss
        and r["metric"] == "final_reward"
        and _yes(r["supported_999"])
        and (float(r["diff"]) > 0) == (sign > 0)
    ]
    hits.sort(key=lambda r: -abs(float(r["diff"])))
    return ", ".join(f"{TASK_LETTER[r['task']]} {r['cell']} {float(r['diff']):+.3f}" for r in hits[:6]) + (
        f" (+{len(hits) - 6} more)" if len(hits) > 6 else ""
    )


def render(root: Path) -> str:
    grid = _read(root / GRID_CSV)
    grid_summary = _read(root / GRID_SUMMARY)
    names = presets(root)
    link = f"results/{GRID}/README.md"
    header = ["preset", *(f"[{h}]({link})" for h, _ in GRID_COLUMNS)]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for loss in names[1:]:
        table.append("| `" + loss + "` | " + " | ".join(grid_cell(grid, loss, cell) for _, cell in GRID_COLUMNS) + " |")
    trainer_tables = []
    for folder, title in TRAINER:
        rows = _read(root / RESULTS / folder / "learn_compare.csv")
        if not rows:
            continue
        run = [n for n in names[1:] if any(r["loss"] == n for r in rows)]
        trainer_tables += [
            f"**[{title}](results/{folder}/README.md)** (final reward minus grpo's, paired by seed, 95 % interval):",
            "",
            "| preset | " + title + " |",
            "|---|---|",
            *(f"| `{n}` | {trainer_cell(rows, n)} |" for n in run),
            "",
        ]
        if folder in CONFIRMATIONS:
            trainer_tables += ["Does the trainer agree with the grid?", "", *agreement(grid, rows)]
            trainer_tables += [*baseline_progress(root, folder), ""]
    summary = []
    total_up = total_down = 0
    for loss in names[1:]:
        n, up, down, up3, down3 = tally(grid, loss)
        if n == 0:
            summary.append(f"- `{loss}`: not in the grid.")
            continue
        total_up, total_down = total_up + up3, total_down + down3
        line = (
            f"- `{loss}`: final reward above grpo in {up} of {n} grid cells, below in {down} (95 %); at 99.9 %: "
            f"{up3} above, {down3} below."
        )
        if up3:
            line += f" Above: {_where(grid, loss, 1)}."
        if down3:
            line += f" Below: {_where(grid, loss, -1)}."
        summary.append(line + clipping(grid_summary, loss))
    n_cmp = sum(r["metric"] == "final_reward" for r in grid)
    verdict = (
        f"Over the grid's {n_cmp} comparisons of final reward, {total_up} place a preset above grpo and "
        f"{total_down} below at 99.9 % (about {0.001 * n_cmp:.1f} would by chance)."
    )
    if grid and total_up == 0:
        verdict += " No preset beats grpo anywhere in the grid at that bar: where the others differ, they lose."
    lines = [
        "# Choosing a loss preset",
        "",
        f"<!-- generated by `python -m maspo_verl generate` from docs/results/*/ CSVs "
        f"({__name__}); edit the code, not this page -->",
        "",
        "What the committed studies support about each loss preset against `grpo` (verl's token-level "
        "`vanilla`), by regime. Every entry is the preset's final reward minus grpo's in the same cell, paired by "
        "seed: **▲ / ▼** the 95 % bootstrap interval excludes 0 (‡: the 99.9 % interval too, the bar that "
        "survives the grid's many comparisons); ≈ it does not. S: the speech-like task (50 Hz units of 3-15 "
        "frames, correlated neighbouring tokens, a reward over units); T: the text-like task (independent "
        "tokens, a reward over tokens). The grid is a tabular policy with every preset as shipped "
        f"([`{GRID}/`]({link}): 20 seeds a cell); the trainer studies are verl's trainer in the local CPU mode "
        "(5 seeds). A preset's clip range and rule are its shipped defaults, not tuned per regime.",
        "",
        "## The regime grid",
        "",
        "Responses of 16-384 tokens; mismatch: the responses come from a rollout policy whose own log-probs are "
        "the old log-probs (verl's bypass mode): a bf16-rounded copy of the trained policy, or the policy as it "
        "was 2 updates earlier (asynchronous RL), or the trained policy's samples with Gaussian noise on the "
        "reported log-probs; updates: optimizer updates per batch (off-policy updates). With one update and no "
        "mismatch every preset follows grpo's gradient exactly (not shown).",
        "",
        *table,
        "",
        "## In verl's trainer",
        "",
        *trainer_tables,
        "## What the grid supports, preset by preset",
        "",
        verdict,
        "",
        *summary,
        "",
        "Per-cell statements with every interval, the measured log-ratio spread of each mismatch (map it to "
        f"your own run's), clip fractions and gradient norms: [`results/{GRID}/README.md`]({link}); the "
        "multi-turn study: [`results/learn_turns/README.md`](results/learn_turns/README.md).",
        "",
    ]
    return "\n".join(lines)
