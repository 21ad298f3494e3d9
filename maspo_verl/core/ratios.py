"""Shared log-ratios: l_t = (sum_{u in S(t)} delta_u) / |S(t)|^alpha (docs/algorithms.md).

Three token sets cover every method: segments (MASPO; a single segment per row is GSPO / P-GSPO,
one token per segment is GRPO) and prefixes {1..t} (CTPO). The ratio has the stop-gradient form
r_t = exp(sg[l_t] + log pi_t - sg[log pi_t]) (GSPO-token, from "Group Sequence Policy Optimization",
Zheng et al. 2025): value exp(l_t), gradient r_t * grad log pi_t, built by ``surrogates.apply``. Sums run in
float32 or wider, whatever the input dtype.
"""

from __future__ import annotations

import torch

# verl clamps token log-ratios to this range (core_algos.compute_policy_loss_vanilla); the same
# bound is applied to each token's delta and to the shared log-ratio, so exp() never overflows.
LOG_RATIO_CLAMP = 20.0


def token_log_ratios(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta, kept): delta_t = clamp(log pi - log pi_old, +-20), detached, at least float32, zero
    outside ``kept``; ``kept`` = ``mask`` without the tokens whose log-prob or old log-prob is not
    finite (their difference is not finite: log-probs are <= 0, so no finite pair overflows)."""
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    new, old = log_prob.detach(), old_log_prob.detach()
    if torch.promote_types(old.dtype, dtype) != dtype:
        old = old.to(dtype)
    # one new tensor, then in place (a narrower old_log_prob is widened exactly inside the subtraction)
    delta = torch.sub(new, old) if new.dtype == dtype else new.to(dtype).sub_(old)
    kept = torch.isfinite(delta).logical_and_(mask)
    delta.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # zero outside kept (as a product of finite values: a cheaper kernel than a select)
    return delta.mul_(float_mask(kept, dtype)), kept


def float_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A mask as 0/1 floats; bool goes through uint8, which CPU kernels convert much faster (not under
    ``torch.compile``, whose fused kernels convert directly and cannot reinterpret a bool buffer)."""
    if mask.dtype == torch.bool and mask.is_contiguous() and not torch.compiler.is_compiling():
        return mask.view(torch.uint8).to(dtype)
    return mask.bool().to(dtype)


def segment_totals(delta: torch.Tensor, seg_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per segment id (indexed like the tokens, [B, T]): (sum of delta, number of valid tokens).

    ``delta`` must be zero on padding (``token_log_ratios`` is).
    """
    total = torch.zeros_like(delta).scatter_add_(-1, seg_ids, delta)
    sizes = float_mask(mask, delta.dtype)
    return total, torch.zeros_like(sizes).scatter_add_(-1, seg_ids, sizes)


def segment_sums(values: torch.Tensor, seg_ids: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` per segment id (indexed like the tokens, [B, T])."""
    return torch.zeros_like(values).scatter_add_(-1, seg_ids, values)


def per_token(per_segment: torch.Tensor, seg_ids: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-segment value back to the segment's tokens."""
    return torch.gather(per_segment, -1, seg_ids)


def prefix_sums(delta: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (sum of delta over valid tokens up to t, number of valid tokens up to t); delta zero on padding."""
    return torch.cumsum(delta, dim=-1), torch.cumsum(float_mask(mask, delta.dtype), dim=-1)


def normalise(sums: torch.Tensor, sizes: torch.Tensor, alpha: float) -> torch.Tensor:
    """l = sum / n^alpha, clamped to +-20; alpha = 1 is a mean, alpha = 0 the full product."""
    if alpha == 0.0:
        return sums.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    n = sizes.clamp(min=1.0)
    if alpha != 1.0:
        n.pow_(alpha)
    return torch.div(sums, n, out=n).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
