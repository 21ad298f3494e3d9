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
from pathlib import Path

from maspo_verl.lab.engine import journal
from maspo_verl.lab.engine.cells import parse_mismatch
from maspo_verl.lab.engine.grid import TASKS, Job, engine_arguments, probe, run_jobs
from maspo_verl.lab.engine.presets import Preset, discover_presets
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
    from maspo_verl.lab.studies import regimes_report

    regimes_report.write(out, args)
    common.report_written(out)
