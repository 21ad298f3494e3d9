"""One policy loss, three registered names: token set x normalisation x clip schedule (SPEC §1-§5).

| name    | token set S(t)          | normalisation (alpha)                | source            |
|---------|-------------------------|--------------------------------------|-------------------|
| `maspo` | segment of t            | `length_exponent` (1 = segment mean) | seeds 000, 001    |
| `ctpo`  | prefix {1..t}           | cumprod: 0, geomean: 1               | seeds 002, 004    |
| `pgspo` | whole response          | `length_exponent` (1 = GSPO)         | seeds 001, 003    |

Any of them takes either clip schedule (``clip_schedule``: ratio | log_adaptive). The function
has verl's ``PolicyLossFn`` signature and is called per micro-batch by verl's ``ppo_loss``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from maspo_verl import clipping, ratios, segments
from maspo_verl.config import OUR_LOSS_MODES, GranularLossConfig


def policy_loss_config(config: Any, loss_mode: str) -> GranularLossConfig:
    """The actor config's ``policy_loss``, which must be our dataclass for our loss modes."""
    pl = config.policy_loss if config is not None else None
    if not isinstance(pl, GranularLossConfig):
        raise TypeError(
            f"policy_loss.loss_mode={loss_mode!r} needs actor_rollout_ref.actor.policy_loss._target_="
            f"maspo_verl.config.GranularLossConfig (got {type(pl).__name__}); "
            "hydra_configs/maspo_trainer.yaml sets it"
        )
    return pl


def token_sets(
    loss_mode: str,
    pl: GranularLossConfig,
    old_log_prob: torch.Tensor,
    mask: torch.Tensor,
    delta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor | None]:
    """Per token: (sum of delta over S(t), |S(t)|, alpha, segment ids or None for prefixes)."""
    if loss_mode == "ctpo":
        sums, sizes = ratios.prefix_sums(delta, mask)
        return sums, sizes, (0.0 if pl.ctpo_mode == "cumprod" else 1.0), None
    if loss_mode == "pgspo":
        seg_ids = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
    else:
        from maspo_verl.verl_glue import current_response_ids

        token_ids = current_response_ids(mask) if pl.segment_rule == "tokenval" else None
        boundaries = segments.compute_boundaries(
            mask,
            pl.segment_rule,
            old_log_prob=old_log_prob,
            token_ids=token_ids,
            window=pl.segment_window,
            logprob_threshold=pl.logprob_threshold,
            logprob_per_sample=pl.logprob_per_sample,
            tokenval_threshold=pl.tokenval_threshold,
            tokenval_distance=pl.tokenval_distance,
            codec_offset=pl.codec_offset,
            codec_size=pl.codec_size,
            fsq_levels=pl.fsq_levels,
            min_len=pl.min_segment_len,
            max_len=pl.max_segment_len,
        )
        seg_ids = segments.segment_ids(boundaries, mask)
    sums, sizes = ratios.segment_sums(delta, seg_ids, mask)
    return sums, sizes, pl.length_exponent, seg_ids


def clip_bounds(pl: GranularLossConfig, actor: Any, sizes: torch.Tensor) -> clipping.ClipBounds:
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
    sizes: torch.Tensor,
    seg_ids: torch.Tensor | None,
    global_batch_info: dict,
) -> torch.Tensor:
    """verl's ``agg_loss``; ``seg-mean-token-mean`` weights token t by 1 / (|seg(t)| * K_i).

    With those weights each row sums to the mean over its K_i segments of the token-mean inside
    each segment; verl's ``seq-mean-token-sum`` then averages rows over the global batch, so the
    mode stays invariant to data parallelism like verl's own modes (seed 001).
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
    return agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=loss_agg_mode, **info)


def _fraction(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum() / w.sum().clamp(min=1.0)


def collect_metrics(
    mask: torch.Tensor,
    delta: torch.Tensor,
    ratio: torch.Tensor,
    surrogate: clipping.Surrogate,
    seg_ids: torch.Tensor | None,
    buckets: int,
) -> dict[str, float]:
    """All metrics of one call, moved to the host in a single transfer."""
    w = mask.to(ratio.dtype)
    r = ratio.detach()
    low = surrogate.clipped_low.to(w.dtype)
    high = surrogate.clipped_high.to(w.dtype)
    dual = surrogate.clipped_dual.to(w.dtype)
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
    inf = torch.tensor(float("inf"), dtype=r.dtype, device=r.device)
    any_valid = mask.any()
    values = [
        _fraction(low + high, w),
        _fraction(dual, w),
        _fraction(-delta.to(w.dtype), w),
        _fraction(low, w),
        _fraction(high, w),
        _fraction(dual, w),
        _fraction(r, w),
        torch.where(any_valid, torch.where(mask, r, inf).min(), 1.0),
        torch.where(any_valid, torch.where(mask, r, -inf).max(), 1.0),
    ]
    # clip fraction by position bucket (equal fractions of each response)
    lengths = w.sum(-1, keepdim=True).clamp(min=1.0)
    pos = segments.valid_positions(mask).clamp(min=0).to(w.dtype)
    bucket = torch.clamp((pos * buckets / lengths).long(), max=buckets - 1)
    clipped = ((low + high + dual) > 0).to(w.dtype) * w
    per_bucket = torch.zeros(buckets, dtype=w.dtype, device=w.device).scatter_add_(
        0, bucket.flatten(), clipped.flatten()
    )
    tokens = torch.zeros(buckets, dtype=w.dtype, device=w.device).scatter_add_(0, bucket.flatten(), w.flatten())
    names += [f"actor/ratio/clipfrac_pos{k + 1}of{buckets}" for k in range(buckets)]
    values += list(per_bucket / tokens.clamp(min=1.0))
    if seg_ids is not None:
        rows = (w.sum(-1) > 0).to(w.dtype)
        num_segments = (seg_ids.max(dim=-1).values + 1).to(w.dtype) * rows
        names += ["actor/ratio/segments_per_seq", "actor/ratio/segment_len_mean"]
        values += [num_segments.sum() / rows.sum().clamp(min=1.0), w.sum() / num_segments.sum().clamp(min=1.0)]
    host = torch.stack([v.to(torch.float64) for v in values]).tolist()
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
    """Clipped surrogate with the shared ratio of ``loss_mode``'s token set (SPEC §1-§2)."""
    pl = policy_loss_config(config, loss_mode)
    mask = response_mask.bool()
    delta = ratios.token_log_ratios(log_prob, old_log_prob, mask)
    sums, sizes, alpha, seg_ids = token_sets(loss_mode, pl, old_log_prob, mask, delta)
    ratio = ratios.shared_ratio(log_prob, ratios.normalise(sums, sizes, alpha), mask)
    surrogate = clipping.clipped_surrogate(ratio, advantages, clip_bounds(pl, config, sizes))
    loss_mat = surrogate.loss
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    pg_loss = aggregate(loss_mat, mask, loss_agg_mode, pl.agg_mode, sizes, seg_ids, config.global_batch_info)
    metrics = collect_metrics(mask, delta, ratio, surrogate, seg_ids, pl.position_buckets)
    return pg_loss, metrics


LOSSES = {name: register_policy_loss(name)(partial(granular_policy_loss, loss_mode=name)) for name in OUR_LOSS_MODES}
