"""Do the token log-ratios move together along a response? (docs/algorithms.md, "Ratio correlation")

Sharing one ratio over n tokens helps only where their log-ratios delta_t = log pi - log pi_old are
correlated; for independent ones the segment mean is just a less noisy ratio, and only the clip band's
width changes with n. Measured per row on x_t = delta_t - (the row's mean delta over valid tokens):

- lag-1 autocorrelation: (sum x_t x_prev / #pairs) / (sum x_t^2 / #tokens), x_prev the row's previous
  valid token;
- VIF(n) = n Var(window mean) / Var(x), windows of n consecutive valid tokens from each row's first
  (whole windows only): 1 for independent ratios, 1 + 2 sum_{k<n} (1 - k/n) rho^k for AR(1) ones;
- VIF(segments) = mean over segments of |s| m_s^2 / Var(x), m_s the segment's mean of x: the same
  measure for the preset's own segments (1 for independent ratios). A segment that is its whole row has
  m_s = 0 after centring and says nothing: it is left out, and with no other segment the metric is not
  reported.

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
    ``corr_tokens``: [#tokens, sum x^2, #pairs, sum x x_prev]; ``corr_windows``: per n of ``WINDOWS``
    [#windows, sum m, sum m^2]; ``corr_segments``: [#segments, sum |s| m_s^2] (segments shorter than their row).
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
    tokens = torch.stack([lengths.sum(), (x * x).sum(), has_prev.to(x.dtype).sum(), (x * x_prev).sum()])
    # windows: position among the row's valid tokens // n, whole windows only
    position = torch.cumsum(mask, -1) - 1
    rows = torch.arange(mask.shape[0], device=mask.device).unsqueeze(-1)
    windows = []
    for n in WINDOWS:  # three sizes, not a loop over tokens
        slots = mask.shape[-1] // n + 1
        whole = mask & (position // n < (lengths.long() // n))
        index = torch.where(whole, rows * slots + position // n, torch.zeros_like(position))
        window_sum = torch.zeros(mask.shape[0] * slots, dtype=x.dtype, device=x.device)
        window_sum.scatter_add_(0, index.reshape(-1), (x * whole.to(x.dtype)).reshape(-1))
        m = window_sum / n
        count = (lengths.long() // n).sum().to(x.dtype)
        windows.append(torch.stack([count, m.sum(), (m * m).sum()]))
    parts = {"corr_tokens": tokens, "corr_windows": torch.cat(windows)}
    if segment_ids is not None:
        ids = torch.where(mask, segment_ids.long(), torch.zeros_like(segment_ids, dtype=torch.long))
        seg_sum = torch.zeros_like(x).scatter_add_(-1, ids, x)
        seg_len = torch.zeros_like(x).scatter_add_(-1, ids, valid)
        partial = (seg_len > 0) & (seg_len < lengths)
        weighted = torch.where(partial, seg_sum * seg_sum / seg_len.clamp(min=1.0), torch.zeros_like(x))
        parts["corr_segments"] = torch.stack([partial.to(x.dtype).sum(), weighted.sum()])
    return parts


def correlation_metrics(sums: Mapping[str, Sequence[float]], prefix: str = PREFIX) -> dict[str, float]:
    """``correlation_sums``'s sums on the host (each a sequence of floats, summed over micro-batches or
    ranks where there are several) as metrics: ``corr_lag1``, ``vif<n>`` and ``vif_segments`` under ``prefix``."""
    n_tokens, sq, pairs, lag_prod = sums["corr_tokens"]
    if n_tokens <= 0 or sq <= 0.0:
        return {}
    var = sq / n_tokens
    metrics = {}
    if pairs > 0:
        metrics[f"{prefix}corr_lag1"] = (lag_prod / pairs) / var
    windows = sums["corr_windows"]
    for i, n in enumerate(WINDOWS):
        count, total, total_sq = windows[3 * i : 3 * i + 3]
        if count > 0:
            metrics[f"{prefix}vif{n}"] = n * (total_sq / count - (total / count) ** 2) / var
    if "corr_segments" in sums:
        count, weighted = sums["corr_segments"]
        if count > 0:
            metrics[f"{prefix}vif_segments"] = (weighted / count) / var
    return metrics
