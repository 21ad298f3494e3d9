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


class _PessimisticSurrogate(torch.autograd.Function):
    """loss_t = max(-A r, -A clip(r, lo, hi)), and min(., -A c) where A < 0, in closed form:

        A > 0: -A min(r, hi)            A < 0: -A min(max(r, lo), c)            A = 0: 0

    r is the shared ratio's value; its gradient with respect to log pi_t is r_t (stop-gradient form
    r = exp(sg[l] + log pi - sg[log pi]), maspo_verl.ratios). Forward runs without autograd and saves one
    tensor, d loss_t / d log pi_t = -A_t r_t where no clip is active, else 0.
    """

    @staticmethod
    def forward(ctx, log_prob, ratio, advantages, low, high, dual, weights):
        adv = advantages.to(ratio.dtype)
        positive, negative = adv > 0, adv < 0
        floored = torch.clamp(ratio, min=low)
        effective = torch.where(positive, torch.clamp(ratio, max=high), torch.clamp(floored, max=dual))
        clipped_low = negative & (ratio < low)
        clipped_high = positive & (ratio > high)
        clipped_dual = negative & (floored > dual)
        coef = torch.where(effective == ratio, ratio, 0.0).mul_(adv).neg_()
        loss = effective.mul_(adv).neg_()
        if weights is not None:
            loss.mul_(weights)
            coef.mul_(weights)
        ctx.save_for_backward(coef)
        ctx.grad_dtype = log_prob.dtype
        ctx.mark_non_differentiable(clipped_low, clipped_high, clipped_dual)
        return loss, clipped_low, clipped_high, clipped_dual

    @staticmethod
    def backward(ctx, grad_loss, *_):
        (coef,) = ctx.saved_tensors
        return (grad_loss * coef).to(ctx.grad_dtype), None, None, None, None, None, None


def clipped_surrogate(
    log_prob: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    bounds: ClipBounds,
    weights: torch.Tensor | None = None,
) -> Surrogate:
    """Per-token pessimistic PPO loss with the shared ratio ``ratio`` (a value; no graph needed),
    differentiable in ``log_prob``; ``weights`` (rollout correction) multiply loss and gradient."""
    loss, low, high, dual = _PessimisticSurrogate.apply(
        log_prob, ratio.detach(), advantages, bounds.low, bounds.high, bounds.dual, weights
    )
    return Surrogate(loss=loss, clipped_low=low, clipped_high=high, clipped_dual=dual)
