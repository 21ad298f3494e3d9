"""The grid's engine (``lab regimes``, ``regimes_tuned``, ``granularity``, ``drift``): a tabular policy (a
position-dependent bigram logit table, exact log-probs), verl's GRPO advantage (``compute_grpo_outcome_advantage``)
and every loss preset exactly as a user configures it: each ``hydra_configs/loss/*.yaml`` is discovered and composed
through the trainer's config (``maspo_verl.reference.compose_config`` and ``maspo_verl.main.loss_section``), and its
loss fetched from verl's registry (``get_policy_loss_fn``) and called as verl's ``ppo_loss`` calls it, with the
micro-batch's response ids, word ids and the vocabulary's text in scope (``maspo_verl.batch``). A preset
whose call fails on what the engine provides is reported as skipped with its error, not dropped.

Seeds are a batch dimension: each seed has its own table (its own Adam moments: Adam is element-wise) and
one loss call covers all seeds' rows. With fixed-length responses every verl aggregation mode is a mean over
equal-sized per-seed blocks, so the call's loss times the number of seeds has, for each seed's table,
exactly that seed's gradient (``tests/lab/test_regimes.py`` checks it against per-seed float64 calls).

Tasks (``--tasks``):

- ``speech``: 50 Hz speech-like. The target is a sequence of units ("phonemes") of 3-15 frames (durations
  drawn log-normal, median 6 frames = 120 ms; the last one cut at the response's end), no unit the same as
  the one before. Token ids are XCodec2-like
  codes in Llasa's id range (``CODEC_OFFSET`` + code): each of the 8 symbols is one FSQ code, the codes
  pairwise 12+ apart in FSQ digit L1 distance, so ``tokenval`` finds the runs. The initial policy is
  persistent (neighbouring frames tied). Reward = fraction of units recognised, a unit recognised when more
  than half of its frames carry its symbol (units are scored, not tokens). The "ASR words" (``words`` rule)
  are the runs of the response.
- ``text``: text-like. Tokens are words (" ka", " lo", ...) and "." (sentences of 4-11 words), weak random
  initial dependence on the previous token, no two equal neighbours in the target; reward = fraction of
  tokens right. Each token is a "word"; the vocabulary's text lets ``delimiters`` (``maspo_steps``) cut at
  sentence ends.

Mismatch (``--mismatch``): the responses are sampled by a rollout policy and the old log-probs are that
policy's own (verl's bypass mode: the inference engine's log-probs are the old log-probs):

- ``none``: the rollout policy is the trained one (fp32);
- ``bf16`` / ``fp16``: the trained table rounded to that precision (the rollout's weights and logits), its
  log-softmax in float32;
- ``stale<K>`` (e.g. ``stale2``): the trained table as it was K optimizer updates earlier (asynchronous RL);
- ``noise<SIGMA>`` (e.g. ``noise0.2``): samples from the trained policy, Gaussian noise of that sigma on each
  reported log-prob (the instrument of ``lab learn``; perturbed numbers, not a policy mismatch).

Each run reports the measured token-level log-ratio spread at each batch's first update (sd over tokens of
log pi_theta - old log-prob; for ``none`` with 1 update exactly 0).

Updates per batch (``--updates``): the batch is split into that many mini-batches, one optimizer update each.
Per run: final reward (last ``--last`` steps), reward AUC (mean over all steps), steps to step 0's reward +
``--gain`` (3-step moving average; not reached: steps + 1), collapse (non-finite loss or gradient, or the
final reward ``COLLAPSE_DROP`` below the best 3-step average), the gradient norm of the seed's table (mean over
updates), verl's ``actor/pg_clipfrac`` (per cell and step, a mean over the seeds of the call).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from maspo_verl.lab.engine import journal, tabular
from maspo_verl.lab.engine.cells import UNIT_MEDIAN, Cell, parse_mismatch
from maspo_verl.lab.engine.presets import Preset, loss_call, preset_config
from maspo_verl.lab.engine.tabular import CODEC_OFFSET, CODES, TEXT_END, VOCAB

COLLAPSE_DROP = 0.1
TASKS = ("speech", "text")
# what a preset's ``control`` feeds the words rule instead of the response's runs: its runs shuffled, or the
# target's units (the reward's units) aligned, with each boundary moved to its unit's midpoint, or shuffled
CONTROLS = ("shuffled", "units", "units_offset", "units_shuffled")
# the segment lengths a job records (mean over its loss calls, pooled over seeds): column -> the loss's metric
LENGTH_METRICS = {
    "segment_len": "actor/ratio/segment_len_mean",
    "adaptive_len": "actor/ratio/adaptive_len",
    "adaptive_vif": "actor/ratio/adaptive_vif",
    "adaptive_bias": "actor/ratio/adaptive_bias",
}


@dataclass
class Task:
    name: str
    target: torch.Tensor  # [S, T] symbols
    unit_id: torch.Tensor  # [S, T] index of the reward unit of each frame
    n_units: torch.Tensor  # [S]
    persistence: float
    noise: float

    def reward(self, y: torch.Tensor) -> torch.Tensor:
        """[S, N, T] symbols -> [S, N] rewards."""
        right = (y == self.target[:, None, :]).float()
        if self.name == "text":
            return right.mean(-1)
        S, N, T = y.shape
        units = int(self.n_units.max())
        idx = self.unit_id[:, None, :].expand(S, N, T)
        hits = torch.zeros(S, N, units, device=y.device).scatter_add_(2, idx, right)
        size = torch.zeros(S, 1, units, device=y.device)
        size = size.scatter_add_(2, self.unit_id[:, None, :], torch.ones(S, 1, T, device=y.device))
        ok = (hits > size / 2) & (size > 0)
        return ok.sum(-1).float() / self.n_units[:, None].float()

    def token_ids(self, y: torch.Tensor) -> torch.Tensor:
        if self.name == "speech":
            return CODEC_OFFSET + torch.tensor(CODES, device=y.device)[y]
        return y

    def word_ids(self, y: torch.Tensor) -> torch.Tensor:
        """Per token the index of its recognised "word": a run of one symbol (speech), each token (text)."""
        if self.name == "text":
            return torch.arange(y.shape[-1], device=y.device).expand(y.shape).clone()
        change = torch.ones_like(y)
        change[..., 1:] = (y[..., 1:] != y[..., :-1]).long()
        return change.cumsum(-1) - 1


def make_task(name: str, length: int, seeds: list[int], unit: int = UNIT_MEDIAN) -> Task:
    """``unit``: the speech-like task's median unit length in frames (durations within unit/2 .. 2.5 unit)."""
    targets, units, counts = [], [], []
    shortest, longest = max(1, round(unit / 2)), round(2.5 * unit)
    for s in seeds:
        g = torch.Generator().manual_seed(1000 + s)
        if name == "speech":
            # phoneme-like durations: log-normal, median `unit` frames (6: 120 ms at 50 Hz), within 3..15 for 6
            sym, unit_of, t, k, prev = [], [], 0, 0, -1
            while t < length:
                d = torch.exp(math.log(unit) + 0.45 * torch.randn(1, generator=g))
                d = int(d.round().clamp(shortest, longest))
                d = min(d, length - t)
                choice = int(torch.randint(VOCAB - 1, (1,), generator=g))
                v = choice if choice < prev or prev < 0 else choice + 1  # not the previous unit's symbol
                sym += [v] * d
                unit_of += [k] * d
                t, k, prev = t + d, k + 1, v
            targets.append(sym)
            units.append(unit_of)
            counts.append(k)
        else:
            sym, t, prev = [], 0, -1
            while t < length:
                n = int(torch.randint(4, 12, (1,), generator=g))
                for _ in range(n):
                    choice = int(torch.randint(TEXT_END - 1, (1,), generator=g))
                    v = choice if choice < prev or prev < 0 else choice + 1
                    sym.append(v)
                    prev = v
                sym.append(TEXT_END)
                prev = TEXT_END
                t += n + 1
            targets.append(sym[:length])
            units.append(list(range(length)))
            counts.append(length)
    persistence, noise = (3.0, 0.3) if name == "speech" else (0.0, 0.5)
    return Task(name, torch.tensor(targets), torch.tensor(units), torch.tensor(counts), persistence, noise)


def init_tables(task: Task, length: int, seeds: list[int]) -> torch.Tensor:
    """[S, T, V+1, V] logit tables (row V: the first token's context)."""
    return torch.stack([tabular.initial_table(length, VOCAB, task.persistence, task.noise, s) for s in seeds])


def log_prob_table(theta: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """log-softmax over the last axis; ``bf16``/``fp16``: of the table rounded to that precision (the rollout's
    weights and logits), computed in float32 as inference engines do."""
    if precision != "fp32":
        theta = theta.to(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[precision])).float()
    return torch.log_softmax(theta, -1)


def gather(table: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Log-probs [S, N, T] of responses ``y`` [S, N, T] under ``table`` [S, T, V+1, V] (one flat gather)."""
    S, N, T = y.shape
    prev = torch.cat([torch.full((S, N, 1), VOCAB, device=y.device), y[..., :-1]], -1)
    s = torch.arange(S, device=y.device)[:, None, None]
    t = torch.arange(T, device=y.device)[None, None, :]
    flat = ((s * T + t) * (VOCAB + 1) + prev) * VOCAB + y
    return table.reshape(-1)[flat]


@torch.no_grad()
def sample(table: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` responses per seed from ``table`` (inverse CDF, exact): symbols [S, n, T] and their log-probs."""
    S, T = table.shape[0], table.shape[1]
    u = torch.rand(T, S * n, 1, generator=gen).to(table.device)  # the CPU generator: the same draws on any device
    cdf = table.exp().cumsum(-1)
    cdf[..., -1] = 2.0  # rounding never leaves u above the last bin
    by_t = cdf.transpose(0, 1).reshape(T, S * (VOCAB + 1), VOCAB)  # [T, S*(V+1), V]
    base = torch.arange(S, device=table.device).repeat_interleave(n) * (VOCAB + 1)
    prev = torch.full((S * n,), VOCAB, device=table.device)
    ys = torch.empty(T, S * n, dtype=torch.long, device=table.device)
    for t in range(T):
        prev = (by_t[t].index_select(0, base + prev) <= u[t]).sum(-1)
        ys[t] = prev
    y = ys.T.reshape(S, n, T)
    return y, gather(table, y)


@dataclass(frozen=True)
class Job:
    task: str
    length: int
    mismatch: str
    updates: int
    preset: Preset
    lr: float | None = None  # None: --lr
    unit: int = UNIT_MEDIAN  # the speech-like task's median unit length
    seeds: tuple[int, ...] = ()  # the job's seeds (empty: --first-seed .. + --seeds)

    @property
    def cell(self) -> str:
        return Cell(self.length, self.mismatch, self.updates, self.lr, self.unit).label


def shuffled_runs(words: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The control of the ``words`` rule: each row's runs (its word ids' segments) in a random order, so the
    segments have the row's own lengths but do not line up with its units."""
    flat = words.reshape(-1, words.shape[-1]).cpu().numpy()
    rng = np.random.default_rng(int(torch.randint(2**31, (1,), generator=gen)))
    out = np.empty_like(flat)
    for i, row in enumerate(flat):  # [rows, T]: a few hundred short rows per update
        lengths = np.bincount(row - row[0])
        out[i] = np.repeat(np.arange(len(lengths)), rng.permutation(lengths[lengths > 0]))
    return torch.from_numpy(out).reshape(words.shape).to(words.device)


def unit_segments(control: str, runs: torch.Tensor, units: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The word ids the words rule is fed under ``control`` ([S, N, T]): ``runs`` (the response's runs) as they
    are or shuffled; ``units`` (the target's units) as they are, shuffled, or with each boundary moved to its
    unit's midpoint (``units_offset``: segments of about the units' lengths, each straddling two units)."""
    if control == "":
        return runs
    if control == "shuffled":
        return shuffled_runs(runs, gen)
    if control == "units":
        return units
    if control == "units_shuffled":
        return shuffled_runs(units, gen)
    if control == "units_offset":
        start = torch.ones_like(units, dtype=torch.bool)
        start[..., 1:] = units[..., 1:] != units[..., :-1]
        t = torch.arange(units.shape[-1], device=units.device)
        first = torch.cummax(torch.where(start, t, 0), -1).values  # each frame's unit start
        size = torch.zeros_like(units).scatter_add_(-1, units, torch.ones_like(units))
        mid = torch.zeros_like(start)
        mid.scatter_(-1, first + size.gather(-1, units) // 2, True)  # each unit's midpoint starts a segment
        ids = mid.long().cumsum(-1)
        return ids - ids[..., :1]
    raise ValueError(f"control {control!r}: allowed '' or {CONTROLS}")


def drift_sums(delta: torch.Tensor, units: torch.Tensor) -> dict:
    """Correlation sums (``maspo_verl.core.losses``) of log-ratios ``delta`` [S, N, T]; ``units``: the runs
    of one symbol (the segments of VIF(units))."""
    from maspo_verl.core.metrics import correlation_sums

    rows = delta.shape[0] * delta.shape[1]
    d, u = delta.reshape(rows, -1).double(), units.reshape(rows, -1)
    return {k: v.cpu() for k, v in correlation_sums(d, torch.ones_like(d, dtype=torch.bool), u).items()}


def drift_metrics(sums: dict | None, prefix: str = "drift_") -> dict:
    """lag-1, VIF(5/15/50) and VIF over the units of ``drift_sums`` pooled (NaN where not defined)."""
    from maspo_verl.core.metrics import correlation_metrics, host_sums

    m = correlation_metrics(host_sums(sums), prefix="") if sums else {}
    names = {"corr_lag1": "lag1", "vif5": "vif5", "vif15": "vif15", "vif50": "vif50", "vif_segments": "vif_units"}
    return {prefix + new: m.get(old, float("nan")) for old, new in names.items()}


def null_correlation(length: int, rows: int = 4096, seed: int = 0) -> dict:
    """The same metrics of independent log-ratios in rows of ``length`` tokens: the reference a measured value is
    read against (centring each row pulls VIF(n) below 1, to about 1 - n / length)."""
    from maspo_verl.core.metrics import correlation_sums

    d = torch.randn(rows, length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    sums = correlation_sums(d, torch.ones_like(d, dtype=torch.bool))
    return {k: v for k, v in drift_metrics(sums, "null_").items() if k != "null_vif_units"}


def _add(total: dict | None, sums: dict) -> dict:
    return sums if total is None else {k: total[k] + v for k, v in sums.items()}


def backward(theta, fn, cfg, y, old, adv, ids, words):
    """One update's loss on [S, m, T] rows: each seed's table gets that seed's gradient of verl's loss
    (the call covers every seed; with equal per-seed blocks, S x the loss is the sum of the seeds' losses).
    Returns the loss, verl's metrics and the current log-probs (detached)."""
    S, m, T = y.shape
    lp = gather(torch.log_softmax(theta, -1), y)
    flat = [x.reshape(S * m, T) for x in (old, lp, adv, ids, words)]
    loss, metrics = loss_call(fn, cfg, *flat)
    (loss * S).backward()
    return loss.detach(), metrics, lp.detach()


def run_job(job: Job, args) -> dict:
    """Train ``job.preset`` in its cell for every seed at once: per-seed records and per-step curves."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_policy_loss_fn

    import maspo_verl.plugin  # noqa: F401  (registers our losses)
    from maspo_verl.lab.engine.common import finite_mean

    torch.set_num_threads(1)
    device = torch.device(getattr(args, "device", "cpu"))
    first = getattr(args, "first_seed", 0)
    seeds = list(job.seeds or range(first, first + args.seeds))
    S, G, n, U = len(seeds), args.groups, args.group_size, job.updates
    N = G * n
    task = make_task(job.task, job.length, seeds, job.unit)
    task.target, task.unit_id, task.n_units = (x.to(device) for x in (task.target, task.unit_id, task.n_units))
    theta = init_tables(task, job.length, seeds).to(device).requires_grad_()
    opt = torch.optim.Adam([theta], lr=job.lr if job.lr is not None else args.lr)
    fn, cfg = get_policy_loss_fn(job.preset.loss_mode), preset_config(job.preset)
    mismatch = parse_mismatch(job.mismatch)
    gen = torch.Generator().manual_seed(args.sample_seed)
    # the units controls shuffle with a generator of their own, so every arm draws the same samples from ``gen``
    # (the committed ``shuffled`` runs drew from ``gen``)
    control_gen = gen if job.preset.control == "shuffled" else torch.Generator().manual_seed(args.sample_seed + 1)
    target_units = task.unit_id[:, None, :].expand(S, N, job.length)
    history = [theta.detach().clone()]  # the table after each update (stale rollouts)
    index = np.repeat(np.arange(S * G), n)
    rewards, grads, clipfracs, kls, spreads, finite = [], [], [], [], [], torch.ones(S, dtype=torch.bool, device=device)
    drift = seen = None  # correlation sums: after each batch's updates; in each loss call
    lengths = {name: [] for name in LENGTH_METRICS}  # segment lengths per loss call (nan: not reported)
    for _ in range(args.steps):
        rollout = history[max(0, len(history) - 1 - mismatch.stale)] if mismatch.stale else theta.detach()
        y, old = sample(log_prob_table(rollout, mismatch.dtype), N, gen)
        if mismatch.sigma:
            old = old + mismatch.sigma * torch.randn(old.shape, generator=gen).to(device)
        r = task.reward(y)  # [S, N]
        rewards.append(r.mean(-1).cpu())
        adv = compute_grpo_outcome_advantage(r.reshape(-1, 1).cpu(), torch.ones(S * N, 1), index)[0]
        adv = adv.to(device).reshape(S, N, 1).expand(S, N, job.length)
        ids, units = task.token_ids(y), task.word_ids(y)
        words = unit_segments(job.preset.control, units, target_units, control_gen)
        perm = torch.randperm(N, generator=gen).to(device)
        step_grad, step_clip, step_kl = [], [], []
        for k in range(U):
            rows = perm[k * N // U : (k + 1) * N // U]
            opt.zero_grad()
            loss, metrics, lp = backward(theta, fn, cfg, *(x[:, rows] for x in (y, old, adv, ids, words)))
            if k == 0:
                spreads.append((lp - old[:, rows]).reshape(S, -1).std(-1))
            seen = _add(seen, drift_sums(lp - old[:, rows], units[:, rows]))
            g = theta.grad.reshape(S, -1).norm(dim=-1)
            finite &= torch.isfinite(g) & bool(torch.isfinite(loss))
            step_grad.append(g)
            opt.step()
            history = (history + [theta.detach().clone()])[-(mismatch.stale + 1) :]
            step_clip.append(float(metrics.get("actor/pg_clipfrac", float("nan"))))
            step_kl.append(float(metrics.get("actor/ppo_kl", float("nan"))))
            for name, key in LENGTH_METRICS.items():
                lengths[name].append(float(metrics.get(key, float("nan"))))
        with torch.no_grad():  # the drift after the batch's updates, on all its responses
            drift = _add(drift, drift_sums(gather(torch.log_softmax(theta, -1), y) - old, units))
        grads.append(torch.stack(step_grad).mean(0))
        clipfracs.append(float(np.mean(step_clip)))
        kls.append(float(np.mean(step_kl)))
    curve = torch.stack(rewards, 1).numpy()  # [S, steps]
    grad = torch.stack(grads, 1).cpu().numpy()
    spread = torch.stack(spreads, 1).cpu().numpy()
    # pooled over the job's seeds and steps
    correlation = drift_metrics(drift) | drift_metrics(seen, "seen_")
    finite = finite.cpu()
    records = []
    for i, s in enumerate(seeds):
        records.append(
            {
                "task": job.task,
                "cell": job.cell,
                "length": job.length,
                "mismatch": job.mismatch,
                "updates": job.updates,
                "loss": job.preset.name,
                "band": job.preset.band,
                "lr": job.lr if job.lr is not None else args.lr,
                "seed": s,
                **summarise_run(curve[i], args, bool(finite[i])),
                "grad_norm": float(grad[i].mean()),
                "logratio_sd": float(spread[i].mean()),
                "clipfrac": float(np.mean(clipfracs)),
                "ppo_kl": float(np.mean(kls)),
                **{name: finite_mean(values) for name, values in lengths.items()},
                **correlation,
            }
        )
    steps = [
        {
            "task": job.task,
            "cell": job.cell,
            "loss": job.preset.name,
            "band": job.preset.band,
            "step": t,
            "reward": float(curve[:, t].mean()),
            "clipfrac": clipfracs[t],
            "grad_norm": float(grad[:, t].mean()),
            "logratio_sd": float(spread[:, t].mean()),
        }
        for t in range(args.steps)
    ]
    return {"records": records, "steps": steps}


def summarise_run(curve: np.ndarray, args, finite: bool) -> dict:
    k = min(args.last, len(curve))
    smooth = np.convolve(curve, np.ones(3) / 3, mode="valid") if len(curve) >= 3 else curve
    final = float(curve[-k:].mean())
    target = float(curve[0]) + args.gain
    hit = np.nonzero(smooth >= target)[0]
    reached = int(hit[0]) + 3 if len(hit) else None
    collapse = (not finite) or final < float(smooth.max()) - COLLAPSE_DROP or not math.isfinite(final)
    return {
        "first_reward": float(curve[0]),
        "final_reward": final,
        "auc": float(curve.mean()),
        "steps_to_target": reached,
        "steps_to_target_c": reached if reached is not None else args.steps + 1,
        "collapse": bool(collapse),
    }


def probe(preset: Preset, task: str) -> str | None:
    """None if the preset's loss runs on what the engine provides for ``task`` (a tiny call), else why not."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    import maspo_verl.plugin  # noqa: F401

    t = make_task(task, 24, [0])
    y = torch.randint(VOCAB, (1, 4, 24), generator=torch.Generator().manual_seed(0))
    lp = torch.randn(4, 24).mul(0.1).sub(1.0).requires_grad_()
    try:
        fn, cfg = get_policy_loss_fn(preset.loss_mode), preset_config(preset)
        loss, _ = loss_call(fn, cfg, lp.detach() + 0.01, lp, torch.randn(4, 24), t.token_ids(y)[0], t.word_ids(y)[0])
        loss.backward()
        if not torch.isfinite(loss) or lp.grad is None or not torch.isfinite(lp.grad).all():
            return "the loss or its gradient is not finite on the engine's inputs"
    except Exception as exc:  # noqa: BLE001 - reported in regimes_skipped.csv
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return None


def engine_arguments(p: argparse.ArgumentParser, lr_help: str = "Adam learning rate") -> None:
    """The engine's knobs, shared by every study on it (``regimes``, ``regimes_tuned``, ``granularity``)."""
    p.add_argument("--steps", type=int, default=20, help="training steps (batches) per run")
    p.add_argument("--groups", type=int, default=3, help="prompts (GRPO groups) per batch")
    p.add_argument("--group-size", type=int, default=8, help="responses per group")
    p.add_argument("--lr", type=float, default=0.2, help=lr_help)
    p.add_argument("--gain", type=float, default=0.2, help="steps to target: step 0's reward + GAIN")
    p.add_argument("--last", type=int, default=5, help="final reward = mean of the last K steps")
    p.add_argument("--sample-seed", type=int, default=0, help="the sampling generator's seed (same for every preset)")
    p.add_argument("--device", default="cpu", help="torch device of the tables (cpu, cuda)")
    p.add_argument("--workers", type=int, default=2, help="processes (one torch thread each)")


def _work(item):
    job, args = item
    t0 = time.time()
    out = run_job(job, args)
    out["seconds"] = time.time() - t0
    out["job"] = job
    return out


def run_jobs(jobs: list[Job], args, out: Path, runs_csv: str, curves_csv: str | None = None, kept=()) -> list[dict]:
    """Run ``jobs`` on ``args.workers`` processes; every finished job's rows (after ``kept``) are written to
    ``out/runs_csv`` at once (and its per-step curves to ``curves_csv``), so an interrupted study resumes from
    them; the run time and the machine's load go to ``COMMAND.txt``. Returns the rows."""
    from maspo_verl.lab.engine import common

    name = getattr(args, "command", None) or out.name
    seeds = "/".join(str(n) for n in sorted({len(j.seeds) for j in jobs if j.seeds})) or args.seeds
    common.log(f"{name}: {len(jobs)} jobs x {seeds} seeds on {args.workers} processes ({args.device})")
    t0, records, steps, load = time.time(), list(kept), [], [journal.load()]
    plain = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in ("module", "func")})
    items = [(j, plain) for j in jobs]
    pool = None
    if args.workers > 1:
        pool = mp.get_context("spawn" if args.device != "cpu" else "fork").Pool(args.workers)
    try:
        for i, res in enumerate(pool.imap_unordered(_work, items) if pool else map(_work, items)):
            records += res["records"]
            steps += res["steps"]
            j = res["job"]
            common.log(
                f"{name} [{i + 1}/{len(jobs)}] {j.task} {j.cell} {j.preset.name} x{j.preset.band}: final "
                f"{np.mean([r['final_reward'] for r in res['records']]):.3f} ({res['seconds']:.1f}s; "
                f"{time.time() - t0:.0f}s in all)"
            )
            if i % 20 == 0:
                load.append(journal.load())
            common.write_csv(out / runs_csv, records)
            if curves_csv:
                common.write_csv(out / curves_csv, steps)
    finally:
        if pool:
            pool.close()
    load.append(journal.load())
    seconds = time.time() - t0
    what = f"{args.workers} processes, {len(jobs)} jobs, device {args.device}"
    journal.run_time(out, seconds, what, load, "every 20 jobs")
    return records
