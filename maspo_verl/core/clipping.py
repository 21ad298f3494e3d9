"""Clip schedules (``policy_loss.clip_schedule``; docs/algorithms.md §2): the bounds a surrogate clips the shared
ratio to (``maspo_verl.core.surrogates``).

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


@dataclass
class ClipBounds:
    """Bounds lo < 1 < hi and dual-clip constant c of the ratio r, scalars or per token.

    With ``scale`` set they are log-space: the bounds of the log-ratio l = log r are ``low * scale``,
    ``high * scale``, ``dual * scale``, and r is compared through l (no bound is exponentiated to decide a clip).
    """

    low: torch.Tensor | float
    high: torch.Tensor | float
    dual: torch.Tensor | float
    scale: torch.Tensor | None = None

    def bound(self, name: str) -> torch.Tensor | float:
        """One bound (``low``, ``high``, ``dual``): of the log-ratio when ``scale`` is set, else of the ratio."""
        value = getattr(self, name)
        return value if self.scale is None else self.scale * value

    def clip(self, r: torch.Tensor, log_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(clip(r, lo, hi), where r < lo, where r > hi); the clipped ratio is r, with its gradient, inside."""
        if self.scale is None:
            return torch.clamp(r, self.low, self.high), r < self.low, r > self.high
        low, high = self.bound("low"), self.bound("high")
        below, above = log_r < low, log_r > high
        return torch.where(below, low.exp(), torch.where(above, high.exp(), r)), below, above

    def cap(self, r: torch.Tensor, log_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c as a value, where max(r, lo) > c): the dual clip's constant and where it binds."""
        if self.scale is None:
            return self.dual, r.clamp(min=self.low) > self.dual
        dual = self.bound("dual")
        return dual.exp(), torch.maximum(log_r, self.bound("low")) > dual


def clip_bounds(pl: Any, actor: Any, sizes: torch.Tensor | None) -> ClipBounds:
    """The bounds of ``pl.clip_schedule``: log_adaptive needs the per-token set sizes n_t; ratio-space bounds
    are verl's actor scalars ``clip_ratio_low/high`` (else ``clip_ratio``) and ``clip_ratio_c``."""
    if pl.clip_schedule == "log_adaptive":
        scale = sizes.clamp(min=1.0)
        if pl.clip_exponent != 1.0:
            scale.pow_(pl.clip_exponent)
        return ClipBounds(-pl.log_clip_low, pl.log_clip_high, pl.log_clip_dual, scale=scale)
    low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    return ClipBounds(1.0 - low, 1.0 + high, actor.get("clip_ratio_c", 3.0))
