"""End-to-end overhead: verl's per-step time (``timing_s/step``) with each loss preset vs ``grpo``.

Runs ``python -m maspo_verl.main local=cpu loss=<preset> trainer.total_training_steps=N`` once per
preset (every preset of ``hydra_configs/loss/`` unless ``--presets``; ``grpo`` first), one after the
other (same seed, same steps, same toy data and tiny model), through ``maspo_verl.lab.engine.runs``, and
reads each step's ``timing_s/step`` from the run folder's ``metrics.jsonl`` (verl's ``file`` logger).
Step 1 holds the trainer's warm-up, so the table uses steps 2..N: the median and the minimum per
preset, and both as a multiple of ``grpo``'s in the same invocation. Results go to ``steptime.csv``
(one row per step) next to the loss benchmark, whose README renders them.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from maspo_verl.lab.engine import common, journal, study
from maspo_verl.lab.engine.presets import BASELINE
from maspo_verl.lab.engine.runs import run_local
from maspo_verl.lab.engine.study import Study
from maspo_verl.util import preset_names

STUDY = Study("steptime", "local trainer step time of each loss preset vs grpo (writes next to bench)", folder="bench")

OUT = STUDY.folder
STEP_TIME = "timing_s/step"


def step_times(steps: dict[int, dict[str, float]]) -> dict[int, float]:
    """``timing_s/step`` of each step of a run's metrics (``LocalRun.steps``)."""
    return {s: m[STEP_TIME] for s, m in sorted(steps.items()) if STEP_TIME in m}


def presets_of(text: str, baseline: str) -> list[str]:
    """``--presets`` (comma-separated; empty: every loss preset) checked against the presets, the baseline first."""
    names = preset_names()
    chosen = [p for p in text.split(",") if p] or names
    unknown = [p for p in chosen if p not in names]
    if unknown:
        raise SystemExit(f"--presets: unknown {unknown}; allowed {names}")
    return [baseline, *(p for p in dict.fromkeys(chosen) if p != baseline)]


def run(args: argparse.Namespace, argv: list[str]) -> None:
    out = args.out
    presets = presets_of(args.presets, BASELINE)
    os.makedirs(out, exist_ok=True)
    runs = Path(tempfile.mkdtemp(prefix="maspo_steptime_"))
    rows = []
    for preset in presets:
        overrides = [f"loss={preset}", f"trainer.total_training_steps={args.steps}"]
        result = run_local(overrides, runs / preset, timeout_s=args.timeout)
        times = step_times(result.steps)
        common.log(f"steptime: {preset} rc={result.returncode} steps={sorted(times)} ({result.wall_s:.0f}s)")
        if result.returncode != 0 or len(times) < args.steps:
            raise RuntimeError(
                f"loss={preset}: run failed or logged {len(times)} of {args.steps} steps (run folder "
                f"{result.run_dir})\n{result.tail(60)}"
            )
        rows += [{"preset": preset, "step": s, "timing_s_step": t} for s, t in times.items()]
    shutil.rmtree(runs, ignore_errors=True)
    common.write_csv(os.path.join(out, "steptime.csv"), rows)
    journal.start(out, argv, name=COMMAND)
    study.add_sections(out, STUDY.folder, title="# Loss benchmark")
    print(common.markdown_table(summarise_steps(rows, BASELINE)))


SECTION = "## End-to-end overhead"  # of the bench folder's README
COMMAND = "STEPTIME_COMMAND.txt"  # steptime's journal, beside bench's COMMAND.txt


def summarise_steps(rows: list[dict], baseline: str) -> list[dict]:
    """Step times: median and minimum of steps >= 2 per preset, and their ratios to the baseline's."""
    by = {}
    for r in rows:
        if r["step"] >= 2:
            by.setdefault(r["preset"], []).append(float(r["timing_s_step"]))
    if baseline not in by:
        return []
    base_med, base_min = statistics.median(by[baseline]), min(by[baseline])
    return [
        {
            "preset": p,
            "steps": len(v),
            "median_s": statistics.median(v),
            "x_grpo_median": statistics.median(v) / base_med,
            "min_s": min(v),
            "x_grpo_min": min(v) / base_min,
        }
        for p, v in by.items()
    ]


def readme_section(out) -> str:
    """The end-to-end table from ``steptime.csv``, if present."""
    path = Path(out) / "steptime.csv"
    if not path.exists():
        return ""
    with open(path) as f:
        rows = [dict(r, step=int(r["step"]), timing_s_step=float(r["timing_s_step"])) for r in csv.DictReader(f)]
    table = summarise_steps(rows, BASELINE)
    command_file = Path(out) / COMMAND
    command = command_file.read_text().partition("\n")[0] if command_file.exists() else ""
    return "\n".join(
        [
            SECTION,
            "",
            f"`{command}`: verl's real trainer in local CPU mode, one run per preset, one after the other "
            "(same seed, same toy data and tiny model, same steps), on the same shared 2-core machine. "
            "Each step's `timing_s/step` is verl's own metric; step 1 (trainer warm-up) is left out. "
            "`x_grpo_*`: the preset's median / minimum step time over `grpo`'s in the same invocation "
            "(target <= 1.02). Per-step rows: `steptime.csv`.",
            "",
            common.markdown_table(table, ["preset", "steps", "median_s", "x_grpo_median", "min_s", "x_grpo_min"]),
        ]
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=6, help="trainer steps per run (step 1 is warm-up, not counted)")
    p.add_argument(
        "--presets",
        default="",
        help=f"comma-separated loss presets (default: all of {preset_names()}); grpo always runs, first",
    )
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
