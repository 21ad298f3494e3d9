"""Clip schedules and PPO's pessimistic surrogate with dual clip (docs/algorithms.md, "Clip schedules").

- ratio-space (verl-compatible): lo = 1 - eps_low, hi = 1 + eps_high, c = clip_ratio_c.
- log-space, length-adaptive (CTPO-LA of "Rethinking Importance Sampling in LLM Policy
  Optimization: A Cumulative Token Perspective", generalised to any token set):
  lo_t = exp(-eps_low * n_t^p), hi_t = exp(eps_high * n_t^p), c_t = exp(eps_c * n_t^p),
  n_t = |S(t)| (segment size, prefix length or response length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from maspo_verl.ratios import float_mask


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


@dataclass
class Surrogate:
    """Per-token PPO loss and the boolean masks of where each clip is active."""

    loss: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    clipped_dual: torch.Tensor


def _clamped(x: torch.Tensor, bound: torch.Tensor | float, upper: bool) -> torch.Tensor:
    """min(x, bound) (``upper``) or max(x, bound), written over ``bound`` when it is a tensor."""
    if isinstance(bound, torch.Tensor):
        return (torch.minimum if upper else torch.maximum)(x, bound, out=bound)
    return x.clamp(max=bound) if upper else x.clamp(min=bound)


def _surrogate_values(ratio, log_ratio, advantages, bounds, weights, keep):
    """The loss values, the clip masks, and d loss / d log pi (see ``_PessimisticSurrogate``)."""
    adv = _zero_outside(advantages, keep, ratio.dtype)
    weights = None if weights is None else _zero_outside(weights, keep, ratio.dtype)
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
    if weights is not None:
        loss.mul_(weights)
        coef.mul_(weights)
    return loss, clipped_low, clipped_high, clipped_dual, coef


class _PessimisticSurrogate(torch.autograd.Function):
    """loss_t = max(-A r, -A clip(r, lo, hi)), and min(., -A c) where A < 0, in closed form:

        A > 0: -A min(r, hi)            A < 0: -A min(max(r, lo), c)            A = 0: 0

    r is the shared ratio's value; its gradient with respect to log pi_t is r_t (stop-gradient form
    r = exp(sg[l] + log pi - sg[log pi]), maspo_verl.ratios). Forward runs without autograd and saves one
    tensor, d loss_t / d log pi_t = -A_t r_t where no clip is active, else 0. With log-space bounds
    the same is done on l = log r: min(l, log hi) and so on, then exp.
    """

    @staticmethod
    def forward(ctx, log_prob, ratio, log_ratio, advantages, bounds, weights, keep):
        loss, clipped_low, clipped_high, clipped_dual, coef = _surrogate_values(
            ratio, log_ratio, advantages, bounds, weights, keep
        )
        ctx.save_for_backward(coef)
        ctx.grad_dtype = log_prob.dtype
        ctx.mark_non_differentiable(clipped_low, clipped_high, clipped_dual)
        return loss, clipped_low, clipped_high, clipped_dual

    @staticmethod
    def backward(ctx, grad_loss, *_):
        (coef,) = ctx.saved_tensors
        grad = torch.empty(coef.shape, dtype=ctx.grad_dtype, device=coef.device)
        return torch.mul(grad_loss, coef, out=grad), None, None, None, None, None, None


def _zero_outside(values: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as ``dtype``, zero outside ``keep`` whatever they hold there (NaN, inf)."""
    if values.dtype != dtype:  # the conversion already copies: fill that copy
        return values.to(dtype).masked_fill_(keep.logical_not(), 0.0)
    return torch.where(keep, values, 0.0)


def clipped_surrogate(
    log_prob: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    bounds: ClipBounds,
    weights: torch.Tensor | None = None,
    log_ratio: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> Surrogate:
    """Per-token pessimistic PPO loss with the shared ratio ``ratio`` (a value; no graph needed),
    differentiable in ``log_prob``; ``weights`` (rollout correction) multiply loss and gradient.
    Log-space bounds (``bounds.scale`` set) need ``log_ratio`` = log(ratio). Outside ``keep`` (the
    tokens in the loss) loss and gradient are zero, whatever advantages and weights hold there."""
    if keep is None:
        keep = torch.ones(ratio.shape, dtype=torch.bool, device=ratio.device)
    if bounds.scale is not None and log_ratio is None:
        raise ValueError("log-space clip bounds need log_ratio")
    if torch.compiler.is_compiling():
        # The same values and gradient in stop-gradient form: torch.compile's tracer (seen with torch
        # 2.11) loses the gradient of the Function below, whose forward never reads log_prob.
        with torch.no_grad():
            loss, low, high, dual, coef = _surrogate_values(ratio, log_ratio, advantages, bounds, weights, keep)
        zero = torch.where(keep, log_prob - log_prob.detach(), 0.0)  # 0, with gradient 1 at kept tokens
        return Surrogate(loss=loss + coef * zero, clipped_low=low, clipped_high=high, clipped_dual=dual)
    loss, low, high, dual = _PessimisticSurrogate.apply(
        log_prob,
        ratio.detach(),
        None if log_ratio is None else log_ratio.detach(),
        advantages,
        bounds,
        weights,
        keep,
    )
    return Surrogate(loss=loss, clipped_low=low, clipped_high=high, clipped_dual=dual)
