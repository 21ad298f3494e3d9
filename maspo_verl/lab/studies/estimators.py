"""Exact estimator lab: bias and variance of every importance-ratio estimator, by enumeration.

Setting (all exact, float64). Responses y = y_1..y_L from a bigram policy (:mod:`.exact`) with an
EOS token, so lengths vary. Behaviour policy pi_old samples; the target pi_theta = pi_old + eps * D
(D a fixed random logit direction) is the policy being differentiated. Sequence-level reward R(y),
advantage A(y) = R(y) - E_old[R] (the large-group GRPO baseline, no std scaling).

- True gradient:   grad J = E_theta[ R(y) sum_t grad log pi_theta(y_t|y_<t) ]  (= the same with A).
- Prefix-corrected token gradient (CTPO's target, "token-level policy gradient"):
      g_pc = sum_t E_{y_<=t ~ pi_theta, y_>t ~ pi_old}[ A(y) grad log pi_theta(y_t|y_<t) ],
  the token-level gradient whose prefix (state) distribution is corrected to pi_theta but whose
  continuation -- hence the credit A -- still comes from pi_old. It is computed here from the mixed
  probabilities q_t(y) = exp(sum_{u<=t} log pi_theta + sum_{u>t} log pi_old), not from any ratio code.
- Estimator with weights w_t(y):  g_w(y) = sum_t w_t(y) A(y) grad log pi_theta(y_t|y_<t),  y ~ pi_old.
  w_t = exp(l_t), l_t from the loss itself (``maspo_verl.core.losses.loss_body``) applied to
  delta_t = log pi_theta - log pi_old: exactly the value of the shared ratio r_t whose gradient
  r_t grad log pi_t the losses back-propagate (docs/algorithms.md §1). No clipping: clipping is a trust-region
  device that biases every estimator by design; the lab measures the ratios themselves.

For each estimator: E_old[g_w] and Var_old[g_w] = E||g_w - E g_w||^2 (total variance of one sample)
summed over all sequences with their pi_old probabilities. Reported: bias relative to ||grad J||,
cosine with grad J, bias w.r.t. g_pc (also relative to ||grad J||), total variance relative to
||grad J||^2.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch

from maspo_verl.config import GranularLossConfig, actor_config
from maspo_verl.core.losses import loss_body
from maspo_verl.lab.engine import common, journal
from maspo_verl.lab.engine.exact import DTYPE, enumerate_sequences, moments, per_sample_gradients, token_log_probs
from maspo_verl.lab.engine.study import Study

STUDY = Study("estimators", "exact bias/variance of each ratio estimator by enumeration")

CONTENT = 3  # content tokens 0..2
EOS = 3
VOCAB = CONTENT + 1


# ---------------------------------------------------------------- policies, rewards, drift
def behaviour_logits(kind: str, seed: int = 0) -> torch.Tensor:
    """pi_old's logit table [V+1, V] (last row: after BOS).

    ``speech``: strongly persistent tokens (self-transition logit +3, like codec frames whose
    neighbours are tied); ``text``: weak, random dependence on the previous token.
    Both end the response with EOS at a modest rate.
    """
    g = torch.Generator().manual_seed(1000 + seed)
    theta = torch.randn(VOCAB + 1, VOCAB, generator=g, dtype=DTYPE)
    if kind == "speech":
        theta = 0.3 * theta
        theta[:CONTENT, :CONTENT] += 3.0 * torch.eye(CONTENT, dtype=DTYPE)
        theta[:, EOS] = -3.0
    elif kind == "text":
        theta = 0.5 * theta
        theta[:, EOS] = -2.0
    else:
        raise ValueError(kind)

    return theta


def drift_direction(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + seed)
    return torch.randn(VOCAB + 1, VOCAB, generator=g, dtype=DTYPE)


def reward(kind: str, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence-level rewards. ``verifier``: 1 if token 0 is a strict majority of the content
    tokens (0/1, like a math verifier); ``length``: number of content tokens / L (longer is better)."""
    content = mask & (tokens != EOS)
    n = content.sum(-1)
    if kind == "verifier":
        zeros = (content & (tokens == 0)).sum(-1)
        return ((2 * zeros > n) & (n > 0)).to(DTYPE)
    if kind == "length":
        return n.to(DTYPE) / tokens.shape[1]
    raise ValueError(kind)


# ---------------------------------------------------------------- estimators (library ratio code)
@dataclass(frozen=True)
class Estimator:
    name: str
    token_set: str  # none | segments | prefix | sequence
    alpha: float = 1.0
    rule: str = "fixed"
    window: int = 1
    threshold: float = 1.0
    note: str = ""


ESTIMATORS = [
    Estimator("no-IS (w=1)", "none", note="on-policy REINFORCE applied to stale samples"),
    Estimator("token (GRPO)", "segments", window=1, note="maspo fixed W=1 = verl vanilla"),
    Estimator("segment W=2", "segments", window=2),
    Estimator("segment W=4", "segments", window=4),
    Estimator(
        "segment logprob tau=1", "segments", rule="logprob", threshold=1.0, note="boundary at old-logprob drop > 1 nat"
    ),
    Estimator("cumulative cumprod (CTPO)", "prefix", alpha=0.0),
    Estimator("cumulative geomean (CTPO)", "prefix", alpha=1.0),
    Estimator("P-GSPO alpha=0.5", "sequence", alpha=0.5),
    Estimator("GSPO (geo-mean)", "sequence", alpha=1.0, note="= maspo fixed W>=L = pgspo alpha=1"),
    Estimator("full product", "sequence", alpha=0.0, note="= pgspo alpha=0; exact sequence IS"),
]


def loss_config(est: Estimator) -> tuple[str, GranularLossConfig]:
    """The registered loss and its config whose token set and normalisation ``est`` uses."""
    if est.token_set == "prefix":
        return "ctpo", GranularLossConfig(loss_mode="ctpo", ctpo_mode="cumprod" if est.alpha == 0.0 else "geomean")
    if est.token_set == "sequence":
        return "pgspo", GranularLossConfig(loss_mode="pgspo", length_exponent=est.alpha)
    config = GranularLossConfig(
        loss_mode="maspo",
        segment_rule=est.rule,
        segment_window=est.window,
        logprob_threshold=est.threshold,
        length_exponent=est.alpha,
    )
    return "maspo", config


def estimator_weights(est: Estimator, lp_new: torch.Tensor, lp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """w_t = value of the shared ratio r_t = exp(l_t), computed by the losses' own token-set code."""
    if est.token_set == "none":
        return mask.to(DTYPE)
    loss_mode, config = loss_config(est)
    actor = dataclasses.replace(actor_config(), policy_loss=config)
    step = loss_body(
        lp_old, lp_new, torch.zeros_like(lp_new), mask, "token-mean", actor, config, None, loss_mode=loss_mode
    )
    return torch.where(mask, step.ratio, torch.zeros_like(step.ratio))


# ---------------------------------------------------------------- one exact case
@dataclass
class Case:
    tokens: torch.Tensor
    mask: torch.Tensor
    theta_old: torch.Tensor
    theta: torch.Tensor
    rewards: torch.Tensor


def make_case(policy: str, reward_kind: str, length: int, eps: float, seed: int = 0) -> Case:
    tokens, mask = enumerate_sequences(VOCAB, length, eos=EOS)
    old = behaviour_logits(policy, seed)
    return Case(tokens, mask, old, old + eps * drift_direction(seed), reward(reward_kind, tokens, mask))


def analyse(case: Case, estimators=ESTIMATORS) -> tuple[dict, list[dict]]:
    """Exact grad J, g_pc and every estimator's mean/variance for one case."""
    tokens, mask = case.tokens, case.mask
    lp_old = token_log_probs(case.theta_old, tokens, mask)
    lp_new = token_log_probs(case.theta, tokens, mask)
    p_old = lp_old.sum(-1).exp()
    p_new = lp_new.sum(-1).exp()
    adv = case.rewards - (p_old * case.rewards).sum()
    L = tokens.shape[1]
    # true gradient: E_theta[A(y) sum_t score_t]
    g_true = p_new @ per_sample_gradients(case.theta, tokens, mask, adv[:, None].expand(-1, L))
    # prefix-corrected token gradient: sum_t sum_y q_t(y) A(y) score_t(y)
    log_q = torch.cumsum(lp_new, -1) + (lp_old.sum(-1, keepdim=True) - torch.cumsum(lp_old, -1))
    g_pc = per_sample_gradients(case.theta, tokens, mask, log_q.exp() * adv[:, None]).sum(0)
    norm = float(g_true.norm())
    kl = float((p_old * (lp_old.sum(-1) - lp_new.sum(-1))).sum())
    exp_len = float((p_old * mask.sum(-1).to(DTYPE)).sum())
    info = {
        "n_sequences": tokens.shape[0],
        "kl_seq": kl,
        "kl_per_token": kl / exp_len,
        "mean_len": exp_len,
        "reward_old": float((p_old * case.rewards).sum()),
        "reward_new": float((p_new * case.rewards).sum()),
        "grad_norm": norm,
        "g_pc_cos": float(torch.nn.functional.cosine_similarity(g_pc, g_true, dim=0)),
        "g_pc_gap": float((g_pc - g_true).norm()) / norm,
        "prob_sum_err": abs(float(p_old.sum()) - 1.0),
    }
    rows = []
    for est in estimators:
        w = estimator_weights(est, lp_new, lp_old, mask)
        grads = per_sample_gradients(case.theta, tokens, mask, w * adv[:, None])
        mean, var = moments(grads, p_old)
        rows.append(
            {
                "estimator": est.name,
                "bias_rel": float((mean - g_true).norm()) / norm,
                "cos": float(torch.nn.functional.cosine_similarity(mean, g_true, dim=0)),
                "bias_pc_rel": float((mean - g_pc).norm()) / norm,
                "var_rel": var / norm**2,
                "var": var,
                "mse1_rel": (float((mean - g_true).norm()) ** 2 + var) / norm**2,
                "w_max": float(w.max()),
            }
        )
    return info, rows


# ---------------------------------------------------------------- command
POLICIES = ("speech", "text")
REWARDS = ("verifier", "length")


def run(args: argparse.Namespace, argv: list[str]) -> None:
    out = journal.start(args.out, argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    drifts = [float(x) for x in args.drifts.split(",")]
    t0 = time.time()
    table, cases = [], []
    for policy in POLICIES:
        for rk in REWARDS:
            for L in lengths:
                for eps in drifts:
                    info, rows = analyse(make_case(policy, rk, L, eps, args.seed))
                    cases.append({"policy": policy, "reward": rk, "L": L, "drift_eps": eps, **info})
                    for r in rows:
                        table.append(
                            {"policy": policy, "reward": rk, "L": L, "drift_eps": eps, "kl_seq": info["kl_seq"], **r}
                        )
            common.log(f"estimators: {policy}/{rk} done ({time.time() - t0:.1f}s)")
    common.write_csv(out / "estimators.csv", table)
    common.write_csv(out / "cases.csv", cases)
    claims = check_claims(table, cases)
    plot(table, lengths, drifts, out)
    write_report(out, table, cases, claims, lengths, drifts, time.time() - t0)
    common.report_written(out)


def check_claims(table: list[dict], cases: list[dict]) -> dict:
    by = {}
    for r in table:
        by[(r["policy"], r["reward"], r["L"], r["drift_eps"], r["estimator"])] = r
    keys = sorted({k[:4] for k in by})
    cum, full = "cumulative cumprod (CTPO)", "full product"
    pc_bias = max(by[k + (cum,)]["bias_pc_rel"] for k in keys)
    full_bias = max(by[k + (full,)]["bias_rel"] for k in keys)
    var_lower = [k for k in keys if by[k + (cum,)]["var"] < by[k + (full,)]["var"]]
    cum_true = [by[k + (cum,)]["bias_rel"] for k in keys]
    return {
        "n_cases": len(keys),
        "cum_pc_bias_max": pc_bias,
        "full_true_bias_max": full_bias,
        "cum_var_lower_count": len(var_lower),
        "cum_var_not_lower": [
            k + (f"cumprod/full variance = {by[k + (cum,)]['var'] / by[k + (full,)]['var']:.5f}",)
            for k in keys
            if k not in var_lower
        ],
        "cum_true_bias_min": min(cum_true),
        "cum_true_bias_max": max(cum_true),
        "g_pc_gap_max": max(c["g_pc_gap"] for c in cases),
        "g_pc_cos_min": min(c["g_pc_cos"] for c in cases),
    }


def plot(table: list[dict], lengths: list[int], drifts: list[float], out) -> None:
    plt = common.pyplot()
    names = [e.name for e in ESTIMATORS]
    mid = drifts[len(drifts) // 2]
    Lmax = max(lengths)
    panels = [(p, r) for p in POLICIES for r in REWARDS]
    specs = [
        ("bias_vs_length.png", "bias_rel", "L", mid, "||E g - grad J|| / ||grad J||", False),
        ("bias_pc_vs_length.png", "bias_pc_rel", "L", mid, "||E g - g_pc|| / ||grad J||", False),
        ("variance_vs_length.png", "var_rel", "L", mid, "Var g / ||grad J||^2", True),
        ("bias_vs_drift.png", "bias_rel", "drift_eps", Lmax, "||E g - grad J|| / ||grad J||", False),
        ("variance_vs_drift.png", "var_rel", "drift_eps", Lmax, "Var g / ||grad J||^2", True),
    ]
    for fname, metric, xkey, fixed, ylabel, logy in specs:
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
        for ax, (p, r) in zip(axes[0], panels, strict=True):
            for i, name in enumerate(names):
                sel = [
                    t
                    for t in table
                    if t["policy"] == p
                    and t["reward"] == r
                    and t["estimator"] == name
                    and (t["drift_eps"] == fixed if xkey == "L" else t["L"] == fixed)
                ]
                sel.sort(key=lambda t: t[xkey])
                ax.plot(
                    [t[xkey] for t in sel],
                    [max(t[metric], 1e-16) if logy else t[metric] for t in sel],
                    marker="o",
                    ms=3,
                    label=name,
                    ls="-" if i < 10 else "--",
                )
            ax.set_title(f"{p}-like, {r} reward" + (f", eps={fixed}" if xkey == "L" else f", L={fixed}"), fontsize=9)
            ax.set_xlabel("max length L" if xkey == "L" else "drift eps (logit scale)")
            ax.set_ylabel(ylabel, fontsize=8)
            if logy:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=6, loc="best")
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)


# relative bias below this is float64 round-off: the estimator is unbiased
UNBIASED_TOL = 1e-9


def claim_verdicts(c: dict) -> dict[int, str]:
    """The verdict on each claim, derived from the measured numbers in ``c``."""
    holds = "HOLDS"
    lower, n = c["cum_var_lower_count"], c["n_cases"]
    return {
        1: holds if c["cum_pc_bias_max"] < UNBIASED_TOL else "DOES NOT HOLD",
        2: f"{holds} in every case" if lower == n else f"holds in {lower} of {n} cases",
        3: holds if c["cum_true_bias_max"] < UNBIASED_TOL else "DOES NOT HOLD",
    }


def write_report(out, table, cases, claims, lengths, drifts, seconds) -> None:
    Lmax = max(lengths)
    lines = [
        "# Exact estimator lab",
        "",
        "Made by the command in `COMMAND.txt` (" + f"{seconds:.1f} s). Full table: `estimators.csv` "
        "(every estimator x policy x reward x drift x length), per-case facts (KL, rewards, ||grad J||): "
        "`cases.csv`. Plots: `bias_vs_length.png`, `bias_pc_vs_length.png`, `variance_vs_length.png`, "
        "`bias_vs_drift.png`, `variance_vs_drift.png`.",
        "",
        "## What is computed",
        "",
        "Bigram policies over 3 content tokens + EOS, responses of up to L tokens, every distinct response "
        "enumerated (88,573 at L=10), float64. `speech`: self-transition logit +3 (neighbouring tokens tied, "
        "like codec frames); `text`: weak random dependence. pi_theta = pi_old + eps * D (fixed random logit "
        "direction D); the KL(pi_old || pi_theta) of whole responses is in `cases.csv` / `kl_seq` column. "
        "Rewards are sequence-level: `verifier` = 1 if token 0 is a strict majority of the content (0/1), "
        "`length` = content length / L. Advantage A = R - E_old[R].",
        "",
        "- grad J = E_theta[A(y) sum_t grad log pi_theta(y_t|y_<t)] (exact policy gradient, by enumeration).",
        "- g_pc (prefix-corrected token gradient) = "
        "sum_t E_{y<=t ~ pi_theta, y>t ~ pi_old}[A(y) grad log pi_theta(y_t|y_<t)]: "
        "prefixes from the target, credit (continuation) from the behaviour policy. Computed from mixed "
        "sequence probabilities, independently of the ratio code.",
        "- estimator g_w(y) = sum_t w_t(y) A(y) grad log pi_theta(y_t|y_<t), y ~ pi_old, with w_t the value of the "
        "shared ratio computed by the loss itself (`maspo_verl.core.losses`) (the gradient the losses "
        "back-propagate, before clipping; no clipping). Mean and total variance (trace of the covariance of one "
        "sample's estimate) are exact sums over all responses weighted by pi_old.",
        "- columns: `bias_rel` = ||E g_w - grad J|| / ||grad J||, `cos` = cosine(E g_w, grad J), "
        "`bias_pc_rel` = ||E g_w - g_pc|| / ||grad J||, `var_rel` = Var / ||grad J||^2, "
        "`mse1_rel` = (bias^2 + Var)/||grad J||^2 for one sample (divide the variance part by the batch size).",
        "",
        "## Claims",
        "",
    ]
    c = claims
    verdict = claim_verdicts(c)
    lines += [
        f"1. **'Cumulative ratio is unbiased for the prefix-corrected token gradient' -- {verdict[1]}.** "
        f"max over {c['n_cases']} cases of ||E g_cumprod - g_pc|| / ||grad J|| = {c['cum_pc_bias_max']:.1e} "
        "(float64 round-off). This is an identity: pi_old(y) * prod_{u<=t} ratio_u = q_t(y).",
        f"2. **'Variance below the full-sequence ratio' -- {verdict[2]}** (total variance of one sample's "
        "gradient estimate, cumprod vs full product)."
        + (
            ""
            if c["cum_var_lower_count"] == c["n_cases"]
            else " Exceptions (policy, reward, L, eps): " + ", ".join(str(k) for k in c["cum_var_not_lower"]) + "."
        ),
        f"3. **'Cumulative ratio is unbiased for the true gradient with a sequence-level reward' -- {verdict[3]}.** "
        f"Its relative bias ranges {c['cum_true_bias_min']:.3f} .. {c['cum_true_bias_max']:.3f} over the cases "
        "(it grows with the drift; see bias_vs_drift.png), because the credit A(y) of token t still "
        "depends on the suffix drawn "
        f"from pi_old. g_pc itself differs from grad J by up to {c['g_pc_gap_max']:.3f} x ||grad J|| "
        f"(cosine >= {c['g_pc_cos_min']:.3f}). Only the full product ratio is unbiased for grad J "
        f"(max relative bias {c['full_true_bias_max']:.1e}), at the price of the largest variance.",
        "",
        f"## Headline: L={Lmax}, drift eps={drifts[len(drifts) // 2]} (bias_rel / var_rel per policy x reward)",
        "",
        headline(table, Lmax, drifts[len(drifts) // 2]),
        f"## Table at the largest length (L={Lmax}), every drift",
        "",
    ]
    keys = [
        "policy",
        "reward",
        "drift_eps",
        "kl_seq",
        "estimator",
        "bias_rel",
        "cos",
        "bias_pc_rel",
        "var_rel",
        "mse1_rel",
    ]
    sel = [t for t in table if t["L"] == Lmax]
    lines.append(common.markdown_table(sel, keys))
    lines += [
        "## Cases",
        "",
        common.markdown_table(
            cases,
            [
                "policy",
                "reward",
                "L",
                "drift_eps",
                "n_sequences",
                "kl_seq",
                "kl_per_token",
                "mean_len",
                "reward_old",
                "reward_new",
                "grad_norm",
                "g_pc_cos",
                "g_pc_gap",
            ],
        ),
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")


def headline(table, L, eps) -> str:
    cols = [(p, r) for p in POLICIES for r in REWARDS]
    rows = []
    for e in ESTIMATORS:
        row = {"estimator": e.name}
        for p, r in cols:
            t = next(
                x
                for x in table
                if x["L"] == L
                and x["drift_eps"] == eps
                and x["policy"] == p
                and x["reward"] == r
                and x["estimator"] == e.name
            )
            row[f"{p}/{r}"] = f"{t['bias_rel']:.3f} / {t['var_rel']:.2f}"
        rows.append(row)
    return common.markdown_table(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="2,4,6,8,10", help="comma-separated maximum lengths L")
    p.add_argument("--drifts", default="0.1,0.3,0.6", help="comma-separated drift scales eps")
    p.add_argument("--seed", type=int, default=0)
