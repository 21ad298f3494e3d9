"""Span credit vs plain GRPO on the toy tasks of :mod:`maspo_verl.lab.studies.race`, whose reward is built from
per-span errors (a span = a run of 4 tokens on the speech-like task, one token on the text-like one).

1. Gradient quality at fixed policies (the initial one, and the one after ``--warm-steps`` GRPO
   steps): many independent batches, each giving the on-policy policy gradient
   ``grad sum_{i,t} A_it log pi_it / (B T)`` for each advantage estimator on the *same* samples. Against
   the exact gradient of the expected reward (a forward recursion over the bigram policy, autograd):
   relative variance E||g - mean g||^2 / ||mean g||^2, mean cosine(g, true), cosine(mean g, true)
   (span credit is not unbiased for the utterance reward; this shows how far its mean points away).
2. Race: the race's training loop with GRPO vs span credit, under verl's ``vanilla`` loss and MASPO
   (fixed W=4), steps to target and final reward.

Advantages come from verl's ``compute_grpo_outcome_advantage`` and from ``maspo_span_grpo`` through
verl's estimator registry, on per-token scores built by ``maspo_verl.speech.spans`` (the speech
reward's own functions).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from maspo_verl.lab.engine import common, journal, race
from maspo_verl.lab.engine.race import VOCAB, Contender, RaceTask
from maspo_verl.lab.engine.study import Study

STUDY = Study("credit", "span credit vs GRPO advantages: gradient variance and a race on per-span-error tasks")

LAMS = (0.25, 0.5, 1.0, 2.0)


def exact_reward(theta: torch.Tensor, task: RaceTask) -> torch.Tensor:
    """Expected reward of the bigram policy, differentiable: 1 - mean over units of P(unit wrong).

    prev[t] = distribution of the token before position t (BOS first); a unit starting at s is right
    with probability prev[s] . p_s(target_s | .) * prod_{t in unit, t > s} p_t(target_t | target_{t-1}).
    """
    T = theta.shape[0]
    probs = torch.softmax(theta, -1)  # [T, V+1, V]
    bos = torch.zeros(VOCAB + 1, dtype=theta.dtype)
    bos[VOCAB] = 1.0
    prev = [bos]
    for t in range(T - 1):
        prev.append(torch.cat([prev[-1] @ probs[t], bos.new_zeros(1)]))
    target = task.target.tolist()
    ok = []
    for s in range(0, T, task.unit):
        p = prev[s] @ probs[s][:, target[s]]
        for t in range(s + 1, s + task.unit):
            p = p * probs[t][target[t - 1], target[t]]
        ok.append(p)
    return torch.stack(ok).mean()


def estimators() -> list[Contender]:
    return [Contender("grpo (verl)", "vanilla")] + [Contender(f"span lam={x:g}", "vanilla", credit=x) for x in LAMS]


def gradient_study(task: RaceTask, theta: torch.Tensor, args, gen: torch.Generator) -> list[dict]:
    theta = theta.detach().clone().requires_grad_()
    true = torch.autograd.grad(exact_reward(theta, task), theta)[0].flatten()
    B = args.groups * args.group_size
    index = np.repeat(np.arange(args.groups), args.group_size)
    grads: dict[str, list[torch.Tensor]] = {c.label: [] for c in estimators()}
    for _ in range(args.batches):
        y, _ = race.sample(theta, B, gen)
        r = task.reward(y)
        mask = torch.ones(y.shape, dtype=torch.bool)
        lp = race.log_probs(theta, y)
        for c in estimators():
            adv = race.advantages(task, c, y, r, mask, index)
            g = torch.autograd.grad((adv * lp).sum() / lp.numel(), theta, retain_graph=True)[0]
            grads[c.label].append(g.flatten())
    rows = []
    for label, gs in grads.items():
        G = torch.stack(gs)
        mean = G.mean(0)
        cos = torch.nn.functional.cosine_similarity(G, true[None], dim=-1)
        rows.append(
            {
                "estimator": label,
                "rel_variance": float((G - mean).pow(2).sum(-1).mean() / mean.pow(2).sum()),
                "mean_cos_to_true": float(cos.mean()),
                "cos_of_mean_to_true": float(torch.nn.functional.cosine_similarity(mean, true, dim=0)),
            }
        )
    return rows


def run(args: argparse.Namespace, argv: list[str]) -> None:
    out = journal.start(args.out, argv)
    t0 = time.time()
    torch.set_num_threads(1)
    tasks = [race.make_task(n, args.length) for n in ("speech", "text")]
    grad_rows = []
    for task in tasks:
        for seed in range(args.seeds):
            theta0 = race.init_policy(task, args.length, seed)
            warm_args = argparse.Namespace(**{**vars(args), "steps": args.warm_steps})
            warm = train_to(task, seed, warm_args)
            for stage, theta in (("initial", theta0), (f"after {args.warm_steps} GRPO steps", warm)):
                gen = torch.Generator().manual_seed(20_000 + seed)
                for row in gradient_study(task, theta, args, gen):
                    grad_rows.append({"task": task.name, "policy": stage, "seed": seed, **row})
        common.log(f"credit: gradients on {task.name} done ({time.time() - t0:.0f}s)")
    grad_summary = []
    for task in tasks:
        for stage in dict.fromkeys(r["policy"] for r in grad_rows):
            for c in estimators():
                sel = [
                    r
                    for r in grad_rows
                    if r["task"] == task.name and r["policy"] == stage and r["estimator"] == c.label
                ]
                grad_summary.append(
                    {
                        "task": task.name,
                        "policy": stage,
                        "estimator": c.label,
                        **{
                            k: float(np.mean([r[k] for r in sel]))
                            for k in ("rel_variance", "mean_cos_to_true", "cos_of_mean_to_true")
                        },
                    }
                )
    common.write_csv(out / "gradients_runs.csv", grad_rows)
    common.write_csv(out / "gradients.csv", grad_summary)
    contenders = [
        Contender("vanilla + grpo", "vanilla"),
        *(Contender(f"vanilla + span lam={x:g}", "vanilla", credit=x) for x in args.race_lams),
        Contender("maspo W=4 + grpo", "maspo", policy_loss={"segment_rule": "fixed", "segment_window": 4}),
        *(
            Contender(
                f"maspo W=4 + span lam={x:g}",
                "maspo",
                policy_loss={"segment_rule": "fixed", "segment_window": 4},
                credit=x,
            )
            for x in args.race_lams
        ),
    ]
    curves, rows, summary = race.race(tasks, contenders, args, t0)
    race.write_tables(out, curves, rows, summary, prefix="race")
    race.plot(curves, tasks, contenders, args, out / "race_reward.png")
    write_report(out, grad_summary, summary, args, time.time() - t0)
    common.report_written(out)


def train_to(task: RaceTask, seed: int, args) -> torch.Tensor:
    """The policy after ``args.steps`` steps of the race's GRPO + vanilla training loop."""
    if args.steps == 0:
        return race.init_policy(task, args.length, seed)
    return race.train(task, Contender("grpo", "vanilla"), seed, args, return_policy=True)


def write_report(out, grad_summary, summary, args, seconds) -> None:
    lines = [
        "# Span credit vs GRPO advantages (toy tasks)",
        "",
        f"Made by the command in `COMMAND.txt` ({seconds:.0f} s on CPU). Tables: `gradients.csv` (per seed: "
        "`gradients_runs.csv`), `race_summary.csv` (per run: `race_runs.csv`, curves: `race_curves.csv`, "
        "plot: `race_reward.png`).",
        "",
        "## Setup",
        "",
        f"- The race's tasks (`maspo_verl.lab.studies.race`): T={args.length}, vocabulary {VOCAB}, position-dependent "
        "bigram policy. `speech`: reward = fraction of runs of 4 reproduced; `text`: fraction of tokens right. "
        "An error span = a wrong run (speech) or a wrong token (text).",
        "- Per-token scores: each error span's penalty 1 spread over its tokens and centred, plus the reward on "
        "the last token (`maspo_verl.speech.spans.token_scores`, what the speech reward returns with "
        "`token_scores=true`). `grpo (verl)`: verl's `compute_grpo_outcome_advantage` on the reward; "
        "`span lam=x`: `maspo_span_grpo` (verl registry) = the same GRPO advantage + x * the group-max-normalised "
        "local term.",
        f"- Gradients: {args.batches} independent batches of {args.groups} groups x {args.group_size} per policy "
        f"and seed ({args.seeds} seeds), the same samples for every estimator; on-policy gradient of "
        "sum A log pi / (B T). True gradient: exact expected reward by a forward recursion, autograd. "
        "`rel_variance` = E||g - mean g||^2 / ||mean g||^2 (lower: fewer samples for the same accuracy); "
        "`mean_cos_to_true`: how well one batch's gradient points uphill; `cos_of_mean_to_true`: the direction "
        "of the estimator's expectation (1 for an unbiased one, up to GRPO's own std normalisation).",
        f"- Race: the race's loop ({args.groups} x {args.group_size} per step, {args.epochs} PPO epochs x "
        f"{args.minibatches} mini-batches, Adam lr {args.lr}, {args.steps} steps, {args.seeds} seeds); "
        f"steps to target = first step where the 3-step moving average reaches {args.target}.",
        "",
        "## Gradient quality (mean over seeds)",
        "",
        common.markdown_table(grad_summary),
        "## Race",
        "",
        common.markdown_table(summary),
        "## Findings (generated from the tables above)",
        "",
        *findings(grad_summary, summary),
        "",
        "Caveats: a tabular toy policy whose reward units are exactly the error spans (no ASR or timing "
        "noise); the real recipe's spans come from Whisper's word timings, which are coarser.",
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def findings(grad_summary: list[dict], summary: list[dict]) -> list[str]:
    lines = []
    for r0 in (r for r in grad_summary if r["estimator"].startswith("grpo")):
        peers = [r for r in grad_summary if r["task"] == r0["task"] and r["policy"] == r0["policy"]]
        best = min(peers, key=lambda r: r["rel_variance"])
        lines.append(
            f"- **{r0['task']}, {r0['policy']} policy**: relative gradient variance GRPO {r0['rel_variance']:.3g}; "
            + ", ".join(f"{r['estimator']} {r['rel_variance']:.3g}" for r in peers if r is not r0)
            + f". Lowest: {best['estimator']}. Mean cosine of one batch's gradient to the true one: GRPO "
            f"{r0['mean_cos_to_true']:.3f} vs {best['estimator']} {best['mean_cos_to_true']:.3f}; direction of the "
            f"mean: GRPO {r0['cos_of_mean_to_true']:.3f} vs {best['cos_of_mean_to_true']:.3f}."
        )
    for task in dict.fromkeys(r["task"] for r in summary):
        rows = [r for r in summary if r["task"] == task]
        for loss in ("vanilla", "maspo W=4"):
            base = next(r for r in rows if r["loss"] == f"{loss} + grpo")
            others = [r for r in rows if r["loss"].startswith(loss + " + span")]
            lines.append(
                f"- **race, {task}, {loss} loss**: GRPO final {base['final_reward']:.3f}, median steps to target "
                f"{common.fmt(base['median_steps_to_target'], 1)} ({base['reached_target']}); "
                + "; ".join(
                    f"{r['loss'].split(' + ')[1]}: final {r['final_reward']:.3f}, median steps "
                    f"{common.fmt(r['median_steps_to_target'], 1)} ({r['reached_target']})"
                    for r in others
                )
                + "."
            )
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    race.race_arguments(p)
    p.add_argument("--batches", type=int, default=100, help="batches per policy for the gradient statistics")
    p.add_argument("--warm-steps", type=int, default=8, help="GRPO steps before the second gradient study")
    p.add_argument("--race-lams", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0, 2.0])
