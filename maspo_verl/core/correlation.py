"""Do the token log-ratios move together along a response? (docs/algorithms.md, "Ratio correlation")

Sharing one ratio over n tokens helps only where their log-ratios delta_t = log pi - log pi_old are
correlated; for independent ones the segment mean is just a less noisy ratio, and only the clip band's
width changes with n. Measured per row on x_t = delta_t - (the row's mean delta over valid tokens):

- lag-1 autocorrelation: (sum x_t x_prev / #pairs) / (sum x_t^2 / #tokens), x_prev the row's previous
  valid token (the textbook estimate; about -1/L for independent ratios on rows of L tokens);
- VIF(n) = sum over windows of (sum of x in the window)^2 / (sigma^2 sum over windows of n (1 - n/L)),
  windows of n consecutive valid tokens from each row's first (whole windows only) and
  sigma^2 = sum x^2 / sum (L - 1): the variance of a window's mean against what independent ratios give
  after the same centring, so 1 for independent ratios at any n and L, and
  1 + 2 sum_{k<n} (1 - k/n) rho^k for AR(1) ones on long rows (the textbook n Var(window mean) / Var(x));
- VIF(segments): the same with the preset's own segments as windows (a segment of m tokens expects
  m (1 - m/L)); a segment that is its whole row expects 0 after centring and says nothing. With no other
  segment the metric is not reported.

``correlation_sums`` runs on the device, with no host sync, and returns sums that add up over
micro-batches and ranks; ``correlation_metrics`` turns those sums, moved to the host, into the metrics.
A quantity with no data (no valid pair, all-equal log-ratios as on verl's first on-policy update) is not
reported rather than reported as 0 or NaN.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

WINDOWS = (5, 15, 50)
PREFIX = "actor/ratio/"
# the sums' names: ``correlation_sums`` returns exactly these, ``correlation_metrics`` reads them
SUM_NAMES = ("corr_tokens", "corr_windows", "corr_segments")


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
    valid = mask.to(delta.dtype)
    lengths = valid.sum(-1, keepdim=True)  # [B, 1]
    mean = (delta * valid).sum(-1, keepdim=True) / lengths.clamp(min=1.0)
    x = (delta - mean) * valid
    # the previous valid token of each column: the last valid column before it (-1: none)
    cols = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, cols, torch.full_like(cols, -1)).cummax(-1).values
    prev = torch.nn.functional.pad(last[:, :-1], (1, 0), value=-1)
    has_prev = mask & (prev >= 0)
    x_prev = x.gather(-1, prev.clamp(min=0)) * has_prev.to(x.dtype)
    n_tokens = lengths.sum()
    tokens = torch.stack(
        [n_tokens, n_tokens - (lengths > 0).sum(), (x * x).sum(), has_prev.to(x.dtype).sum(), (x * x_prev).sum()]
    )
    windows = []
    for n in WINDOWS:  # three sizes, not a loop over tokens
        window_sum, expected = window_sums(x, mask, lengths, n)
        windows.append(torch.stack([(window_sum * window_sum).sum(), expected.sum()]))
    parts = {"corr_tokens": tokens, "corr_windows": torch.cat(windows)}
    if segment_ids is not None:
        ids = torch.where(mask, segment_ids.long(), torch.zeros_like(segment_ids, dtype=torch.long))
        seg_sum = torch.zeros_like(x).scatter_add_(-1, ids, x)
        seg_len = torch.zeros_like(x).scatter_add_(-1, ids, valid)
        expected = seg_len * (1.0 - seg_len / lengths.clamp(min=1.0))
        parts["corr_segments"] = torch.stack([(seg_sum * seg_sum).sum(), expected.sum()])
    return parts


def window_sums(
    x: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, n: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The VIF(n) window sums of centred log-ratios ``x`` [B, T] (zero outside ``mask``, a bool mask; ``lengths``
    [B, 1] its valid tokens per row): each window's sum of x, windows of ``n`` consecutive valid tokens from each
    row's first, whole windows only, as a flat tensor [B * slots] (row b's windows at b * slots ...), and each
    row's expectation under independence, sum over its windows of n (1 - n/L) [B, 1]. ``n``: one window length,
    or one per row ([B, 1] integers >= 1)."""
    per_row = isinstance(n, torch.Tensor)
    slots = mask.shape[-1] + 1 if per_row else mask.shape[-1] // n + 1
    position = torch.cumsum(mask, -1) - 1  # position among the row's valid tokens
    rows = torch.arange(mask.shape[0], device=mask.device).unsqueeze(-1)
    count = torch.div(lengths, n, rounding_mode="floor")  # whole windows per row [B, 1]
    whole = mask & (position // n < count)
    index = torch.where(whole, rows * slots + position // n, torch.zeros_like(position))
    window_sum = torch.zeros(mask.shape[0] * slots, dtype=x.dtype, device=x.device)
    window_sum.scatter_add_(0, index.reshape(-1), (x * whole.to(x.dtype)).reshape(-1))
    return window_sum, count * n * (1.0 - n / lengths.clamp(min=1.0))


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
