"""adaptive: each response's segment length read from its own token log-ratios (docs/algorithms.md §3, "adaptive").

Two criteria (``adaptive_criterion``), both per row of log-ratios delta = log pi - log pi_old:

- ``band``: the longest power of two n <= ``adaptive_max_len`` whose clip band still holds the row's mean
  log-ratio twice over, |mean delta| <= eps n^p / 2 (``log_adaptive``'s band exp(-+eps n^p), eps on the side of
  the mean's sign, p = ``clip_exponent`` < 0). Drift moves a segment's mean by about -KL per token whatever its
  length while the band narrows with n, so past that n whole segments clip that single tokens would not. It reads
  that band whatever ``clip_schedule`` clips with (with ``ratio``, or SAPO's gate, it is a drift tolerance only).
- ``correlation``: the row's measured variance inflation VIF(M) (the loss's ``vif<n>`` metric, per row), rounded
  down and kept between 1 and M: the integrated correlation length of delta over a measurement window M, the
  longest power of two with at least ``MIN_WINDOWS`` whole windows in the row and at most ``adaptive_max_len``.
  A row whose log-ratios carry no statistic (fewer than 2 tokens, or all equal, as on verl's first on-policy
  update) takes ``adaptive_min_len``.

Per response, not per batch: the choice is the same whatever verl groups into a micro-batch or a rank (the
gradient stays data-parallel invariant), and a row's reference is a plain loop over that row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from maspo_verl.core.segments.rule import LOG_RATIO, Candidates, Example, SegmentRule, Sweep
from maspo_verl.validation import Choice as OneOf
from maspo_verl.validation import Int, Setting, fail

# whole measurement windows a row needs for its VIF(M): fewer make the estimate too noisy (independent ratios
# would read VIF >= 2 in about 4 % of rows with 8 windows, 1 % with 16)
MIN_WINDOWS = 8
# the setting that gives every response one segment (the sequence limit)
UNBOUNDED = 1 << 30
PREFIX = "actor/ratio/adaptive_"
CRITERIA = ("correlation", "band")
# the band criterion's (eps_low, eps_high, p): log_adaptive's log-space band is [-eps_low n^p, eps_high n^p]
Band = tuple[float, float, float]
# the settings of the band criterion's worked examples: the shipped preset's band
BAND = {
    "adaptive_criterion": "band",
    "clip_schedule": "log_adaptive",
    "clip_exponent": -0.5,
    "log_clip_low": 0.2,
    "log_clip_high": 0.2,
}


@dataclass
class Choice:
    """Each row's choice [B, 1]: ``length`` n (int64), the measurement ``window`` M (int64), ``vif`` VIF(M)
    (float64, 0 where not ``measured``), ``measured`` (the row's log-ratios carry a VIF), ``bias`` the row's
    mean log-ratio (float64, 0 on a row without tokens)."""

    length: torch.Tensor
    window: torch.Tensor
    vif: torch.Tensor
    measured: torch.Tensor
    bias: torch.Tensor


def measurement_windows(lengths: torch.Tensor, max_len: int, T: int) -> torch.Tensor:
    """M per row [B, 1] (int64): the longest power of two <= ``max_len`` with ``MIN_WINDOWS`` whole windows in
    the row's ``lengths`` valid tokens, else 1."""
    cap = torch.div(lengths, MIN_WINDOWS, rounding_mode="floor").clamp_(max=max_len)
    window = torch.ones_like(cap)
    k = 2
    while k <= min(T // MIN_WINDOWS, max_len):  # powers of two, not tokens
        window = torch.where(cap >= k, k, window)
        k *= 2
    return window


def window_sums(x: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, n: torch.Tensor):
    """Per row, VIF(n)'s window sums of ``x`` [B, T] (zero outside the bool ``mask``; ``lengths`` [B, 1] its valid
    tokens): each window's sum of x, windows of the row's ``n`` [B, 1] consecutive valid tokens from its first,
    whole windows only, flat [B * (T + 1)] (row b's at b * (T + 1) ...), and the row's expectation under
    independence, sum over its windows of n (1 - n/L) [B, 1]. (``metrics.correlation_sums`` does the same for its
    three fixed n, for the batch's metric.)"""
    slots = mask.shape[-1] + 1
    # the window of each token (its position among the row's valid tokens // n), int64 as scatter's index, in place
    index = torch.cumsum(mask, -1).sub_(1).div_(n, rounding_mode="floor")
    count = torch.div(lengths, n, rounding_mode="floor")  # whole windows per row [B, 1]
    whole = mask & (index < count)
    rows = torch.arange(mask.shape[0], device=mask.device).unsqueeze(-1)
    index.add_(rows * slots).masked_fill_(~whole, 0)
    window_sum = torch.zeros(mask.shape[0] * slots, dtype=x.dtype, device=x.device)
    window_sum.scatter_add_(0, index.reshape(-1), torch.where(whole, x, 0.0).reshape(-1))
    return window_sum, count * n * (1.0 - n / lengths.clamp(min=1.0))


def band_halves(band: Band, max_len: int, T: int) -> list[tuple[int, float, float]]:
    """The band criterion's candidates: (n, eps_low n^p / 2, eps_high n^p / 2) for the powers of two n <=
    ``max_len``, up to the first that holds ``T`` tokens (longer ones segment every row the same). Python floats,
    so the vectorised choice and the plain one compare against the same numbers."""
    eps_low, eps_high, p = band
    out, n = [], 1
    while n <= max_len:
        out.append((n, eps_low * n**p / 2, eps_high * n**p / 2))
        if n >= T:
            break
        n *= 2
    return out


def adaptive_choice(
    delta: torch.Tensor, mask: torch.Tensor, min_len: int, max_len: int, band: Band | None = None
) -> Choice:
    """Each row's segment length from its log-ratios ``delta`` [B, T] over ``mask`` (any order, holes allowed):
    by the ``band`` criterion where one is given (its (eps_low, eps_high, p)), else by the correlation one.

    Band: n is the longest candidate of ``band_halves`` whose half band on the side of the row's mean log-ratio
    holds that mean (the half bands narrow with n, as p < 0), 1 where none does. Also each row's mean log-ratio
    and its VIF(M), whatever the criterion.

    Correlation: VIF(M) = sum over windows of (sum of x)^2 / (sigma^2 sum over windows of M (1 - M/L)), x the
    row's centred log-ratios and sigma^2 = sum x^2 / (L - 1) (``window_sums``, per row); it is computed on
    L x = L delta - sum delta (VIF does not change when a row is scaled), exact for dyadic inputs. n =
    max(``min_len``, min(M, max(1, floor VIF(M)))) where measured, else ``min_len``. float64, no host sync."""
    mask = mask.bool()
    valid = mask.to(torch.float64)
    d = torch.where(mask, delta.double(), 0.0)
    lengths = valid.sum(-1, keepdim=True)  # [B, 1]
    total = d.sum(-1, keepdim=True)
    y = (d * lengths - total).mul_(valid)
    del d, valid  # float64 [B, T]: freed before the window sums (peak memory)
    squared = (y * y).sum(-1, keepdim=True)
    window = measurement_windows(lengths.long(), max_len, mask.shape[-1])
    sums, expected = window_sums(y, mask, lengths, window)
    squares = (sums * sums).view(mask.shape[0], -1).sum(-1, keepdim=True)
    measured = (lengths >= 2) & (squared > 0)
    sigma2 = squared / (lengths - 1).clamp(min=1.0)
    vif = torch.where(measured, squares / torch.where(measured, expected * sigma2, 1.0), 0.0)
    bias = total / lengths.clamp(min=1.0)
    if band is None:
        chosen = torch.where(measured, torch.minimum(vif.floor().clamp(min=1.0).long(), window), min_len)
    else:
        chosen = torch.ones_like(window)
        for n, low, high in band_halves(band, max_len, mask.shape[-1]):
            chosen = torch.where(torch.where(bias < 0, -bias <= low, bias <= high), n, chosen)
    return Choice(chosen.clamp(min=min_len), window, vif, measured, bias)


def plain_choice(
    delta: list[float], min_len: int, max_len: int, band: Band | None = None
) -> tuple[int, int, float | None]:
    """``adaptive_choice`` of one row, written plainly (float64): (n, M, VIF(M) or None where not measured)."""
    L = len(delta)
    window = 1
    while window * 2 <= max_len and window * 2 * MIN_WINDOWS <= L:
        window *= 2
    total = sum(delta)
    y = [v * L - total for v in delta]
    squared = sum(v * v for v in y)
    vif = None
    if L >= 2 and squared != 0:
        count = L // window
        squares = sum(sum(y[w * window : (w + 1) * window]) ** 2 for w in range(count))
        vif = squares / (count * window * (1.0 - window / L) * squared / (L - 1))
    if band is not None:
        bias = total / max(L, 1)
        held = [n for n, low, high in band_halves(band, max_len, L) if (-bias <= low if bias < 0 else bias <= high)]
        return max(min_len, max(held, default=1)), window, vif
    if vif is None:
        return min_len, window, None
    return max(min_len, min(window, max(1, math.floor(vif)))), window, vif


class AdaptiveRule(SegmentRule):
    """Each response's window length read from its own log-ratios, between `adaptive_min_len` and
    `adaptive_max_len`: `band`, the longest power of two whose clip band holds the row's mean log-ratio twice over
    (drift: shorter); `correlation`, its measured VIF(M) rounded down (independent ratios: 1; correlated: longer)."""

    name = "adaptive"
    needs = frozenset({LOG_RATIO})
    settings = (
        Setting(
            "adaptive_min_len",
            1,
            Int(1),
            "shortest segment (`adaptive`); `correlation`: also the length of rows whose log-ratios are all equal",
        ),
        Setting("adaptive_max_len", 64, Int(1), "longest segment and measurement window (`adaptive`; powers of two)"),
        Setting(
            "adaptive_criterion",
            "correlation",
            OneOf(CRITERIA),
            "`adaptive`: band (reads log_clip_low/high and clip_exponent < 0) or correlation (docs: algorithms)",
        ),
    )
    limits = {
        "token": {"adaptive_min_len": 1, "adaptive_max_len": 1},
        "sequence": {"adaptive_min_len": UNBOUNDED, "adaptive_max_len": UNBOUNDED},
    }
    examples = (
        Example(
            "log-ratios +1 then -1 over 64 tokens: M = 8, VIF(8) = 8 * 63 / 56 = 9, kept to 8",
            ((1,) * 64,),
            ((8,) * 8,),
            {},
            {LOG_RATIO: ((1.0,) * 32 + (-1.0,) * 32,)},
        ),
        Example(
            "the same with adaptive_max_len 4: M = 4, VIF(4) = 4 * 63 / 60 = 4.2 -> 4",
            ((1,) * 64,),
            ((4,) * 16,),
            {"adaptive_max_len": 4},
            {LOG_RATIO: ((1.0,) * 32 + (-1.0,) * 32,)},
        ),
        Example(
            "alternating log-ratios over 16 tokens: M = 2, every window sums to 0, VIF 0 -> n = 1",
            ((1,) * 16,),
            ((1,) * 16,),
            {},
            {LOG_RATIO: ((1.0, -1.0) * 8,)},
        ),
        Example(
            "all-equal log-ratios (verl's first update) carry no statistic: adaptive_min_len 3; padding ignored",
            ((1,) * 10 + (0, 0),),
            ((3, 3, 3, 1),),
            {"adaptive_min_len": 3},
            {LOG_RATIO: ((0.0,) * 10 + (5.0, -5.0),)},
        ),
        Example(
            "10 tokens cannot hold 8 windows of 2: M = 1, n = 1 whatever the log-ratios",
            ((1,) * 10,),
            ((1,) * 10,),
            {},
            {LOG_RATIO: ((1.0,) * 5 + (-1.0,) * 5,)},
        ),
        Example(
            "band: mean log-ratio 1/16, half band 0.5 n^-0.5 / 2 holds it up to n = 16 (equal there), not at 32",
            ((1,) * 40,),
            ((16, 16, 8),),
            {**BAND, "log_clip_high": 0.5},
            {LOG_RATIO: ((0.0625,) * 40,)},
        ),
        Example(
            "band: mean -1/16 reads the lower side, eps_low 0.25: half band 0.125 n^-0.5 holds it up to n = 4",
            ((1,) * 16,),
            ((4,) * 4,),
            {**BAND, "log_clip_low": 0.25, "log_clip_high": 4.0},
            {LOG_RATIO: ((-0.0625,) * 16,)},
        ),
        Example(
            "band: mean 0 (log-ratios +-1) fits every band, so the longest window: one segment; padding ignored",
            ((1,) * 20 + (0, 0),),
            ((20,),),
            BAND,
            {LOG_RATIO: ((1.0, -1.0) * 10 + (9.0, 9.0),)},
        ),
        Example(
            "band: mean 1 is outside even one token's half band 0.1 (eps 0.2): n = 1",
            ((1,) * 6,),
            ((1,) * 6,),
            BAND,
            {LOG_RATIO: ((1.0,) * 6,)},
        ),
    )

    def validate(self, config):
        from maspo_verl.core.segments.registry import rules_in_use  # the registry imports this module

        if config.adaptive_min_len > config.adaptive_max_len:
            fail(
                "adaptive_min_len",
                config.adaptive_min_len,
                f"an integer <= adaptive_max_len={config.adaptive_max_len}",
            )
        if band_of(config) is not None and config.clip_exponent >= 0 and self in rules_in_use(config):
            fail(
                "adaptive_criterion",
                "band",
                "correlation, or band with clip_exponent < 0 (the log-space band eps n^p it reads must narrow with "
                f"the segment length; now clip_exponent={config.clip_exponent})",
            )

    def candidates(self, config, packed, inputs):
        delta = packed.pack(inputs.get(LOG_RATIO))
        choice = adaptive_choice(delta, packed.valid, config.adaptive_min_len, config.adaptive_max_len, band_of(config))
        boundaries = packed.valid & (packed.columns % choice.length == 0)
        return Candidates(
            boundaries, torch.ones(boundaries.shape, device=boundaries.device), None, metrics(choice, packed)
        )

    def reference(self, config, row):
        n, _, _ = plain_choice(row.log_ratio, config.adaptive_min_len, config.adaptive_max_len, band_of(config))
        return [1.0 if p % n == 0 else None for p in range(len(row.positions))]

    def sweeps(self, config, packed, inputs):
        inputs.get(LOG_RATIO)  # a corpus without the policy's log-probs: left out, with the reason
        longest = int(packed.lengths.max()) if packed.lengths.numel() else 1
        grid = tuple(2**k for k in range(int(math.log2(max(longest // MIN_WINDOWS, 1))) + 1))
        return [Sweep("adaptive", {"segment_rule": self.name}, "adaptive_max_len", grid)]


def band_of(config) -> Band | None:
    """The band criterion's (eps_low, eps_high, p) from the policy-loss config, or None for the correlation one."""
    if getattr(config, "adaptive_criterion", "correlation") != "band":
        return None
    return (config.log_clip_low, config.log_clip_high, config.clip_exponent)


def metrics(choice: Choice, packed) -> dict[str, torch.Tensor]:
    """The chosen lengths and what chose them: ``len`` the mean chosen n (at most the row's length) over rows with
    tokens; ``vif`` and ``window`` the mean VIF(M) and M over measured rows, as (sum, count) pairs (not reported
    where no row is measured, rather than as 0); ``measured_frac`` the share of rows with tokens that are
    measured; ``bias`` the mean |mean log-ratio| of rows with tokens (what the band criterion reads)."""
    rows = (packed.lengths > 0).to(torch.float64)
    measured = choice.measured.to(torch.float64)
    per_row = torch.minimum(choice.length, packed.lengths.long()).to(torch.float64)
    n_rows, n_measured = rows.sum().clamp(min=1.0), measured.sum()
    return {
        f"{PREFIX}len": (per_row * rows).sum() / n_rows,
        f"{PREFIX}vif": torch.stack([(choice.vif * measured).sum(), n_measured]),
        f"{PREFIX}window": torch.stack([(choice.window * measured).sum(), n_measured]),
        f"{PREFIX}measured_frac": n_measured / n_rows,
        f"{PREFIX}bias": torch.stack([(choice.bias.abs() * rows).sum(), rows.sum()]),
    }
