"""The lab's statistics for paired seeds: t-intervals, sign-flip tests, equivalence (TOST) and Holm's correction.

Every study compares arms paired by seed (the same initial policy, target and first batch), so each test reads
one vector of per-seed differences ``d``. Standard library only (no scipy): the Student t distribution comes
from the regularised incomplete beta function (a continued fraction), its quantiles from bisection.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

EXACT_MAX = 20  # sign-flip tests enumerate all 2^n sign vectors up to this many seeds
DRAWS = 200_000  # above it: random sign vectors, p = (1 + hits) / (1 + draws), valid for any number of draws


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        even = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        for num in (even, odd):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on ``t_cdf``)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    lo, hi = -1e6, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def _finite(d: Sequence[float]) -> list[float]:
    return [float(x) for x in d if x is not None and math.isfinite(float(x))]


def mean_se(d: Sequence[float]) -> tuple[float, float, int]:
    """Mean, standard error (sample sd / sqrt n) and n of the finite values."""
    x = _finite(d)
    n = len(x)
    if n < 2:
        raise ValueError(f"a paired test needs at least 2 finite differences, got {n}")
    m = sum(x) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in x) / (n - 1))
    return m, sd / math.sqrt(n), n


def t_interval(d: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the paired t-interval of the mean difference at ``level`` (two-sided)."""
    m, se, n = mean_se(d)
    q = t_quantile(0.5 + level / 2, n - 1)
    return m, m - q * se, m + q * se


def t_test(d: Sequence[float]) -> float:
    """Two-sided p of the paired t-test of mean 0."""
    m, se, n = mean_se(d)
    if se == 0:
        return 1.0 if m == 0 else 0.0
    return 2.0 * t_cdf(-abs(m / se), n - 1)


def sign_flip(d: Sequence[float], draws: int = DRAWS, seed: int = 0) -> tuple[float, str]:
    """Two-sided p of the paired sign-flip (randomisation) test of the mean difference, and how it was computed.

    Under "no difference" each seed's difference is as likely negative as positive, so |sum(s_i d_i)| over the
    2^n sign vectors s is the null distribution of |sum(d_i)|. Up to ``EXACT_MAX`` seeds every vector is
    enumerated (``exact``); above, ``draws`` random ones with p = (1 + hits) / (1 + draws) (``random``): a p that
    is never too small for any number of draws (Phipson and Smyth 2010). With n seeds the smallest exact p is
    2 / 2^n (5 seeds: 0.0625).
    """
    x = _finite(d)
    n = len(x)
    if n == 0:
        raise ValueError("sign_flip: no finite differences")
    import numpy as np

    v = np.asarray(x)
    observed = abs(v.sum()) * (1 - 1e-12)  # ties count as at least as extreme
    if n <= EXACT_MAX:
        if observed == 0:
            return 1.0, "exact"
        # meet in the middle: every signed sum of the first half against the sorted ones of the second
        half = n // 2
        left, right = _signed_sums(v[:half]), np.sort(_signed_sums(v[half:]))
        hits = np.searchsorted(right, observed - left, side="left")  # right < observed - left
        hits = (right.size - hits) + np.searchsorted(right, -observed - left, side="right")
        return int(hits.sum()) / 2**n, "exact"
    rng, hits = np.random.default_rng(seed), 0
    for start in range(0, draws, 20_000):
        signs = 1 - 2 * rng.integers(0, 2, size=(min(20_000, draws - start), n))
        hits += int((np.abs(signs @ v) >= observed).sum())
    return (1 + hits) / (1 + draws), "random"


def _signed_sums(v):
    """The 2^len(v) sums of ±v_i (every sign vector)."""
    import numpy as np

    sums = np.zeros(1)
    for x in v:
        sums = np.concatenate([sums + x, sums - x])
    return sums


def tost(d: Sequence[float], margin: float, alpha: float = 0.05) -> dict:
    """Two one-sided t-tests of equivalence within +-``margin``: ``p`` = the larger one-sided p; equivalent when
    ``p`` < ``alpha``, i.e. the (1 - 2 alpha) t-interval lies inside (-margin, +margin)."""
    if not margin > 0:
        raise ValueError(f"tost: margin must be > 0, got {margin}")
    m, se, n = mean_se(d)
    if se == 0:
        p = 0.0 if abs(m) < margin else 1.0
    else:
        p = max(1.0 - t_cdf((m + margin) / se, n - 1), t_cdf((m - margin) / se, n - 1))
    _, low, high = t_interval(d, 1 - 2 * alpha)
    return {"p": p, "equivalent": p < alpha, "low": low, "high": high}


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error), in the input order."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    out, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        out[i] = running
    return out


def holm_by(rows: list[dict], group: str, p: str, out: str) -> list[dict]:
    """Each row's ``p`` Holm-adjusted within the rows that share its ``group`` value, written to ``out``."""
    for value in dict.fromkeys(r[group] for r in rows):
        mine = [r for r in rows if r[group] == value]
        for r, adjusted in zip(mine, holm([r[p] for r in mine]), strict=True):
            r[out] = adjusted
    return rows


def paired_summary(d: Sequence[float], margin: float | None = None, level: float = 0.95, seed: int = 0) -> dict:
    """One paired comparison: mean, t-interval, t-test p, sign-flip p (and how), TOST against ``margin``."""
    m, low, high = t_interval(d, level)
    p_flip, how = sign_flip(d, seed=seed)
    row = {
        "seeds": len(_finite(d)),
        "diff": m,
        "low": low,
        "high": high,
        "p_t": t_test(d),
        "p_signflip": p_flip,
        "signflip": how,
    }
    if margin is not None:
        eq = tost(d, margin)
        row |= {"margin": margin, "p_tost": eq["p"], "tost_low": eq["low"], "tost_high": eq["high"]}
    return row


# -- pairing the held-out runs of a study -------------------------------------------------------------


def held(runs: list[dict], tune: int) -> dict[tuple, dict]:
    """The held-out runs by task, cell, loss, band, seed and ``start`` (a run's starting point where a study keys
    it, e.g. part 2's warm-model build; "" elsewhere), in the order of ``runs``."""
    return {
        (r["task"], r["cell"], r["loss"], r["band"], int(r["seed"]), r.get("start", "")): r
        for r in runs
        if int(r["seed"]) >= tune
    }


# a run row's column: the fingerprint of the warm model it started from (``speechwarm.fingerprint``), where the
# run recorded one
FINGERPRINT = "warm_fingerprint"


def fingerprint_of(run: dict) -> str:
    """The run's warm-model fingerprint, "" where it recorded none (a row without the column, or empty)."""
    value = run.get(FINGERPRINT)
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def same_model(x: dict, y: dict) -> None:
    """Two runs about to be paired: a ValueError naming both where each recorded a warm-model fingerprint and
    they differ (the runs started from different models, so their difference is not the arms')."""
    fx, fy = fingerprint_of(x), fingerprint_of(y)
    if fx and fy and fx != fy:

        def name(r):
            where = f", piece {r['piece']}" if r.get("piece") else ""
            return f"{r.get('task')} {r.get('cell')} {r.get('loss')} band {r.get('band')} seed {r.get('seed')}{where}"

        raise ValueError(
            f"refusing to pair two runs that started from different warm models: {name(x)} (fingerprint {fx}) "
            f"and {name(y)} (fingerprint {fy}); rebuild the warm model or rerun one of them on the other's"
        )


def pairs(held: dict, task: str, cell: str, a: tuple, b: tuple) -> dict[int, tuple[dict, dict]]:
    """Per held-out seed, ``a``'s run and ``b``'s ((loss, band) each) that share their ``start``: one pair a seed,
    ``a``'s first run, in ``held``'s order, that ``b`` has a run beside. Two runs whose warm-model fingerprints
    differ are refused (``same_model``)."""
    starts: dict[int, list] = {}
    for t, c, lo, ba, s, start in held:
        if (t, c, lo, ba) == (task, cell, *a):
            starts.setdefault(s, []).append(start)
    out = {}
    for s in sorted(starts):
        shared = next((x for x in starts[s] if (task, cell, *b, s, x) in held), None)
        if shared is not None:
            out[s] = (held[(task, cell, *a, s, shared)], held[(task, cell, *b, s, shared)])
            same_model(*out[s])
    return out


def paired(held: dict, task: str, cell: str, a: tuple, b: tuple, metric="final_reward", margin=None) -> dict:
    """``a`` minus ``b`` ((loss, band) each) on the held-out seeds, paired by seed and start (``pairs``):
    ``paired_summary`` (mean, 95 % t-interval, sign-flip p, TOST against ``margin``); *supported*: the
    interval excludes 0."""
    from maspo_verl.lab.engine.common import as_float

    diffs = [as_float(x[metric]) - as_float(y[metric]) for x, y in pairs(held, task, cell, a, b).values()]
    diffs = [d for d in diffs if math.isfinite(d)]
    if len(diffs) < 2:
        return {}
    row = paired_summary(diffs, margin)
    return row | {"supported": bool(row["low"] > 0 or row["high"] < 0)}


def with_holm(rows: list[dict], family: str = "comparison") -> list[dict]:
    """Holm-adjusted sign-flip p (``p_holm``) within each value of ``family``; *supported_holm*: below 0.05."""
    for r in holm_by(rows, family, "p_signflip", "p_holm"):
        r["supported_holm"] = r["p_holm"] < 0.05
    return rows


def mean_interval(values, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its t-interval (``t_interval``: honest for a few seeds, where a
    percentile bootstrap is too narrow); NaN for what fewer values do not define."""
    x = [float(v) for v in values if v is not None and v == v]
    if len(x) < 2:
        return (x[0] if x else math.nan), math.nan, math.nan
    return t_interval(x, level)


def contrast(terms: list[tuple[float, dict[int, float]]]) -> tuple[int, float, float, float, float]:
    """A paired contrast of ``terms`` ((sign, value per seed) each) over the seeds present in every term: the
    number of seeds, the mean of the per-seed sum of sign * value with its t-interval, and its sign-flip p."""
    seeds = sorted(set.intersection(*(set(t[1]) for t in terms))) if terms else []
    diffs = [sum(sign * values[s] for sign, values in terms) for s in seeds]
    p = sign_flip(diffs)[0] if diffs else math.nan
    return (len(seeds), *mean_interval(diffs), p)
