"""The ratio-correlation metrics (``maspo_verl.core.correlation``) against a plain float64 loop over rows, and
against the closed form of AR(1) log-ratios with a planted correlation."""

import statistics

import pytest
import torch

from maspo_verl.core.correlation import WINDOWS, correlation_metrics, correlation_sums


def reference_metrics(delta, mask, segment_ids=None):
    """The module's definitions written plainly, row by row, in float64."""
    tokens = sq = pairs = lag = 0.0
    windows = {n: [] for n in WINDOWS}
    segments = []  # (length, mean of x) of the segments shorter than their row
    for b in range(delta.shape[0]):
        cols = [t for t in range(delta.shape[1]) if mask[b, t]]
        values = [float(delta[b, t]) for t in cols]
        if not values:
            continue
        mu = sum(values) / len(values)
        x = [v - mu for v in values]
        tokens += len(x)
        sq += sum(v * v for v in x)
        pairs += len(x) - 1
        lag += sum(x[i] * x[i - 1] for i in range(1, len(x)))
        for n in WINDOWS:
            windows[n] += [sum(x[k * n : (k + 1) * n]) / n for k in range(len(x) // n)]
        if segment_ids is not None:
            groups = {}
            for t, v in zip(cols, x, strict=True):
                groups.setdefault(int(segment_ids[b, t]), []).append(v)
            segments += [(len(g), sum(g) / len(g)) for g in groups.values() if len(g) < len(x)]
    var = sq / tokens
    out = {"actor/ratio/corr_lag1": (lag / pairs) / var}
    for n, means in windows.items():
        if means:
            out[f"actor/ratio/vif{n}"] = n * statistics.pvariance(means) / var
    if segments:
        out["actor/ratio/vif_segments"] = statistics.fmean(length * m * m for length, m in segments) / var
    return out


def host(sums):
    return {name: value.tolist() for name, value in sums.items()}


def random_rows(seed, B=7, T=130):
    """Log-ratios with some correlation, a mask with left/right padding and holes, contiguous segment ids."""
    g = torch.Generator().manual_seed(seed)
    delta = torch.randn(B, T, generator=g, dtype=torch.float64).cumsum(-1) * 0.05 + torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.15
    mask[0, :40] = False  # left padding
    mask[1, 90:] = False  # right padding
    mask[2] = False  # an empty row
    mask[3, 1:] = False  # a one-token row
    starts = (torch.rand(B, T, generator=g) < 0.2) & mask
    seg = (torch.cumsum(starts.long(), -1) - 1).clamp(min=0)
    seg[4] = 0  # one segment over the whole row
    return delta, mask, seg


@pytest.mark.parametrize("seed", range(4))
def test_equals_the_plain_float64_loop(seed):
    delta, mask, seg = random_rows(seed)
    got = correlation_metrics(host(correlation_sums(delta, mask, seg)))
    want = reference_metrics(delta, mask, seg)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name


def test_float32_log_ratios_agree_with_float64():
    delta, mask, seg = random_rows(7)
    got = correlation_metrics(host(correlation_sums(delta.float(), mask, seg)))
    for name, value in reference_metrics(delta, mask, seg).items():
        assert got[name] == pytest.approx(value, rel=1e-4), name


def test_sums_add_up_over_micro_batches():
    delta, mask, seg = random_rows(3, B=8)
    whole = host(correlation_sums(delta, mask, seg))
    parts = [host(correlation_sums(delta[i : i + 3], mask[i : i + 3], seg[i : i + 3])) for i in (0, 3, 6)]
    added = {name: [sum(p[name][k] for p in parts) for k in range(len(whole[name]))] for name in whole}
    got, want = correlation_metrics(added), correlation_metrics(whole)
    assert got == pytest.approx(want, rel=1e-12)


def ar1(rho, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(B, T, generator=g, dtype=torch.float64)
    x = torch.empty_like(noise)
    x[:, 0] = noise[:, 0]
    for t in range(1, T):  # stationary AR(1) with unit variance
        x[:, t] = rho * x[:, t - 1] + (1 - rho * rho) ** 0.5 * noise[:, t]
    return x


def ar1_vif(rho, n):
    """n Var(mean of n) / Var for a stationary AR(1): 1 + 2 sum_{k<n} (1 - k/n) rho^k."""
    return 1 + 2 * sum((1 - k / n) * rho**k for k in range(1, n))


@pytest.mark.parametrize("rho", [0.0, 0.3, 0.7])
def test_planted_ar1_correlation_gives_the_closed_form(rho):
    delta = ar1(rho, B=48, T=3000, seed=11) * 0.2 + 0.05  # an offset: centring per row removes it
    mask = torch.ones_like(delta, dtype=torch.bool)
    got = correlation_metrics(host(correlation_sums(delta, mask)))
    assert got["actor/ratio/corr_lag1"] == pytest.approx(rho, abs=0.02)
    for n in WINDOWS:
        # sampling error about sqrt(2 / #windows) relative (2880 windows of 50), plus the centring's small bias
        assert got[f"actor/ratio/vif{n}"] == pytest.approx(ar1_vif(rho, n), rel=0.1), n
    assert "actor/ratio/vif_segments" not in got  # no segments given


def test_token_segments_of_independent_ratios_give_one():
    delta, mask, _ = random_rows(5)
    mask[3] = False  # no one-token row: every segment is shorter than its row
    each_token = (torch.cumsum(mask.long(), -1) - 1).clamp(min=0)
    got = correlation_metrics(host(correlation_sums(delta, mask, each_token)))
    assert got["actor/ratio/vif_segments"] == pytest.approx(1.0, rel=1e-12)


def test_no_data_reports_nothing():
    mask = torch.ones(3, 60, dtype=torch.bool)
    whole_rows = torch.zeros(3, 60, dtype=torch.long)
    assert correlation_metrics(host(correlation_sums(torch.zeros(3, 60), mask))) == {}  # on-policy: delta = 0
    constant_rows = torch.arange(3.0).unsqueeze(-1).expand(3, 60)  # equal within each row
    assert correlation_metrics(host(correlation_sums(constant_rows, mask, whole_rows))) == {}
    varied = torch.randn(3, 60, generator=torch.Generator().manual_seed(0))
    metrics = correlation_metrics(host(correlation_sums(varied, mask, whole_rows)))
    assert "actor/ratio/vif_segments" not in metrics and "actor/ratio/vif50" in metrics
    short = torch.zeros(3, 60, dtype=torch.bool)
    short[:, :4] = True  # rows shorter than every window
    metrics = correlation_metrics(host(correlation_sums(varied, short)))
    assert set(metrics) == {"actor/ratio/corr_lag1"}
