"""Clip schedules and PPO's pessimistic surrogate with dual clip (SPEC §2).

- ratio-space (verl-compatible): lo = 1 - eps_low, hi = 1 + eps_high, c = clip_ratio_c.
- log-space, length-adaptive (CTPO-LA, seeds 002/004, generalised to any token set):
  lo_t = exp(-eps_low * n_t^p), hi_t = exp(eps_high * n_t^p), c_t = exp(eps_c * n_t^p),
  n_t = |S(t)| (segment size, prefix length or response length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ClipBounds:
    """Per-token (or scalar) bounds lo < 1 < hi and dual-clip constant c."""

    low: torch.Tensor | float
    high: torch.Tensor | float
    dual: torch.Tensor | float


def ratio_bounds(clip_low: float, clip_high: float, clip_c: float) -> ClipBounds:
    return ClipBounds(1.0 - clip_low, 1.0 + clip_high, clip_c)


def log_adaptive_bounds(
    set_sizes: torch.Tensor, eps_low: float, eps_high: float, eps_dual: float, exponent: float
) -> ClipBounds:
    scale = set_sizes.clamp(min=1.0).pow(exponent)
    return ClipBounds(torch.exp(-eps_low * scale), torch.exp(eps_high * scale), torch.exp(eps_dual * scale))


@dataclass
class Surrogate:
    """Per-token PPO loss and the boolean masks of where each clip is active."""

    loss: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    clipped_dual: torch.Tensor


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, bounds: ClipBounds) -> Surrogate:
    """loss = max(-A r, -A clip(r, lo, hi)); for A < 0 also min(., -A c) (dual clip)."""
    adv = advantages.to(ratio.dtype)
    low, high, dual = bounds.low, bounds.high, bounds.dual
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, low, high)
    pessimistic = torch.maximum(unclipped, clipped)
    dual_loss = -adv * dual
    negative = adv < 0
    loss = torch.where(negative, torch.minimum(pessimistic, dual_loss), pessimistic)
    active = clipped > unclipped
    detached = ratio.detach()
    return Surrogate(
        loss=loss,
        clipped_low=active & (detached < low),
        clipped_high=active & (detached > high),
        clipped_dual=negative & (pessimistic > dual_loss),
    )
