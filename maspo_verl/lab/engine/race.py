"""The toy RL race's engine: GRPO on CPU with verl's and our policy losses, called through verl's registry.

Two tasks with a sequence-level reward (one scalar per response, on its last token):

- ``speech``: the policy starts strongly persistent (neighbouring tokens tied, as codec frames are)
  and must produce a target made of runs (e.g. 0000 2222 1111); reward = fraction of the runs
  reproduced exactly.
- ``text``: the policy starts with weak, random dependence on the previous token and must produce
  a target with no runs; reward = fraction of tokens right.

The policy is a position-dependent bigram table ``theta[T, V+1, V]`` (tiny, exact log-probs).
Each step samples ``groups x group_size`` responses, computes verl's GRPO advantage
(``compute_grpo_outcome_advantage``), then runs ``epochs`` PPO epochs over ``minibatches``
mini-batches, so later updates are off-policy and the ratios matter. Every loss is fetched with
``verl.trainer.ppo.core_algos.get_policy_loss_fn`` and given a real verl ``ActorConfig`` whose
``policy_loss`` is ``maspo_verl.config.GranularLossConfig``. The studies ``race`` and ``credit`` run on it.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_adv_estimator_fn, get_policy_loss_fn
from verl.workers.config import ActorConfig

import maspo_verl.plugin  # noqa: F401  (registers maspo, ctpo, pgspo)
from maspo_verl.advantages import SPAN_GRPO
from maspo_verl.config import actor_config
from maspo_verl.lab.engine import common, tabular
from maspo_verl.speech.spans import ErrorSpan, token_penalties, token_scores


@dataclass(frozen=True)
class Contender:
    label: str
    loss_mode: str
    clip_low: float = 0.2
    clip_high: float = 0.28
    policy_loss: dict = field(default_factory=dict)
    credit: float | None = None  # None: verl's grpo advantage; else maspo_span_grpo with this lam


def contender_config(c: Contender) -> ActorConfig:
    return actor_config(c.clip_low, c.clip_high, loss_mode=c.loss_mode, **c.policy_loss)


# ------------------------------------------------------------------ tasks and policy
VOCAB = 4


@dataclass
class RaceTask:
    name: str
    target: torch.Tensor  # [T]
    unit: int  # reward unit length (run length for speech, 1 for text)
    persistence: float  # initial self-transition logit
    noise: float  # initial random logit scale

    def unit_errors(self, y: torch.Tensor) -> torch.Tensor:
        """Bool [B, T / unit]: which reward units (runs, or tokens) are wrong."""
        return ~(y == self.target).reshape(y.shape[0], -1, self.unit).all(-1)

    def reward(self, y: torch.Tensor) -> torch.Tensor:
        return 1.0 - self.unit_errors(y).float().mean(-1)

    def token_scores(self, y: torch.Tensor, penalty: float = 1.0) -> torch.Tensor:
        """Per-token scores [B, T] as the speech reward builds them: each wrong unit is an error span
        (``maspo_verl.speech.spans``), its penalty spread over the unit and centred, plus the reward
        on the last token. Sums to ``reward(y)`` per row."""
        r, wrong = self.reward(y).tolist(), self.unit_errors(y).tolist()
        rows = []
        for score, errs in zip(r, wrong, strict=True):
            found = [
                ErrorSpan("substitute", k * self.unit, (k + 1) * self.unit, "", "") for k, e in enumerate(errs) if e
            ]
            rows.append(token_scores(score, token_penalties(found, y.shape[1], penalty)))
        return torch.tensor(rows)


def make_task(name: str, length: int) -> RaceTask:
    if name == "speech":
        unit = 4
        runs = torch.tensor([0, 2, 1, 3, 2, 0, 3, 1])[: length // unit]
        return RaceTask(name, runs.repeat_interleave(unit), unit, persistence=2.5, noise=0.3)
    g = torch.Generator().manual_seed(7)
    target = torch.randint(VOCAB, (length,), generator=g)
    for t in range(1, length):  # no runs
        if target[t] == target[t - 1]:
            target[t] = (target[t] + 1) % VOCAB
    return RaceTask(name, target, 1, persistence=0.0, noise=0.5)


def init_policy(task: RaceTask, length: int, seed: int) -> torch.Tensor:
    return tabular.initial_table(length, VOCAB, task.persistence, task.noise, seed).requires_grad_()


def log_probs(theta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    B, T = y.shape
    prev = torch.cat([torch.full((B, 1), VOCAB), y[:, :-1]], 1)
    table = torch.log_softmax(theta, -1)  # [T, V+1, V]
    return table[torch.arange(T)[None, :], prev, y]


@torch.no_grad()
def sample(theta: torch.Tensor, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses [B, T] and the mean per-token entropy along them."""
    T = theta.shape[0]
    prev = torch.full((batch,), VOCAB)
    ys, ent = [], []
    for t in range(T):
        p = torch.softmax(theta[t, prev], -1)
        y = torch.multinomial(p, 1, generator=gen).squeeze(1)
        ent.append(-(p * p.clamp_min(1e-12).log()).sum(-1))
        ys.append(y)
        prev = y
    return torch.stack(ys, 1), torch.stack(ent, 1).mean()


def train(task: RaceTask, c: Contender, seed: int, args, return_policy: bool = False):
    """One training run: its curves, or with ``return_policy`` the final policy table."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(10_000 + seed)
    theta = init_policy(task, args.length, seed)
    opt = torch.optim.Adam([theta], lr=args.lr)
    loss_fn = get_policy_loss_fn(c.loss_mode)
    cfg = contender_config(c)
    B = args.groups * args.group_size
    index = np.repeat(np.arange(args.groups), args.group_size)
    rewards, entropies, kls, clipfracs = [], [], [], []
    for _ in range(args.steps):
        y, ent = sample(theta, B, gen)
        r = task.reward(y)
        mask = torch.ones(y.shape, dtype=torch.bool)
        with torch.no_grad():
            old = log_probs(theta, y)
        adv = advantages(task, c, y, r, mask, index)
        rewards.append(float(r.mean()))
        entropies.append(float(ent))
        mb = B // args.minibatches
        step_kl, step_clip = [], []
        for _ in range(args.epochs):
            perm = torch.randperm(B, generator=gen)
            for k in range(args.minibatches):
                idx = perm[k * mb : (k + 1) * mb]
                lp = log_probs(theta, y[idx])
                loss, metrics = loss_fn(old[idx], lp, adv[idx], mask[idx], cfg.loss_agg_mode, cfg, None)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step_kl.append(metrics["actor/ppo_kl"])
                step_clip.append(metrics["actor/pg_clipfrac"])
        kls.append(float(np.mean(step_kl)))
        clipfracs.append(float(np.mean(step_clip)))
    if return_policy:
        return theta.detach()
    return {"reward": rewards, "entropy": entropies, "ppo_kl": kls, "clipfrac": clipfracs}


def advantages(task: RaceTask, c: Contender, y, r, mask, index) -> torch.Tensor:
    """verl's GRPO advantage (reward on the last token), or span credit through verl's registry."""
    if c.credit is None:
        token_rewards = torch.zeros(y.shape)
        token_rewards[:, -1] = r
        return compute_grpo_outcome_advantage(token_rewards, mask.float(), index)[0]
    fn = get_adv_estimator_fn(SPAN_GRPO)
    config = {"norm_adv_by_std_in_grpo": True, "span_credit": {"lam": c.credit}}
    return fn(token_level_rewards=task.token_scores(y), response_mask=mask.float(), config=config, index=index)[0]


def summarise(curve: dict, target: float, entropy0: float) -> dict:
    r = np.asarray(curve["reward"])
    smooth = np.convolve(r, np.ones(3) / 3, mode="valid")
    hit = np.nonzero(smooth >= target)[0]
    final = float(r[-5:].mean())
    best = float(smooth.max())
    ent = np.asarray(curve["entropy"])
    drop = best - final > 0.2
    blowup = bool(ent.max() > 1.2 * entropy0 and ent.max() > ent[0] + 0.1)
    return {
        "steps_to_target": int(hit[0]) + 3 if len(hit) else None,
        "final_reward": final,
        "best_reward": best,
        "final_entropy": float(ent[-5:].mean()),
        "collapse": bool(drop or blowup),
        "mean_ppo_kl": float(np.mean(curve["ppo_kl"])),
        "mean_clipfrac": float(np.mean(curve["clipfrac"])),
    }


def race(tasks: list[RaceTask], contenders: list[Contender], args, t0: float):
    """Train every contender on every task for ``args.seeds`` seeds: (curves, per-run rows, summary)."""
    seeds = list(range(args.seeds))
    curves, rows = {}, []
    for task in tasks:
        for c in contenders:
            per_seed = []
            for s in seeds:
                curve = train(task, c, s, args)
                curves[(task.name, c.label, s)] = curve
                per_seed.append(summarise(curve, args.target, curve["entropy"][0]))
                rows.append({"task": task.name, "loss": c.label, "seed": s, **per_seed[-1]})
            common.log(
                f"race: {task.name} / {c.label}: final {np.mean([p['final_reward'] for p in per_seed]):.3f} "
                f"({time.time() - t0:.0f}s)"
            )
    summary = []
    for task in tasks:
        for c in contenders:
            sel = [r for r in rows if r["task"] == task.name and r["loss"] == c.label]
            hits = [r["steps_to_target"] for r in sel if r["steps_to_target"] is not None]
            fin = np.array([r["final_reward"] for r in sel])
            summary.append(
                {
                    "task": task.name,
                    "loss": c.label,
                    "final_reward": float(fin.mean()),
                    "final_sd": float(fin.std()),
                    "reached_target": f"{len(hits)}/{len(sel)}",
                    "median_steps_to_target": float(np.median(hits)) if hits else float("nan"),
                    "collapses": sum(r["collapse"] for r in sel),
                    "final_entropy": float(np.mean([r["final_entropy"] for r in sel])),
                    "mean_ppo_kl": float(np.mean([r["mean_ppo_kl"] for r in sel])),
                    "mean_clipfrac": float(np.mean([r["mean_clipfrac"] for r in sel])),
                }
            )
    return curves, rows, summary


def write_tables(out, curves, rows, summary, prefix: str = "race") -> None:
    common.write_csv(out / f"{prefix}_runs.csv", rows)
    long_rows = []
    for (tn, lab, s), cv in curves.items():
        for i in range(len(cv["reward"])):
            long_rows.append(
                {
                    "task": tn,
                    "loss": lab,
                    "seed": s,
                    "step": i,
                    "reward": cv["reward"][i],
                    "entropy": cv["entropy"][i],
                    "ppo_kl": cv["ppo_kl"][i],
                    "clipfrac": cv["clipfrac"][i],
                }
            )
    common.write_csv(out / f"{prefix}_curves.csv", long_rows)
    common.write_csv(out / f"{prefix}_summary.csv", summary)


def plot(curves, tasks, contenders, args, path) -> None:
    plt = common.pyplot()
    seeds = list(range(args.seeds))
    fig, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 7), squeeze=False)
    for j, task in enumerate(tasks):
        for c in contenders:
            for i, key in enumerate(("reward", "entropy")):
                arr = np.array([curves[(task.name, c.label, s)][key] for s in seeds])
                m, sd = arr.mean(0), arr.std(0)
                x = np.arange(arr.shape[1])
                axes[i][j].plot(x, m, label=c.label)
                axes[i][j].fill_between(x, m - sd, m + sd, alpha=0.12)
        axes[0][j].axhline(args.target, color="k", ls=":", lw=0.8)
        axes[0][j].set_title(f"{task.name}-like task: batch reward (mean +- sd over {len(seeds)} seeds)", fontsize=9)
        axes[1][j].set_title(f"{task.name}-like task: per-token entropy", fontsize=9)
        for i in range(2):
            axes[i][j].set_xlabel("step")
            axes[i][j].grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def race_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--target", type=float, default=0.8)
