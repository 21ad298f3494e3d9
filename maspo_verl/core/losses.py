"""One policy loss body for every token set: token set x normalisation x clip schedule x surrogate
(docs/algorithms.md), and the metrics reported with it (the ratio-correlation sums among them).

``policy_loss_fn(name)`` is the loss of the token set ``name`` (``maspo_verl.core.token_sets``) with
verl's ``PolicyLossFn`` signature, called per micro-batch by verl's ``ppo_loss``; the plugin
registers it. Any token set takes either clip schedule (``clip_schedule``: ratio | log_adaptive) and any
surrogate (``surrogate``: ``maspo_verl.core.surrogates``).

verl and ``maspo_verl.config`` (which imports verl) are imported inside the functions: ``import verl``
loads the plugin, which imports this module, so importing this module must not import verl.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import TYPE_CHECKING, Any

import torch

from maspo_verl import inspection
from maspo_verl.core.segments import float_mask
from maspo_verl.core.surrogates import SURROGATES, TokenLosses
from maspo_verl.core.token_sets import TOKEN_SETS
from maspo_verl.util import warn_once

if TYPE_CHECKING:
    from maspo_verl.config import GranularLossConfig

# verl clamps token log-ratios to this range (core_algos.compute_policy_loss_vanilla); the same bound is applied to
# each token's delta and to the shared log-ratio, so exp() never overflows.
LOG_RATIO_CLAMP = 20.0
# the ratio-correlation metrics' window sizes and prefix (``correlation_sums``)
WINDOWS = (5, 15, 50)
PREFIX = "actor/ratio/"
# the correlation sums' names: ``correlation_sums`` returns exactly these, ``correlation_metrics`` reads them
SUM_NAMES = ("corr_tokens", "corr_windows", "corr_segments")


def granular_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    loss_mode: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate with the shared ratio of ``loss_mode``'s token set (``config``: verl's actor config).

    Whatever padded positions hold has no effect on the loss or the gradient. A valid token whose
    log-prob or old log-prob is not finite is dropped from the loss (as if padded, so it shares no
    ratio either), counted in ``actor/ratio/nonfinite_tokens`` and warned about.
    """
    from maspo_verl.config import TARGET, GranularLossConfig

    actor = config
    policy_loss = actor.policy_loss if actor is not None else None
    if not isinstance(policy_loss, GranularLossConfig):
        raise TypeError(
            f"policy_loss.loss_mode={loss_mode!r} needs actor_rollout_ref.actor.policy_loss._target_="
            f"{TARGET} (got {type(policy_loss).__name__}); hydra_configs/maspo_trainer.yaml sets it"
        )
    body = compiled_loss_body(loss_mode) if policy_loss.compile else partial(loss_body, loss_mode=loss_mode)
    step = body(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, actor, policy_loss, rollout_is_weights
    )
    inspected = inspection.due(policy_loss) if policy_loss.inspect_dir is not None else None
    if inspected is not None:  # the one extra transfer of an inspected step
        rows = inspection.record(
            inspection.ROWS, step.mask, old_log_prob, log_prob, advantages, step.ratio, step.token_losses,
            step.segment_ids,
        )  # fmt: skip
        inspection.write(inspected, rows, policy_loss, actor, loss_mode)
    metrics = metrics_from_sums(step.metric_sums.tolist(), step.layout)  # the one device-to-host transfer
    if metrics["actor/ratio/nonfinite_tokens"]:
        warn_once(
            "maspo_verl: non-finite log-probs at valid response tokens (corrupted inference-engine log-probs "
            "in bypass mode?); such tokens are dropped from the loss and counted in actor/ratio/nonfinite_tokens",
            RuntimeWarning,
        )
    return step.loss, metrics


def token_log_ratios(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta, kept): delta_t = clamp(log pi - log pi_old, +-20), detached, at least float32, zero outside ``kept``,
    the tokens of ``mask`` whose difference is finite. What ``loss_body`` computes inline, for verl's own losses'
    correlation metrics (``maspo_verl.plugin.hooks``) and the lab."""
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    delta = log_prob.detach().to(dtype) - old_log_prob.detach().to(dtype)
    kept = mask.bool() & torch.isfinite(delta)
    return torch.where(kept, delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0), kept


@dataclass
class LossStep:
    """What ``loss_body`` computes on the device: verl's aggregated loss, the metric sums with their layout
    (``metric_sums``), and the per-token tensors an inspected step records."""

    loss: torch.Tensor
    metric_sums: torch.Tensor
    layout: tuple[tuple[str, int], ...]
    mask: torch.Tensor  # the tokens in the loss
    ratio: torch.Tensor  # each token's shared ratio (a value)
    token_losses: TokenLosses
    segment_ids: torch.Tensor | None  # the token set's segment ids (None: not segments)


def loss_body(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    actor: Any,
    policy_loss: GranularLossConfig,
    rollout_is_weights: torch.Tensor | None,
    *,
    loss_mode: str,
) -> LossStep:
    """Token set -> shared log-ratio -> clip schedule -> surrogate -> verl's aggregation, and the metric sums:
    everything of ``granular_policy_loss`` that runs on the device (``maspo_verl.core.reference_loss`` is the same
    written plainly, step by step as here). Whatever padded positions hold has no effect on the loss or the gradient.
    """
    response = response_mask.bool()
    dtype = torch.promote_types(log_prob.dtype, torch.float32)  # sums run in float32 or wider
    with torch.no_grad():  # everything but the surrogate is a value: r's gradient is r * grad log pi
        # 1-2. delta_t = clamp(log pi - log pi_old, +-20), zero outside the tokens in the loss (``mask``: the
        # response without the tokens whose log-prob or old log-prob is not finite; log-probs are <= 0, so no
        # finite pair overflows). One new tensor, then in place (a narrower old_log_prob is widened exactly).
        new, old = log_prob.detach(), old_log_prob.detach()
        if torch.promote_types(old.dtype, dtype) != dtype:
            old = old.to(dtype)
        delta = torch.sub(new, old) if new.dtype == dtype else new.to(dtype).sub_(old)
        mask = torch.isfinite(delta).logical_and_(response)
        delta.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        delta.mul_(float_mask(mask, dtype))  # a product of finite values: a cheaper kernel than a select
        # 3. who shares a ratio: the sums of delta over each token's set S(t) and the set sizes
        shared = TOKEN_SETS[loss_mode].sums(policy_loss, old_log_prob, mask, delta)
        ids = shared.segment_ids
        num_segments = None if ids is None else ids.amax(dim=-1, keepdim=True) + 1  # K_i [B, 1]
        delta_sum, correlation = delta.sum(), correlation_sums(delta, mask, ids)
        del delta  # only its sums are reported (peak memory)
        # 4. l_t = clamp(sum / |S(t)|^alpha, +-20) (alpha 1: a mean, 0: the full product), per token
        if shared.alpha == 0.0:
            log_ratio = shared.sums.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        else:
            n = shared.sizes.clamp(min=1.0)
            if shared.alpha != 1.0:
                n.pow_(shared.alpha)
            log_ratio = torch.div(shared.sums, n, out=n).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        if ids is not None:
            log_ratio = log_ratio.gather(-1, ids)
        ratio = log_ratio.exp()
        # per-token set sizes n_t, where the clip schedule or the aggregation reads them
        set_sizes = None
        if policy_loss.clip_schedule != "ratio" or policy_loss.agg_mode != "actor":
            set_sizes = shared.sizes if ids is None else shared.sizes.gather(-1, ids)
        rule_metrics = shared.metrics
        del shared
        adv = torch.where(mask, advantages.to(dtype), 0.0)
    # 5. the ratio in stop-gradient form r_t = exp(sg[l_t] + log pi_t - sg[log pi_t]) (GSPO-token, "Group Sequence
    # Policy Optimization", Zheng et al. 2025): value exp(l_t), gradient r_t grad log pi_t
    log_pi = torch.where(mask, log_prob.to(dtype), 0.0)
    moving = log_pi - log_pi.detach()  # value 0, gradient grad log pi
    # 6. the clip schedule's bounds (or the surrogate's own parameters), values
    surrogate = SURROGATES[policy_loss.surrogate]
    params = surrogate.params(policy_loss, actor, set_sizes)
    # 7. the surrogate's formula; autograd gives its gradient. Times the rollout weights; zero outside the mask
    token_losses = surrogate.loss(ratio * moving.exp(), log_ratio + moving, adv, log_pi, params)
    loss_mat = token_losses.loss
    if rollout_is_weights is not None:
        loss_mat = loss_mat * torch.where(mask, rollout_is_weights.to(dtype), 0.0)
    token_losses.loss = loss_mat = torch.where(mask, loss_mat, 0.0)
    del log_ratio, params, moving
    # 8. verl's agg_loss. seg-mean-token-mean weights token t by 1 / (|seg(t)| K_i), K_i the row's number of
    # segments: each row then sums to the mean over its segments of the token-mean inside each, and verl's
    # seq-mean-token-sum averages rows over the global batch (invariant to data parallelism like verl's own modes)
    if policy_loss.agg_mode == "seg-mean-token-mean":
        loss_mat = loss_mat / (set_sizes.clamp(min=1.0) * num_segments.to(loss_mat.dtype))
        loss_agg_mode = "seq-mean-token-sum"
    info = dict(actor.global_batch_info)
    if info.get("dp_size", 1) <= 1 and (info.get("batch_num_tokens") is None or info.get("global_batch_size") is None):
        # verl divides by the micro-batch's own counts when no global ones are given: 0/0 on an
        # all-padding micro-batch. At least one keeps that loss 0 instead of NaN.
        lengths = response.sum(-1)
        if info.get("batch_num_tokens") is None:
            info["batch_num_tokens"] = lengths.sum().clamp(min=1)
        if info.get("global_batch_size") is None:
            info["global_batch_size"] = (lengths > 0).sum().clamp(min=1)
    from verl.trainer.ppo.core_algos import agg_loss

    # a float32 0/1 mask gives verl's values exactly (counts below 2**24) without bool-to-float copies
    loss = agg_loss(loss_mat=loss_mat, loss_mask=float_mask(response), loss_agg_mode=loss_agg_mode, **info)
    sums, layout = metric_sums(
        mask, delta_sum, ratio, token_losses, num_segments, policy_loss.position_buckets, response, rule_metrics,
        correlation,
    )  # fmt: skip
    return LossStep(loss, sums, layout, mask, ratio, token_losses, ids)


def metric_sums(
    mask: torch.Tensor,
    delta_sum: torch.Tensor,
    ratio: torch.Tensor,
    token_losses: TokenLosses,
    num_segments: torch.Tensor | None,
    buckets: int,
    response: torch.Tensor,
    rule_metrics: dict[str, torch.Tensor],
    correlation: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, tuple[tuple[str, int], ...]]:
    """All metrics of one call as raw sums, counts and extremes, named and reduced on the device into
    one float64 vector, and its layout (name, length) in order (``metrics_from_sums`` reads it back after
    a single transfer).

    ``mask``: the tokens in the loss; ``delta_sum``: the sum of their token log-ratios; ``num_segments``:
    each row's number of segments [B, 1] (None: not segments); ``response``: verl's response mask (``mask``
    plus the dropped non-finite tokens); ``rule_metrics``: more 0-d tensors, or (sum, count) pairs, to report
    under their own names (the segmentation rule's); ``correlation``: ``correlation_sums`` of the token log-ratios.
    """
    mask = mask.bool()
    clips = [c & mask for c in (token_losses.clipped_low, token_losses.clipped_high, token_losses.clipped_dual)]
    lengths = mask.sum(-1, dtype=torch.int32)  # [B]
    # ratio over valid tokens: zero on padding for the sum and max (r > 0), the largest float for the min
    valid = float_mask(mask, ratio.dtype)
    on_valid = ratio * valid
    top = torch.finfo(ratio.dtype).max
    # Clip fraction by position bucket: valid position p of a row of length L is in bucket
    # floor(p K / L), so bucket k holds positions [ceil(k L / K), ceil((k + 1) L / K)); counted from
    # running sums at those starts, with no [B, T] bucket index.
    k = torch.arange(buckets + 1, device=mask.device, dtype=torch.int32)
    starts = (k * lengths.unsqueeze(-1) + buckets - 1) // buckets  # [B, K + 1]
    seen = torch.cumsum(mask, -1, dtype=torch.int32)
    clipped_seen = torch.cumsum(clips[0] | clips[1] | clips[2], -1, dtype=torch.int32)
    first_at = torch.searchsorted(seen, starts, right=True)  # first t with more than `start` valid tokens
    before = clipped_seen.gather(-1, (first_at - 1).clamp_(min=0)).mul_(first_at > 0)
    parts = {
        # low, high, dual; one by one, as a bool sum first converts its input to the sum's dtype (peak memory)
        "clipped": torch.stack([c.sum(dtype=torch.int32) for c in clips]),
        "clipped_per_bucket": (before[:, 1:] - before[:, :-1]).sum(0),
        "tokens_per_bucket": (starts[:, 1:] - starts[:, :-1]).sum(0),
        "tokens": lengths.sum(),
        "nonfinite": response.sum(dtype=torch.int32) - lengths.sum(),  # dropped non-finite tokens
    }
    if num_segments is not None:
        rows = lengths > 0
        parts["rows"] = rows.sum()
        parts["segments"] = (num_segments.squeeze(-1) * rows).sum()
    parts.update(rule_metrics)
    parts.update(correlation)
    parts["delta_sum"] = delta_sum
    parts["ratio_sum"], parts["ratio_max"] = on_valid.sum(), on_valid.amax()
    parts["ratio_min"] = on_valid.add_(valid.mul_(-top).add_(top)).amin()
    # one float64 vector: the integer parts, then the floating ones, each group joined before its one conversion
    # (exact: int32 joins int64, float32 joins float64)
    groups = ([], [])
    for name, part in parts.items():
        groups[part.is_floating_point()].append((name, part))
    layout = tuple((name, part.numel()) for group in groups for name, part in group)
    vector = [torch.cat([part.reshape(-1) for _, part in group]).to(torch.float64) for group in groups if group]
    return torch.cat(vector), layout


# the raw sums of ``metric_sums``; every other name in its layout is a metric reported as it is
RAW_SUMS = frozenset(
    {"clipped", "clipped_per_bucket", "tokens_per_bucket", "tokens", "nonfinite", "rows", "segments"}
    | {"delta_sum", "ratio_sum", "ratio_max", "ratio_min"}
    | set(SUM_NAMES)
)


def metrics_from_sums(host: list[float], layout: tuple[tuple[str, int], ...]) -> dict[str, float]:
    """The metrics from ``metric_sums``'s vector, moved to the host; the few divisions run in Python."""
    raw, start = {}, 0  # the vector by name
    for name, length in layout:
        raw[name] = host[start : start + length]
        start += length
    low_n, high_n, dual_n = raw["clipped"]
    (n_tokens,) = raw["tokens"]
    n = max(n_tokens, 1.0)
    metrics = {
        "actor/pg_clipfrac": (low_n + high_n) / n,
        "actor/pg_clipfrac_lower": dual_n / n,
        "actor/ppo_kl": -raw["delta_sum"][0] / n,  # delta is zero on padding
        "actor/ratio/clipfrac_low": low_n / n,
        "actor/ratio/clipfrac_high": high_n / n,
        "actor/ratio/clipfrac_dual": dual_n / n,
        "actor/ratio/mean": raw["ratio_sum"][0] / n,
        "actor/ratio/min": raw["ratio_min"][0] if n_tokens > 0 else 1.0,
        "actor/ratio/max": raw["ratio_max"][0] if n_tokens > 0 else 1.0,
        "actor/ratio/nonfinite_tokens": raw["nonfinite"][0],
    }
    buckets = len(raw["clipped_per_bucket"])
    for b, (clipped, tokens) in enumerate(zip(raw["clipped_per_bucket"], raw["tokens_per_bucket"], strict=True)):
        metrics[f"actor/ratio/clipfrac_pos{b + 1}of{buckets}"] = clipped / max(tokens, 1.0)
    if "segments" in raw:
        num_segments = raw["segments"][0]
        metrics["actor/ratio/segments_per_seq"] = num_segments / max(raw["rows"][0], 1.0)
        metrics["actor/ratio/segment_len_mean"] = n / max(num_segments, 1.0)
    metrics.update(correlation_metrics({name: raw[name] for name in SUM_NAMES if name in raw}))
    for name, values in raw.items():  # the rule's metrics: a value, or a (sum, count) pair
        if name not in RAW_SUMS and (len(values) == 1 or values[1] > 0):
            metrics[name] = values[0] if len(values) == 1 else values[0] / values[1]
    return metrics


# ---- ratio correlation: do the token log-ratios move together along a response? (docs/algorithms.md §9)
#
# Sharing one ratio over n tokens helps only where their log-ratios delta_t = log pi - log pi_old are
# correlated; for independent ones the segment mean is just a less noisy ratio, and only the clip band's
# width changes with n. Measured per row on x_t = delta_t - (the row's mean delta over valid tokens):
#
# - lag-1 autocorrelation: (sum x_t x_prev / #pairs) / (sum x_t^2 / #tokens), x_prev the row's previous
#   valid token (the textbook estimate; about -1/L for independent ratios on rows of L tokens);
# - VIF(n) = sum over windows of (sum of x in the window)^2 / (sigma^2 sum over windows of n (1 - n/L)),
#   windows of n consecutive valid tokens from each row's first (whole windows only) and
#   sigma^2 = sum x^2 / sum (L - 1): the variance of a window's mean against what independent ratios give
#   after the same centring, so 1 for independent ratios at any n and L, and
#   1 + 2 sum_{k<n} (1 - k/n) rho^k for AR(1) ones on long rows (the textbook n Var(window mean) / Var(x));
# - VIF(segments): the same with the preset's own segments as windows (a segment of m tokens expects
#   m (1 - m/L)); a segment that is its whole row expects 0 after centring and says nothing. With no other
#   segment the metric is not reported.
#
# ``correlation_sums`` runs on the device, with no host sync, and returns sums that add up over
# micro-batches and ranks; ``correlation_metrics`` turns those sums, moved to the host, into the metrics.
# A quantity with no data (no valid pair, all-equal log-ratios as on verl's first on-policy update) is not
# reported rather than reported as 0 or NaN.


def correlation_sums(
    delta: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The sums behind the correlation metrics of one batch [B, T], as float tensors on ``delta``'s device.

    ``delta``: token log-ratios (any finite value outside ``mask``); ``mask``: the tokens in the loss (holes
    allowed); ``segment_ids``: each token's segment, 0 .. T-1 within its row (the segment rules' ids), or None.
    ``corr_tokens``: [#tokens, sum (L - 1), sum x^2, #pairs, sum x x_prev]; ``corr_windows``: per n of
    ``WINDOWS`` [sum of squared window sums, sum n (1 - n/L)]; ``corr_segments``: the same for the segments.
    """
    mask = mask.bool()
    valid = float_mask(mask, delta.dtype)
    lengths = valid.sum(-1, keepdim=True)  # [B, 1]
    mean = (delta * valid).sum(-1, keepdim=True) / lengths.clamp(min=1.0)
    x = (delta - mean) * valid
    # the previous valid token of each column: the last valid column before it (-1: none)
    cols = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask, cols, -1).cummax(-1).values
    prev = torch.nn.functional.pad(last[:, :-1], (1, 0), value=-1)
    has_prev = float_mask(mask & (prev >= 0), x.dtype)
    x_prev = x.gather(-1, prev.clamp(min=0)) * has_prev
    n_tokens = lengths.sum()
    tokens = torch.stack([n_tokens, n_tokens - (lengths > 0).sum(), (x * x).sum(), has_prev.sum(), (x * x_prev).sum()])
    # windows of each size n at once [n, B, T]: position among the row's valid tokens // n, whole windows only,
    # summed by one scatter into consecutive blocks of B * (T // n + 1) slots, one block per n
    B, T = mask.shape
    slots = [T // n + 1 for n in WINDOWS]
    starts = [B * sum(slots[:i]) for i in range(len(WINDOWS))]
    position = torch.cumsum(mask, -1) - 1
    rows = torch.arange(B, device=mask.device).unsqueeze(-1)
    window = torch.stack([position // n for n in WINDOWS])
    count = torch.stack([torch.div(lengths, n, rounding_mode="floor") for n in WINDOWS])  # whole windows per row
    whole = mask & (window < count)
    first = torch.stack([rows * k + start for k, start in zip(slots, starts, strict=True)])  # each row's first slot
    index = torch.where(whole, first + window, 0)
    window_sum = torch.zeros(B * sum(slots), dtype=x.dtype, device=x.device)
    window_sum.scatter_add_(0, index.reshape(-1), (x * float_mask(whole, x.dtype)).reshape(-1))
    squares, at_least_one = window_sum.mul_(window_sum), lengths.clamp(min=1.0)
    windows = []
    for n, c, k, start in zip(WINDOWS, count, slots, starts, strict=True):  # three sizes, not a loop over tokens
        windows += [squares[start : start + B * k].sum(), (c * n * (1.0 - n / at_least_one)).sum()]
    parts = {"corr_tokens": tokens, "corr_windows": torch.stack(windows)}
    if segment_ids is not None:
        ids = torch.where(mask, segment_ids.long(), torch.zeros_like(segment_ids, dtype=torch.long))
        seg_sum = torch.zeros_like(x).scatter_add_(-1, ids, x)
        seg_len = torch.zeros_like(x).scatter_add_(-1, ids, valid)
        expected = seg_len * (1.0 - seg_len / lengths.clamp(min=1.0))
        parts["corr_segments"] = torch.stack([(seg_sum * seg_sum).sum(), expected.sum()])
    return parts


def host_sums(sums: Mapping[str, torch.Tensor]) -> dict[str, list[float]]:
    """``correlation_sums``'s tensors (or sums of several) on the host, in one transfer."""
    names = list(sums)
    flat = torch.cat([sums[k].reshape(-1).double() for k in names]).tolist() if names else []
    out, start = {}, 0
    for k in names:
        out[k], start = flat[start : start + sums[k].numel()], start + sums[k].numel()
    return out


def correlation_metrics(sums: Mapping[str, Sequence[float]], prefix: str = PREFIX) -> dict[str, float]:
    """``correlation_sums``'s sums on the host (each a sequence of floats, summed over micro-batches or
    ranks where there are several) as metrics: ``corr_lag1``, ``vif<n>`` and ``vif_segments`` under ``prefix``."""
    n_tokens, dof, sq, pairs, lag_prod = sums["corr_tokens"]
    if dof <= 0 or sq <= 0.0:
        return {}
    metrics = {}
    if pairs > 0:
        metrics[f"{prefix}corr_lag1"] = (lag_prod / pairs) / (sq / n_tokens)
    sigma2 = sq / dof  # unbiased after centring each row
    windows = sums["corr_windows"]
    for i, n in enumerate(WINDOWS):
        squares, expected = windows[2 * i : 2 * i + 2]
        if expected > 0:
            metrics[f"{prefix}vif{n}"] = squares / (expected * sigma2)
    if "corr_segments" in sums:
        squares, expected = sums["corr_segments"]
        if expected > 0:
            metrics[f"{prefix}vif_segments"] = squares / (expected * sigma2)
    return metrics


# verl's losses that one of our token sets computes exactly (docs/algorithms.md §5): inspected through it
VERL_EQUIVALENTS = {
    "vanilla": {"loss_mode": "maspo", "segment_rule": "fixed", "segment_window": 1},
    "gspo": {"loss_mode": "pgspo", "length_exponent": 1.0},
    "cispo": {"loss_mode": "maspo", "segment_rule": "fixed", "segment_window": 1, "surrogate": "cispo"},
    "sapo": {"loss_mode": "maspo", "segment_rule": "fixed", "segment_window": 1, "surrogate": "sapo"},
}


def inspect_verl_loss(
    name: str, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
) -> str | None:
    """On an inspected step (``inspection.due``), write what verl's loss ``name`` did: for ``vanilla``,
    ``gspo``, ``cispo`` and ``sapo`` the ratios and clips of the token set and surrogate that equal them
    (one token / the whole response, verl's ratio-space clip; ``gspo`` has no dual clip in verl), for
    verl's other losses the inputs only.
    Returns the file written, or None."""
    import dataclasses

    pl = config.policy_loss
    step = inspection.due(pl)
    if step is None:
        return None
    response = response_mask.bool()
    same = VERL_EQUIVALENTS.get(name)
    with torch.no_grad():
        if same is None:
            rows = inspection.record(inspection.ROWS, response, old_log_prob, log_prob, advantages)
        else:
            fields = dict(same, clip_schedule="ratio", agg_mode="actor", min_segment_len=0, max_segment_len=0)
            twin = dataclasses.replace(pl, compile=False, **fields)
            out = loss_body(
                old_log_prob, log_prob.detach(), advantages, response_mask, loss_agg_mode, config, twin,
                rollout_is_weights, loss_mode=twin.loss_mode,
            )  # fmt: skip
            ids = TOKEN_SETS[twin.loss_mode].segment_ids(twin, old_log_prob, out.mask)
            rows = inspection.record(
                inspection.ROWS, out.mask, old_log_prob, log_prob, advantages, out.ratio, out.token_losses, ids
            )
    return inspection.write(step, rows, pl, config, name)


@cache
def compiled_loss_body(loss_mode: str):
    """``loss_body`` of one token set through ``torch.compile`` (built on first use). Shapes are
    dynamic, so micro-batches of other lengths reuse the compiled kernels."""
    return torch.compile(partial(loss_body, loss_mode=loss_mode), dynamic=True)


def policy_loss_fn(loss_mode: str):
    """verl ``PolicyLossFn`` of the token set ``loss_mode``."""
    if loss_mode not in TOKEN_SETS:
        raise ValueError(f"loss_mode={loss_mode!r} is not a maspo_verl token set: allowed {', '.join(TOKEN_SETS)}")
    return partial(granular_policy_loss, loss_mode=loss_mode)
