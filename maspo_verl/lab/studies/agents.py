"""Learning with the rollout correction at token / sequence / turn level, with and without turn credit, in
decoupled mode on the local mode's multi-turn toy environment with a real rollout/training mismatch.

``python -m maspo_verl.lab.studies.agents --turns 8 --seeds 5 --steps 8 --out <folder>``

Each run is ``python -m maspo_verl.main local=cpu task=turns`` (verl's trainer, decoupled mode: verl recomputes
πold, ``rollout_corr/*`` compares it with the rollout's log-probs) with the rollout server sampling from a stale
copy of the policy (``maspo.local_mismatch.stale_syncs``) in bfloat16, the actor in fp32. Conditions: the
correction's level (``rollout_is`` = token, sequence, segment with ``rollout_segment_rule=turns``; TIS cap 2)
x the advantage (grpo, ``credit=turns``). Runs go seed by seed, so a study stopped early has whole seeds.
Per run: final reward (mean of the last 3 steps), mean reward over the run, the correction's metrics; paired
by seed, each condition minus token-level correction with grpo, with 95 % t-intervals.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from maspo_verl.lab.engine.common import markdown_table, write_csv
from maspo_verl.lab.engine.runs import run_local
from maspo_verl.lab.engine.stats import mean_interval

LEVELS = ("token", "sequence", "segment")
CREDITS = ("grpo", "turns")
BASELINE = ("token", "grpo")
MIN_SEEDS = 3  # fewer paired seeds: the interval says little (1 seed: none)
WEIGHT_KEYS = {
    "token": ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size"),
    "sequence": ("rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_eff_sample_size"),
    "segment": ("rollout_corr/rollout_is_segment_mean", "rollout_corr/rollout_is_segment_ess"),
}


def overrides(args, level: str, credit: str, seed: int) -> list[str]:
    return [
        "task=turns",
        f"loss={args.loss}",
        f"maspo.turns={args.turns}",
        f"maspo.local_seed={seed}",
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"maspo.local_mismatch.stale_syncs={args.stale_syncs}",
        f"maspo.local_mismatch.logprob_dtype={args.dtype}",
        "++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        f"data.train_batch_size={args.batch}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.total_epochs={args.steps}",
        f"algorithm.rollout_correction.rollout_is={level}",
        "algorithm.rollout_correction.rollout_is_threshold=2.0",
        *(["credit=turns"] if credit == "turns" else []),
        f"trainer.experiment_name=agents_{level}_{credit}_{seed}",
    ]


def record(args, level, credit, seed, run) -> dict:
    trained = [s for s in sorted(run.steps) if "critic/score/mean" in run.steps[s]]
    curve = [run.steps[s]["critic/score/mean"] for s in trained]
    mean_key, ess_key = WEIGHT_KEYS[level]
    weights = [run.steps[s].get(mean_key) for s in trained]
    ess = [run.steps[s].get(ess_key) for s in trained]
    ok = run.returncode == 0 and len(trained) == args.steps
    return {
        "level": level,
        "credit": credit,
        "seed": seed,
        "ok": ok,
        "steps": len(trained),
        "final_reward": sum(curve[-3:]) / len(curve[-3:]) if curve else None,
        "mean_reward": sum(curve) / len(curve) if curve else None,
        "weight_mean": _mean(weights),
        "weight_ess": _mean(ess),
        "kl": _mean([run.steps[s].get("rollout_corr/kl") for s in trained]),
        "wall_s": round(run.wall_s, 1),
        "curve": json.dumps([round(c, 4) for c in curve]),
    }


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def compare(runs: list[dict]) -> list[dict]:
    by = {(r["level"], r["credit"], r["seed"]): r for r in runs if r["ok"]}
    out = []
    for level in LEVELS:
        for credit in CREDITS:
            if (level, credit) == BASELINE:
                continue
            for metric in ("final_reward", "mean_reward"):
                seeds = sorted(s for (lv, c, s) in by if (lv, c) == (level, credit) and (*BASELINE, s) in by)
                diffs = [by[(level, credit, s)][metric] - by[(*BASELINE, s)][metric] for s in seeds]
                mean, low, high = mean_interval(diffs)
                out.append(
                    {
                        "condition": f"{level}+{credit}",
                        "vs": "token+grpo",
                        "metric": metric,
                        "seeds": len(seeds),
                        "diff": mean,
                        "low": low,
                        "high": high,
                        "interval_excludes_0": len(seeds) >= MIN_SEEDS and (low > 0 or high < 0),
                    }
                )
    return out


def summary(runs: list[dict]) -> list[dict]:
    rows = []
    for level in LEVELS:
        for credit in CREDITS:
            mine = [r for r in runs if r["ok"] and (r["level"], r["credit"]) == (level, credit)]
            if not mine:
                continue
            row = {"condition": f"{level}+{credit}", "seeds": len(mine)}
            for key in ("final_reward", "mean_reward", "weight_mean", "weight_ess"):
                mean, low, high = mean_interval([r[key] for r in mine])
                row[key] = f"{mean:.3f} [{low:.3f}, {high:.3f}]"
            rows.append(row)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--loss", default="maspo_turns")
    p.add_argument("--stale-syncs", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--levels", nargs="+", default=list(LEVELS), choices=LEVELS)
    p.add_argument("--credits", nargs="+", default=list(CREDITS), choices=CREDITS)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs-dir", type=Path, default=None, help="the runs' folders (default: <out>/runs)")
    p.add_argument("--summarise", action="store_true", help="no runs: summarise the runs in <out>/learn_runs.csv")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "learn_runs.csv"
    runs = []
    if path.exists():
        import csv

        with open(path) as f:
            runs = [
                dict(
                    r,
                    ok=r["ok"] == "True",
                    seed=int(r["seed"]),
                    **{
                        k: float(r[k]) if r[k] not in ("", "None") else None
                        for k in ("final_reward", "mean_reward", "weight_mean", "weight_ess", "kl")
                    },
                )
                for r in csv.DictReader(f)
            ]
    runs_dir = args.runs_dir or args.out / "runs"
    done = {(r["level"], r["credit"], r["seed"]) for r in runs}
    for seed in range(args.first_seed, args.first_seed + args.seeds) if not args.summarise else ():
        for level in args.levels:
            for credit in args.credits:
                if (level, credit, seed) in done:
                    continue
                start = time.time()
                run = run_local(overrides(args, level, credit, seed), runs_dir / f"{level}_{credit}_{seed}")
                runs.append(record(args, level, credit, seed, run))
                print(
                    f"seed {seed} {level}+{credit}: final {runs[-1]['final_reward']} ok {runs[-1]['ok']} "
                    f"({time.time() - start:.0f} s)",
                    flush=True,
                )
                write_csv(path, runs)
    write_csv(args.out / "learn_compare.csv", compare(runs))
    (args.out / "learn_summary.md").write_text(
        markdown_table(summary(runs)) + "\n\n" + markdown_table(compare(runs)) + "\n"
    )


if __name__ == "__main__":
    main()
