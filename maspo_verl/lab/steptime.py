"""End-to-end overhead: verl's per-step time (``timing_s/step``) with each loss preset vs ``grpo``.

Runs ``python -m maspo_verl.main local=cpu loss=<preset> trainer.total_training_steps=N`` once per
preset, one after the other (same seed, same steps, same toy data and tiny model), and reads the
``timing_s/step`` metric that verl's console logger prints for every step. Step 1 holds the
trainer's warm-up, so the table uses steps 2..N: the median and the minimum per preset, and both
as a multiple of ``grpo``'s in the same invocation. Results go to ``steptime.csv`` (one row per
step) next to the loss benchmark, whose README renders them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from maspo_verl.lab import common

OUT = "bench"  # results live next to the loss benchmark
STEP_TIME = re.compile(r"step:(\d+) - .*?timing_s/step:([0-9.eE+-]+)")


def step_times(log: str) -> dict[int, float]:
    """``timing_s/step`` of each step in a console log of verl's trainer."""
    return {int(m.group(1)): float(m.group(2)) for m in STEP_TIME.finditer(log)}


def run(args: argparse.Namespace, argv: list[str]) -> None:
    from maspo_verl.lab import bench

    out = args.out
    os.makedirs(out, exist_ok=True)
    presets = [bench.BASELINE] + [p for p in args.presets.split(",") if p and p != bench.BASELINE]
    rows = []
    for preset in presets:
        cmd = [
            sys.executable,
            "-m",
            "maspo_verl.main",
            "local=cpu",
            f"loss={preset}",
            f"trainer.total_training_steps={args.steps}",
        ]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        times = step_times(proc.stdout + proc.stderr)
        common.log(f"steptime: {preset} rc={proc.returncode} steps={sorted(times)} ({time.time() - t0:.0f}s)")
        if proc.returncode != 0 or len(times) < args.steps:
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"loss={preset}: run failed or logged {len(times)} of {args.steps} steps\n{tail}")
        rows += [{"preset": preset, "step": s, "timing_s_step": t} for s, t in sorted(times.items())]
    common.write_csv(os.path.join(out, "steptime.csv"), rows)
    with open(os.path.join(out, "STEPTIME_COMMAND.txt"), "w") as f:
        f.write("python -m maspo_verl.lab " + " ".join(argv) + "\n")
    bench.render_readme(out)
    print(common.markdown_table(bench.summarise_steps(rows, bench.BASELINE)))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=6, help="trainer steps per run (step 1 is warm-up, not counted)")
    p.add_argument(
        "--presets",
        default="maspo_fixed,maspo_logprob,maspo_tokenval,ctpo,pgspo,gspo",
        help="comma-separated presets after grpo (which always runs first)",
    )
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
