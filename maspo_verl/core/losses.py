"""One policy loss body for every token set: token set x normalisation x clip schedule x surrogate
(docs/algorithms.md).

``policy_loss_fn(name)`` is the loss of the token set ``name`` (``maspo_verl.core.token_sets``) with
verl's ``PolicyLossFn`` signature, called per micro-batch by verl's ``ppo_loss``; the plugin
registers it. Any token set takes either clip schedule (``clip_schedule``: ratio | log_adaptive) and any
surrogate (``surrogate``: ``maspo_verl.core.surrogates``).

verl and ``maspo_verl.config`` (which imports verl) are imported inside the functions: ``import verl``
loads the plugin, which imports this module, so importing this module must not import verl.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, partial
from typing import TYPE_CHECKING, Any

import torch

from maspo_verl import inspection
from maspo_verl.core import correlation, ratios, surrogates
from maspo_verl.core.surrogates import SURROGATES
from maspo_verl.core.token_sets import TOKEN_SETS
from maspo_verl.util import warn_once

if TYPE_CHECKING:
    from maspo_verl.config import GranularLossConfig


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str,
    agg_mode: str,
    set_sizes: torch.Tensor | None,
    num_segments: torch.Tensor | None,
    global_batch_info: dict,
) -> torch.Tensor:
    """verl's ``agg_loss``; ``seg-mean-token-mean`` weights token t by 1 / (|seg(t)| * K_i).

    ``set_sizes``: |seg(t)| per token [B, T]; ``num_segments``: K_i, each row's number of segments [B, 1].

    With those weights each row sums to the mean over its K_i segments of the token-mean inside
    each segment; verl's ``seq-mean-token-sum`` then averages rows over the global batch, so the
    mode stays invariant to data parallelism like verl's own modes.
    """
    if agg_mode == "seg-mean-token-mean":
        loss_mat = loss_mat / (set_sizes.clamp(min=1.0) * num_segments.to(loss_mat.dtype))
        loss_agg_mode = "seq-mean-token-sum"
    info = dict(global_batch_info)
    if info.get("dp_size", 1) <= 1 and (info.get("batch_num_tokens") is None or info.get("global_batch_size") is None):
        # verl divides by the micro-batch's own counts when no global ones are given: 0/0 on an
        # all-padding micro-batch. At least one keeps that loss 0 instead of NaN.
        lengths = mask.sum(-1)
        if info.get("batch_num_tokens") is None:
            info["batch_num_tokens"] = lengths.sum().clamp(min=1)
        if info.get("global_batch_size") is None:
            info["global_batch_size"] = (lengths > 0).sum().clamp(min=1)
    # a float32 0/1 mask gives verl's values exactly (counts below 2**24) without bool-to-float copies
    if mask.dtype == torch.bool:
        mask = ratios.float_mask(mask)
    from verl.trainer.ppo.core_algos import agg_loss

    return agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=loss_agg_mode, **info)


def metric_sums(
    mask: torch.Tensor,
    delta_sum: torch.Tensor,
    ratio: torch.Tensor,
    token_losses: surrogates.TokenLosses,
    num_segments: torch.Tensor | None,
    buckets: int,
    response: torch.Tensor,
    rule_metrics: dict[str, torch.Tensor],
    correlation_sums: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, tuple[tuple[str, int], ...]]:
    """All metrics of one call as raw sums, counts and extremes, named and reduced on the device into
    one float64 vector, and its layout (name, length) in order (``metrics_from_sums`` reads it back after
    a single transfer).

    ``mask``: the tokens in the loss; ``delta_sum``: the sum of their token log-ratios; ``num_segments``:
    each row's number of segments [B, 1] (None: not segments); ``response``: verl's response mask (``mask``
    plus the dropped non-finite tokens); ``rule_metrics``: more 0-d tensors to report under their own names
    (the segmentation rule's); ``correlation_sums``: ``correlation.correlation_sums`` of the token log-ratios.
    """
    mask = mask.bool()
    clips = [c & mask for c in (token_losses.clipped_low, token_losses.clipped_high, token_losses.clipped_dual)]
    lengths = mask.sum(-1, dtype=torch.int32)  # [B]
    # ratio over valid tokens: zero on padding for the sum and max (r > 0), the largest float for the min
    valid = ratios.float_mask(mask, ratio.dtype)
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
    parts.update(correlation_sums)
    parts["delta_sum"] = delta_sum
    parts["ratio_sum"], parts["ratio_max"] = on_valid.sum(), on_valid.amax()
    parts["ratio_min"] = on_valid.add_(valid.mul_(-top).add_(top)).amin()
    layout = tuple((name, part.numel()) for name, part in parts.items())
    return torch.cat([part.reshape(-1).to(torch.float64) for part in parts.values()]), layout


# the raw sums of ``metric_sums``; every other name in its layout is a metric reported as it is
RAW_SUMS = frozenset(
    {"clipped", "clipped_per_bucket", "tokens_per_bucket", "tokens", "nonfinite", "rows", "segments"}
    | {"delta_sum", "ratio_sum", "ratio_max", "ratio_min"}
    | set(correlation.SUM_NAMES)
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
    metrics.update(correlation.correlation_metrics({name: raw[name] for name in correlation.SUM_NAMES if name in raw}))
    metrics.update((name, values[0]) for name, values in raw.items() if name not in RAW_SUMS)
    return metrics


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
        delta = ratios.token_log_ratios(log_prob, old_log_prob, step.mask)[0]  # for rules that read it
        ids = TOKEN_SETS[loss_mode].segment_ids(policy_loss, old_log_prob, step.mask, delta)
        rows = inspection.record(
            inspection.ROWS, step.mask, old_log_prob, log_prob, advantages, step.ratio, step.token_losses, ids
        )
        inspection.write(inspected, rows, policy_loss, actor, loss_mode)
    metrics = metrics_from_sums(step.metric_sums.tolist(), step.layout)  # the one device-to-host transfer
    if metrics["actor/ratio/nonfinite_tokens"]:
        warn_once(
            "maspo_verl: non-finite log-probs at valid response tokens (corrupted inference-engine log-probs "
            "in bypass mode?); such tokens are dropped from the loss and counted in actor/ratio/nonfinite_tokens",
            RuntimeWarning,
        )
    return step.loss, metrics


@dataclass
class LossStep:
    """What ``loss_body`` computes on the device: verl's aggregated loss, the metric sums with their layout
    (``metric_sums``), and the per-token tensors an inspected step records."""

    loss: torch.Tensor
    metric_sums: torch.Tensor
    layout: tuple[tuple[str, int], ...]
    mask: torch.Tensor  # the tokens in the loss
    ratio: torch.Tensor  # each token's shared ratio (a value)
    token_losses: surrogates.TokenLosses


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
    written plainly)."""
    response = response_mask.bool()
    with torch.no_grad():  # everything but the surrogate is a value: r's gradient is r * grad log pi
        delta, mask = ratios.token_log_ratios(log_prob, old_log_prob, response)
        shared = TOKEN_SETS[loss_mode].sums(policy_loss, old_log_prob, mask, delta)
        delta_sum = delta.sum()
        correlation_sums = correlation.correlation_sums(delta, mask, shared.segment_ids)
        del delta  # only its sums are reported (peak memory)
        log_ratio = shared.per_token(ratios.normalise(shared.sums, shared.sizes, shared.alpha))
        ratio = log_ratio.exp()
        # per-token set sizes, where the clip schedule or the aggregation reads them
        needs_sizes = policy_loss.clip_schedule != "ratio" or policy_loss.agg_mode != "actor"
        set_sizes = shared.per_token(shared.sizes) if needs_sizes else None
        num_segments = None if shared.segment_ids is None else shared.segment_ids.amax(dim=-1, keepdim=True) + 1
        rule_metrics = shared.metrics
        del shared
        surrogate = SURROGATES[policy_loss.surrogate]
        params = surrogate.params(policy_loss, actor, set_sizes)
    token_losses = surrogates.apply(
        surrogate, log_prob, ratio, advantages, params, rollout_is_weights, log_ratio, mask
    )  # fmt: skip
    del log_ratio, params
    loss = aggregate(
        token_losses.loss, response, loss_agg_mode, policy_loss.agg_mode, set_sizes, num_segments,
        actor.global_batch_info,
    )  # fmt: skip
    sums, layout = metric_sums(
        mask, delta_sum, ratio, token_losses, num_segments, policy_loss.position_buckets, response, rule_metrics,
        correlation_sums,
    )  # fmt: skip
    return LossStep(loss, sums, layout, mask, ratio, token_losses)


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
