"""The metrics of one loss call, and the ratio-correlation sums among them (docs/algorithms.md §9).

``metric_sums`` reduces everything on the device into one float64 vector with a layout; ``metrics_from_sums`` reads
it back after the loss's one device-to-host transfer. ``correlation_sums`` / ``correlation_metrics`` are also used
for verl's own losses (``maspo_verl.plugin.hooks``) and by the lab.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from maspo_verl.core.surrogates import TokenLosses
from maspo_verl.core.tensors import float_mask

# the ratio-correlation metrics' window sizes and prefix (``correlation_sums``)
WINDOWS = (5, 15, 50)
PREFIX = "actor/ratio/"
# the correlation sums' names: ``correlation_sums`` returns exactly these, ``correlation_metrics`` reads them
SUM_NAMES = ("corr_tokens", "corr_windows", "corr_segments")


def metric_sums(
    mask: torch.Tensor,
    delta_sum: torch.Tensor,
    ratio: torch.Tensor,
    token_losses: TokenLosses,
    num_segments: torch.Tensor | None,
    buckets: int,
    response: torch.Tensor,
    rule_metrics: dict[str, torch.Tensor],
    correlation: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, tuple[tuple[str, int], ...]]:
    """All metrics of one call as raw sums, counts and extremes, named and reduced on the device into
    one float64 vector, and its layout (name, length) in order (``metrics_from_sums`` reads it back after
    a single transfer).

    ``mask``: the tokens in the loss; ``delta_sum``: the sum of their token log-ratios; ``num_segments``:
    each row's number of segments [B, 1] (None: not segments); ``response``: verl's response mask (``mask``
    plus the dropped non-finite tokens); ``rule_metrics``: more 0-d tensors, or (sum, count) pairs, to report
    under their own names (the segmentation rule's); ``correlation``: ``correlation_sums`` of the token log-ratios.
    """
    mask = mask.bool()
    clips = [c & mask for c in (token_losses.clipped_low, token_losses.clipped_high, token_losses.clipped_dual)]
    lengths = mask.sum(-1, dtype=torch.int32)  # [B]
    # ratio over valid tokens: zero on padding for the sum and max (r > 0), the largest float for the min
    valid = float_mask(mask, ratio.dtype)
    on_valid = ratio * valid
    top = torch.finfo(ratio.dtype).max
    ratio_sum, ratio_max = on_valid.sum(), on_valid.amax()
    ratio_min = on_valid.add_(valid.mul_(-top).add_(top)).amin()
    del valid, on_valid  # before the running sums below (peak memory)
    # Clip fraction by position bucket: valid position p of a row of length L is in bucket
    # floor(p K / L), so bucket k holds positions [ceil(k L / K), ceil((k + 1) L / K)); counted from
    # running sums at those starts, with no [B, T] bucket index.
    k = torch.arange(buckets + 1, device=mask.device, dtype=torch.int32)
    starts = (k * lengths.unsqueeze(-1) + buckets - 1) // buckets  # [B, K + 1]
    seen = torch.cumsum(mask, -1, dtype=torch.int32)
    clipped_seen = torch.cumsum(clips[0] | clips[1] | clips[2], -1, dtype=torch.int32)
    first_at = torch.searchsorted(seen, starts, right=True)  # first t with more than `start` valid tokens
    del seen
    before = clipped_seen.gather(-1, (first_at - 1).clamp_(min=0)).mul_(first_at > 0)
    parts = {
        # low, high, dual; one by one, as a bool sum first converts its input to the sum's dtype (peak memory)
        "clipped": torch.stack([c.sum(dtype=torch.int32) for c in clips]),
        "clipped_per_bucket": (before[:, 1:] - before[:, :-1]).sum(0),
        "tokens_per_bucket": (starts[:, 1:] - starts[:, :-1]).sum(0),
        "tokens": lengths.sum(),
        "nonfinite": response.sum(dtype=torch.int32) - lengths.sum(),  # dropped non-finite tokens
    }
    if num_segments is not None:
        rows = lengths > 0
        parts["rows"] = rows.sum()
        parts["segments"] = (num_segments.squeeze(-1) * rows).sum()
    parts.update(rule_metrics)
    parts.update(correlation)
    parts["delta_sum"] = delta_sum
    parts["ratio_sum"], parts["ratio_max"], parts["ratio_min"] = ratio_sum, ratio_max, ratio_min
    # one float64 vector: the integer parts, then the floating ones, each group joined before its one conversion
    # (exact: int32 joins int64, float32 joins float64)
    groups = ([], [])
    for name, part in parts.items():
        groups[part.is_floating_point()].append((name, part))
    layout = tuple((name, part.numel()) for group in groups for name, part in group)
    vector = [torch.cat([part.reshape(-1) for _, part in group]).to(torch.float64) for group in groups if group]
    return torch.cat(vector), layout


# the raw sums of ``metric_sums``; every other name in its layout is a metric reported as it is
RAW_SUMS = frozenset(
    {"clipped", "clipped_per_bucket", "tokens_per_bucket", "tokens", "nonfinite", "rows", "segments"}
    | {"delta_sum", "ratio_sum", "ratio_max", "ratio_min"}
    | set(SUM_NAMES)
)


def metrics_from_sums(host: list[float], layout: tuple[tuple[str, int], ...]) -> dict[str, float]:
    """The metrics from ``metric_sums``'s vector, moved to the host; the few divisions run in Python."""
    raw, start = {}, 0  # the vector by name
    for name, length in layout:
        raw[name] = host[start : start + length]
        start += length
    low_n, high_n, dual_n = raw["clipped"]
    (n_tokens,) = raw["tokens"]
    n = max(n_tokens, 1.0)
    metrics = {
        "actor/pg_clipfrac": (low_n + high_n) / n,
        "actor/pg_clipfrac_lower": dual_n / n,
        "actor/ppo_kl": -raw["delta_sum"][0] / n,  # delta is zero on padding
        "actor/ratio/clipfrac_low": low_n / n,
        "actor/ratio/clipfrac_high": high_n / n,
        "actor/ratio/clipfrac_dual": dual_n / n,
        "actor/ratio/mean": raw["ratio_sum"][0] / n,
        "actor/ratio/min": raw["ratio_min"][0] if n_tokens > 0 else 1.0,
        "actor/ratio/max": raw["ratio_max"][0] if n_tokens > 0 else 1.0,
        "actor/ratio/nonfinite_tokens": raw["nonfinite"][0],
    }
    buckets = len(raw["clipped_per_bucket"])
    for b, (clipped, tokens) in enumerate(zip(raw["clipped_per_bucket"], raw["tokens_per_bucket"], strict=True)):
        metrics[f"actor/ratio/clipfrac_pos{b + 1}of{buckets}"] = clipped / max(tokens, 1.0)
    if "segments" in raw:
        num_segments = raw["segments"][0]
        metrics["actor/ratio/segments_per_seq"] = num_segments / max(raw["rows"][0], 1.0)
        metrics["actor/ratio/segment_len_mean"] = n / max(num_segments, 1.0)
    metrics.update(correlation_metrics({name: raw[name] for name in SUM_NAMES if name in raw}))
    for name, values in raw.items():  # the rule's metrics: a value, or a (sum, count) pair
        if name not in RAW_SUMS and (len(values) == 1 or values[1] > 0):
            metrics[name] = values[0] if len(values) == 1 else values[0] / values[1]
    return metrics


# ---- ratio correlation: do the token log-ratios move together along a response? (docs/algorithms.md §9)
#
# Sharing one ratio over n tokens helps only where their log-ratios delta_t = log pi - log pi_old are
# correlated; for independent ones the segment mean is just a less noisy ratio, and only the clip band's
# width changes with n. Measured per row on x_t = delta_t - (the row's mean delta over valid tokens):
#
# - lag-1 autocorrelation: (sum x_t x_prev / #pairs) / (sum x_t^2 / #tokens), x_prev the row's previous
#   valid token (the textbook estimate; about -1/L for independent ratios on rows of L tokens);
# - VIF(n) = sum over windows of (sum of x in the window)^2 / (sigma^2 sum over windows of n (1 - n/L)),
#   windows of n consecutive valid tokens from each row's first (whole windows only) and
#   sigma^2 = sum x^2 / sum (L - 1): the variance of a window's mean against what independent ratios give
#   after the same centring, so 1 for independent ratios at any n and L, and
#   1 + 2 sum_{k<n} (1 - k/n) rho^k for AR(1) ones on long rows (the textbook n Var(window mean) / Var(x));
# - VIF(segments): the same with the preset's own segments as windows (a segment of m tokens expects
#   m (1 - m/L)); a segment that is its whole row expects 0 after centring and says nothing. With no other
#   segment the metric is not reported.
#
# ``correlation_sums`` runs on the device, with no host sync, and returns sums that add up over
# micro-batches and ranks; ``correlation_metrics`` turns those sums, moved to the host, into the metrics.
# A quantity with no data (no valid pair, all-equal log-ratios as on verl's first on-policy update) is not
# reported rather than reported as 0 or NaN.


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
    valid = float_mask(mask, delta.dtype)
    lengths = valid.sum(-1, keepdim=True)  # [B, 1]
    mean = (delta * valid).sum(-1, keepdim=True) / lengths.clamp(min=1.0)
    x = (delta - mean).mul_(valid)
    # the previous valid token of each column: the last valid column before it (-1: none). Here and below, indices
    # in int32 where no op needs int64 and each [B, T] tensor freed after its last use (the loss's peak memory)
    B, T = mask.shape
    cols = torch.arange(T, device=mask.device, dtype=torch.int32)
    last = torch.where(mask, cols, -1).cummax(-1).values
    prev = torch.nn.functional.pad(last[:, :-1], (1, 0), value=-1)
    del last
    has_prev = float_mask(mask & (prev >= 0), x.dtype)
    x_prev = x.gather(-1, prev.clamp_(min=0).long()).mul_(has_prev)
    del prev
    n_tokens = lengths.sum()
    lag_prod = x_prev.mul_(x).sum()
    del x_prev
    tokens = torch.stack([n_tokens, n_tokens - (lengths > 0).sum(), (x * x).sum(), has_prev.sum(), lag_prod])
    del has_prev
    # windows of each size n: position among the row's valid tokens // n, whole windows only, summed by a scatter
    # into B * (T // n + 1) slots (each row's windows from its first slot), one size at a time
    position = torch.cumsum(mask, -1, dtype=torch.int32).sub_(1)
    rows = torch.arange(B, device=mask.device).unsqueeze(-1)
    at_least_one = lengths.clamp(min=1.0)
    windows = []
    for n in WINDOWS:  # three sizes, not a loop over tokens
        k = T // n + 1
        window = torch.div(position, n, rounding_mode="floor")
        count = torch.div(lengths, n, rounding_mode="floor")  # whole windows per row
        whole = mask & (window < count)
        index = window.long().add_(rows * k).masked_fill_(~whole, 0)
        del window
        window_sum = torch.zeros(B * k, dtype=x.dtype, device=x.device)
        window_sum.scatter_add_(0, index.reshape(-1), torch.where(whole, x, 0.0).reshape(-1))
        del index, whole
        windows += [window_sum.mul_(window_sum).sum(), (count * n * (1.0 - n / at_least_one)).sum()]
    del position
    parts = {"corr_tokens": tokens, "corr_windows": torch.stack(windows)}
    if segment_ids is not None:
        ids = torch.where(mask, segment_ids, 0).long()
        seg_sum = torch.zeros_like(x).scatter_add_(-1, ids, x)
        seg_len = torch.zeros_like(x).scatter_add_(-1, ids, valid)
        del ids
        expected = seg_len * (1.0 - seg_len / at_least_one)
        parts["corr_segments"] = torch.stack([seg_sum.mul_(seg_sum).sum(), expected.sum()])
    return parts


def host_sums(sums: Mapping[str, torch.Tensor]) -> dict[str, list[float]]:
    """``correlation_sums``'s tensors (or sums of several) on the host, in one transfer."""
    names = list(sums)
    flat = torch.cat([sums[k].reshape(-1).double() for k in names]).tolist() if names else []
    out, start = {}, 0
    for k in names:
        out[k], start = flat[start : start + sums[k].numel()], start + sums[k].numel()
    return out


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
