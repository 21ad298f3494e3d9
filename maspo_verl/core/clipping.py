"""Clip schedules (``policy_loss.clip_schedule``) and the closed forms of the clipped surrogates
(docs/algorithms.md §2); ``maspo_verl.core.surrogates`` applies them.

- ratio-space (verl-compatible): lo = 1 - eps_low, hi = 1 + eps_high, c = clip_ratio_c.
- log-space, length-adaptive (CTPO-LA of "Rethinking Importance Sampling in LLM Policy
  Optimization: A Cumulative Token Perspective", generalised to any token set):
  lo_t = exp(-eps_low * n_t^p), hi_t = exp(eps_high * n_t^p), c_t = exp(eps_c * n_t^p),
  n_t = |S(t)| (segment size, prefix length or response length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from maspo_verl.core.ratios import float_mask


@dataclass
class ClipBounds:
    """Bounds lo < 1 < hi and dual-clip constant c of the ratio r, scalars or per token.

    With ``scale`` set they are log-space: the bounds of the log-ratio l = log r are
    ``low * scale``, ``high * scale``, ``dual * scale`` (low < 0 < high, dual > 0), and the surrogate
    compares l with them instead of exponentiating every bound.
    """

    low: torch.Tensor | float
    high: torch.Tensor | float
    dual: torch.Tensor | float
    scale: torch.Tensor | None = None

    def bound(self, name: str) -> torch.Tensor | float:
        """One bound, materialised only when asked for (a log-space bound is a new tensor)."""
        value = getattr(self, name)
        if self.scale is not None:
            return self.scale * value
        return value.clone() if isinstance(value, torch.Tensor) else value  # the surrogate writes over it


def ratio_bounds(clip_low: float, clip_high: float, clip_c: float) -> ClipBounds:
    return ClipBounds(1.0 - clip_low, 1.0 + clip_high, clip_c)


def log_adaptive_bounds(
    set_sizes: torch.Tensor, eps_low: float, eps_high: float, eps_dual: float, exponent: float
) -> ClipBounds:
    """log lo_t = -eps_low n_t^p, log hi_t = eps_high n_t^p, log c_t = eps_dual n_t^p."""
    scale = set_sizes.clamp(min=1.0)
    if exponent != 1.0:
        scale.pow_(exponent)
    return ClipBounds(-eps_low, eps_high, eps_dual, scale=scale)


def clip_bounds(pl: Any, actor: Any, sizes: torch.Tensor | None) -> ClipBounds:
    """The bounds of ``pl.clip_schedule``: log_adaptive needs the per-token set sizes; ratio-space bounds
    are verl's actor scalars ``clip_ratio_low/high`` (else ``clip_ratio``) and ``clip_ratio_c``."""
    if pl.clip_schedule == "log_adaptive":
        return log_adaptive_bounds(sizes, pl.log_clip_low, pl.log_clip_high, pl.log_clip_dual, pl.clip_exponent)
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    return ratio_bounds(low, high, actor.get("clip_ratio_c", 3.0))


def _clamped(x: torch.Tensor, bound: torch.Tensor | float, upper: bool) -> torch.Tensor:
    """min(x, bound) (``upper``) or max(x, bound), written over ``bound`` when it is a tensor."""
    if isinstance(bound, torch.Tensor):
        return (torch.minimum if upper else torch.maximum)(x, bound, out=bound)
    return x.clamp(max=bound) if upper else x.clamp(min=bound)


def pessimistic_values(ratio, log_ratio, adv, bounds):
    """PPO's pessimistic surrogate with dual clip, in closed form (``adv`` zero outside the kept tokens):

        A > 0: -A min(r, hi)            A < 0: -A min(max(r, lo), c)            A = 0: 0

    Returns the loss values, the clip masks (low, high, dual: disjoint) and d loss / d log pi, which is
    -A r where no clip is active, else 0. With log-space bounds the same is done on l = log r:
    min(l, log hi) and so on, then exp.
    """
    positive, negative = adv > 0, adv < 0
    x = ratio if bounds.scale is None else log_ratio
    high = bounds.bound("high")
    clipped_high = positive & (x > high)
    effective = _clamped(x, high, upper=True)  # A > 0
    low = bounds.bound("low")
    clipped_low = negative & (x < low)
    floored = _clamped(x, low, upper=False)
    dual = bounds.bound("dual")
    clipped_dual = negative & (floored > dual)
    floored = _clamped(floored, dual, upper=True) if isinstance(dual, torch.Tensor) else floored.clamp_(max=dual)
    del low, dual  # a tensor low bound held the previous `floored`: free it (peak memory)
    effective = torch.where(positive, effective, floored, out=effective)
    if bounds.scale is not None:
        effective.exp_()
    # where no clip is active the clipped value is r itself: gradient -A r there, 0 elsewhere
    active = clipped_low | clipped_high | clipped_dual
    coef = float_mask(~active, ratio.dtype).mul_(ratio).mul_(adv).neg_()
    loss = effective.mul_(adv).neg_()
    return loss, clipped_low, clipped_high, clipped_dual, coef


def clipped_weights(ratio, log_ratio, bounds):
    """clip(r, lo, hi) (log-space bounds: exp(clip(l, log lo, log hi))) as a new tensor, and the masks of
    where it clipped below and above (CISPO's clipped importance weight; no dual clip)."""
    x = ratio if bounds.scale is None else log_ratio
    low, high = bounds.bound("low"), bounds.bound("high")
    clipped_low, clipped_high = x < low, x > high
    if isinstance(low, torch.Tensor):
        weight = torch.minimum(torch.maximum(x, low, out=low), high, out=high)
    else:
        weight = x.clamp(min=low, max=high)
    if bounds.scale is not None:
        weight.exp_()
    return weight, clipped_low, clipped_high


def zero_outside(values: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as ``dtype``, zero outside ``keep`` whatever they hold there (NaN, inf)."""
    if values.dtype != dtype:  # the conversion already copies: fill that copy
        return values.to(dtype).masked_fill_(keep.logical_not(), 0.0)
    return torch.where(keep, values, 0.0)
