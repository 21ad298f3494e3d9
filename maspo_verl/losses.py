"""One policy loss body for every token set: token set x normalisation x clip schedule
(docs/algorithms.md).

``policy_loss_fn(name)`` is the loss of the token set ``name`` (``maspo_verl.token_sets``) with
verl's ``PolicyLossFn`` signature, called per micro-batch by verl's ``ppo_loss``; the plugin
registers it. Any token set takes either clip schedule (``clip_schedule``: ratio | log_adaptive).

verl and ``maspo_verl.config`` (which imports verl) are imported inside the functions: ``import verl``
loads the plugin, which imports this module, so importing this module must not import verl.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from maspo_verl import clipping, ratios
from maspo_verl.token_sets import TOKEN_SETS

if TYPE_CHECKING:
    from maspo_verl.config import GranularLossConfig


def policy_loss_config(config: Any, loss_mode: str) -> GranularLossConfig:
    """The actor config's ``policy_loss``, which must be our dataclass for our loss modes."""
    from maspo_verl.config import GranularLossConfig

    pl = config.policy_loss if config is not None else None
    if not isinstance(pl, GranularLossConfig):
        raise TypeError(
            f"policy_loss.loss_mode={loss_mode!r} needs actor_rollout_ref.actor.policy_loss._target_="
            f"maspo_verl.config.GranularLossConfig (got {type(pl).__name__}); "
            "hydra_configs/maspo_trainer.yaml sets it"
        )
    return pl


def clip_bounds(pl: GranularLossConfig, actor: Any, sizes: torch.Tensor | None) -> clipping.ClipBounds:
    """log_adaptive needs the per-token set sizes; ratio-space bounds are verl's actor scalars."""
    if pl.clip_schedule == "log_adaptive":
        return clipping.log_adaptive_bounds(
            sizes, pl.log_clip_low, pl.log_clip_high, pl.log_clip_dual, pl.clip_exponent
        )
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    return clipping.ratio_bounds(low, high, actor.get("clip_ratio_c", 3.0))


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str,
    agg_mode: str,
    sizes: torch.Tensor | None,
    seg_ids: torch.Tensor | None,
    global_batch_info: dict,
) -> torch.Tensor:
    """verl's ``agg_loss``; ``seg-mean-token-mean`` weights token t by 1 / (|seg(t)| * K_i).

    With those weights each row sums to the mean over its K_i segments of the token-mean inside
    each segment; verl's ``seq-mean-token-sum`` then averages rows over the global batch, so the
    mode stays invariant to data parallelism like verl's own modes.
    """
    if agg_mode == "seg-mean-token-mean":
        num_segments = (seg_ids.max(dim=-1, keepdim=True).values + 1).to(loss_mat.dtype)
        loss_mat = loss_mat / (sizes.clamp(min=1.0) * num_segments)
        loss_agg_mode = "seq-mean-token-sum"
    info = dict(global_batch_info)
    if info.get("dp_size", 1) <= 1:
        # verl divides by the micro-batch's own counts when no global ones are given: 0/0 on an
        # all-padding micro-batch. At least one keeps that loss 0 instead of NaN.
        if info.get("batch_num_tokens") is None:
            info["batch_num_tokens"] = mask.sum().clamp(min=1)
        if info.get("global_batch_size") is None:
            info["global_batch_size"] = mask.any(dim=-1).sum().clamp(min=1)
    from verl.trainer.ppo.core_algos import agg_loss

    return agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=loss_agg_mode, **info)


def collect_metrics(
    mask: torch.Tensor,
    delta: torch.Tensor,
    ratio: torch.Tensor,
    surrogate: clipping.Surrogate,
    seg_ids: torch.Tensor | None,
    buckets: int,
    extra: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """All metrics of one call, moved to the host in a single transfer (``extra``: 0-d tensors, e.g.
    the segmentation rule's)."""
    clips = torch.stack([surrogate.clipped_low, surrogate.clipped_high, surrogate.clipped_dual]) & mask
    low_n, high_n, dual_n = clips.sum((1, 2)).to(torch.float64).unbind()
    n = mask.sum().to(torch.float64).clamp(min=1.0)
    any_valid = mask.any()
    names = [
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/ratio/clipfrac_low",
        "actor/ratio/clipfrac_high",
        "actor/ratio/clipfrac_dual",
        "actor/ratio/mean",
        "actor/ratio/min",
        "actor/ratio/max",
    ]
    values = [
        (low_n + high_n) / n,
        dual_n / n,
        -delta.sum().to(torch.float64) / n,  # delta is zero on padding
        low_n / n,
        high_n / n,
        dual_n / n,
        torch.where(mask, ratio, 0.0).sum().to(torch.float64) / n,
        torch.where(any_valid, torch.where(mask, ratio, float("inf")).amin(), 1.0).to(torch.float64),
        torch.where(any_valid, torch.where(mask, ratio, float("-inf")).amax(), 1.0).to(torch.float64),
    ]
    # Clip fraction by position bucket: valid position p of a row of length L is in bucket
    # floor(p K / L), so bucket k holds positions [ceil(k L / K), ceil((k + 1) L / K)); counted from
    # running sums at those starts, with no [B, T] bucket index.
    lengths = mask.sum(-1, keepdim=True, dtype=torch.int32)
    k = torch.arange(buckets + 1, device=mask.device, dtype=torch.int32)
    starts = (k * lengths + buckets - 1) // buckets  # [B, K + 1]
    seen = torch.cumsum(mask, -1, dtype=torch.int32)
    clipped_seen = torch.cumsum(clips.any(0), -1, dtype=torch.int32)
    first_at = torch.searchsorted(seen, starts, right=True)  # first t with more than `start` valid tokens
    before = torch.where(first_at > 0, clipped_seen.gather(-1, (first_at - 1).clamp(min=0)), 0)
    clipped_per_bucket = (before[:, 1:] - before[:, :-1]).sum(0).to(torch.float64)
    tokens_per_bucket = (starts[:, 1:] - starts[:, :-1]).sum(0).to(torch.float64)
    names += [f"actor/ratio/clipfrac_pos{b + 1}of{buckets}" for b in range(buckets)]
    values += list(clipped_per_bucket / tokens_per_bucket.clamp(min=1.0))
    if seg_ids is not None:
        rows = (lengths.squeeze(-1) > 0).to(torch.float64)
        num_segments = (seg_ids.max(dim=-1).values + 1).to(torch.float64) * rows
        names += ["actor/ratio/segments_per_seq", "actor/ratio/segment_len_mean"]
        values += [num_segments.sum() / rows.sum().clamp(min=1.0), n / num_segments.sum().clamp(min=1.0)]
    for name, value in (extra or {}).items():
        names.append(name)
        values.append(value.to(device=n.device, dtype=torch.float64))
    host = torch.stack(values).tolist()
    return dict(zip(names, host, strict=True))


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
    """Clipped surrogate with the shared ratio of ``loss_mode``'s token set."""
    pl = policy_loss_config(config, loss_mode)
    mask = response_mask.bool()
    with torch.no_grad():  # everything but the surrogate is a value: r's gradient is r * grad log pi
        delta = ratios.token_log_ratios(log_prob, old_log_prob, mask)
        sets = TOKEN_SETS[loss_mode].sums(pl, old_log_prob, mask, delta)
        ratio = sets.per_token(ratios.normalise(sets.sums, sets.sizes, sets.alpha)).exp_()
        # per-token set sizes only where a schedule or the aggregation needs them
        sizes = sets.per_token(sets.sizes) if pl.agg_mode != "actor" or pl.clip_schedule != "ratio" else None
        bounds = clip_bounds(pl, config, sizes)
    surrogate = clipping.clipped_surrogate(log_prob, ratio, advantages, bounds, rollout_is_weights)
    pg_loss = aggregate(surrogate.loss, mask, loss_agg_mode, pl.agg_mode, sizes, sets.seg_ids, config.global_batch_info)
    metrics = collect_metrics(mask, delta, ratio, surrogate, sets.seg_ids, pl.position_buckets, sets.metrics)
    return pg_loss, metrics


def policy_loss_fn(loss_mode: str):
    """verl ``PolicyLossFn`` of the token set ``loss_mode``."""
    if loss_mode not in TOKEN_SETS:
        raise ValueError(f"loss_mode={loss_mode!r} is not a maspo_verl token set: allowed {', '.join(TOKEN_SETS)}")
    return partial(granular_policy_loss, loss_mode=loss_mode)
