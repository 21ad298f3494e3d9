"""Toy RL race: GRPO on CPU with verl's and our policy losses on the race's two tasks (``lab/engine/race.py``:
a speech-like task whose target is made of runs, a text-like one without), each contender a preset's loss."""

from __future__ import annotations

import argparse
import time

import torch

from maspo_verl.lab.engine import common, journal
from maspo_verl.lab.engine.race import VOCAB, Contender, make_task, plot, race, race_arguments, write_tables
from maspo_verl.lab.engine.study import Study

STUDY = Study("race", "toy GRPO race of verl's and our losses (speech-like vs text-like task)")

CONTENDERS = [
    Contender("vanilla (verl)", "vanilla"),
    Contender("gspo (verl)", "gspo"),
    Contender("maspo fixed W=4", "maspo", policy_loss={"segment_rule": "fixed", "segment_window": 4}),
    Contender("maspo logprob tau=1", "maspo", policy_loss={"segment_rule": "logprob", "logprob_threshold": 1.0}),
    Contender("ctpo cumprod (LA clip)", "ctpo", policy_loss={"ctpo_mode": "cumprod", "clip_schedule": "log_adaptive"}),
    Contender("pgspo alpha=0.5", "pgspo", policy_loss={"length_exponent": 0.5}),
]


def run(args: argparse.Namespace, argv: list[str]) -> None:
    out = journal.start(args.out, argv)
    t0 = time.time()
    torch.set_num_threads(1)
    tasks = [make_task(n, args.length) for n in ("speech", "text")]
    curves, rows, summary = race(tasks, CONTENDERS, args, t0)
    write_tables(out, curves, rows, summary)
    plot(curves, tasks, CONTENDERS, args, out / "race_reward.png")
    write_report(out, summary, args, time.time() - t0)
    common.report_written(out)


def write_report(out, summary, args, seconds) -> None:
    lines = [
        "# Toy RL race",
        "",
        f"Made by the command in `COMMAND.txt` ({seconds:.0f} s on CPU). Per-run numbers: `race_runs.csv`; "
        "curves: `race_curves.csv`; plot: `race_reward.png` (reward and entropy vs step, mean +- sd over seeds).",
        "",
        "## Setup",
        "",
        f"- Responses of T={args.length} tokens over a vocabulary of {VOCAB}; policy = position-dependent bigram "
        "logit table, Adam lr " + f"{args.lr}" + ".",
        "- `speech` task: the initial policy is strongly persistent (self-transition logit +2.5, neighbouring "
        "tokens tied); target = runs of 4 equal tokens; reward = fraction of runs reproduced exactly.",
        "- `text` task: weak random initial dependence; target without runs; reward = fraction of tokens right.",
        f"- Each step: {args.groups} groups x {args.group_size} samples, verl's `compute_grpo_outcome_advantage` "
        f"(reward on the last token), then {args.epochs} PPO epochs x {args.minibatches} mini-batches "
        "(so all but the first update are off-policy). token-mean aggregation for every loss.",
        "- Losses through `verl.trainer.ppo.core_algos.get_policy_loss_fn` with a verl `ActorConfig` whose "
        "`policy_loss` is `GranularLossConfig`. Ratio-space clip 0.2 / 0.28 (verl defaults, same for every "
        "loss incl. verl's `gspo`; dual clip 3); `ctpo` uses its own log-space length-adaptive defaults "
        "(eps_low 0.025, eps_high 0.05, p = +0.5).",
        f"- steps to target: first step at which the 3-step moving average of the batch reward reaches "
        f"{args.target}. collapse: final reward (mean of last 5 steps) more than 0.2 below the best moving "
        "average, or entropy rising above 1.2x its initial value.",
        "",
        "## Summary",
        "",
        common.markdown_table(summary),
        "## Findings (generated from the table above)",
        "",
        *findings(summary),
        "",
        "Caveats: 5 seeds and a tabular policy; differences of a few hundredths in final reward are within "
        "seed noise (see `final_sd`). The clip ranges are verl's defaults for every ratio-space loss, not "
        "tuned per method (GSPO's paper uses far tighter sequence-level clips, 3e-4 / 4e-4).",
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def findings(summary: list[dict]) -> list[str]:
    lines = []
    for task in dict.fromkeys(r["task"] for r in summary):
        rows = [r for r in summary if r["task"] == task]
        by_final = sorted(rows, key=lambda r: -r["final_reward"])
        reached = [r for r in rows if r["reached_target"].split("/")[0] == r["reached_target"].split("/")[1]]
        fastest = min(reached, key=lambda r: r["median_steps_to_target"]) if reached else None
        van = next(r for r in rows if r["loss"].startswith("vanilla"))
        lines.append(
            f"- **{task}**: best final reward {by_final[0]['loss']} ({by_final[0]['final_reward']:.3f}), worst "
            f"{by_final[-1]['loss']} ({by_final[-1]['final_reward']:.3f}); verl vanilla {van['final_reward']:.3f}. "
            + (
                f"Fastest to the target in every seed: {fastest['loss']} "
                f"(median {fastest['median_steps_to_target']:.0f} "
                f"steps; vanilla {van['median_steps_to_target']:.0f}). "
                if fastest
                else ""
            )
            + "Not reaching the target in every seed: "
            + (", ".join(f"{r['loss']} ({r['reached_target']})" for r in rows if r not in reached) or "none")
            + ". Collapses: "
            + (", ".join(f"{r['loss']} ({r['collapses']})" for r in rows if r["collapses"]) or "none")
            + "."
        )
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    race_arguments(p)
