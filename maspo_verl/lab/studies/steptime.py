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
import os
import shutil
import tempfile
from pathlib import Path

from maspo_verl.lab.engine import common, journal
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
    from maspo_verl.lab.studies import bench

    out = args.out
    presets = presets_of(args.presets, bench.BASELINE)
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
    journal.start(out, argv, name=bench.STEPTIME_COMMAND)
    bench.render_readme(out)
    print(common.markdown_table(bench.summarise_steps(rows, bench.BASELINE)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=6, help="trainer steps per run (step 1 is warm-up, not counted)")
    p.add_argument(
        "--presets",
        default="",
        help=f"comma-separated loss presets (default: all of {preset_names()}); grpo always runs, first",
    )
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
