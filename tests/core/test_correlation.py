"""The ratio-correlation metrics (``maspo_verl.core.losses``) against a plain float64 loop over rows, and
against the closed form of AR(1) log-ratios with a planted correlation."""

import pytest
import torch

from maspo_verl.core.metrics import WINDOWS, correlation_metrics, correlation_sums


def reference_metrics(delta, mask, segment_ids=None):
    """The module's definitions written plainly, row by row, in float64."""
    tokens = dof = sq = pairs = lag = 0.0
    windows = {n: [0.0, 0.0] for n in WINDOWS}  # sum of squared window sums, what independent ratios expect
    segments = [0.0, 0.0]
    for b in range(delta.shape[0]):
        cols = [t for t in range(delta.shape[1]) if mask[b, t]]
        values = [float(delta[b, t]) for t in cols]
        if not values:
            continue
        length = len(values)
        mu = sum(values) / length
        x = [v - mu for v in values]
        tokens += length
        dof += length - 1
        sq += sum(v * v for v in x)
        pairs += length - 1
        lag += sum(x[i] * x[i - 1] for i in range(1, length))
        for n in WINDOWS:
            for k in range(length // n):
                windows[n][0] += sum(x[k * n : (k + 1) * n]) ** 2
                windows[n][1] += n * (1 - n / length)
        if segment_ids is not None:
            groups = {}
            for t, v in zip(cols, x, strict=True):
                groups.setdefault(int(segment_ids[b, t]), []).append(v)
            for g in groups.values():
                segments[0] += sum(g) ** 2
                segments[1] += len(g) * (1 - len(g) / length)
    sigma2 = sq / dof
    out = {"actor/ratio/corr_lag1": (lag / pairs) / (sq / tokens)}
    for n, (squares, expected) in windows.items():
        if expected > 0:
            out[f"actor/ratio/vif{n}"] = squares / (expected * sigma2)
    if segments[1] > 0:
        out["actor/ratio/vif_segments"] = segments[0] / (segments[1] * sigma2)
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


@pytest.mark.parametrize("length", [60, 128, 400])
def test_independent_ratios_give_one_at_any_row_length(length):
    # windows of 50 on rows of 60: centring each row leaves a window's sum only (1 - n/L) of n sigma^2
    g = torch.Generator().manual_seed(length)
    delta = torch.randn(4000, length, generator=g, dtype=torch.float64)
    segments = torch.div(torch.arange(length), 7, rounding_mode="floor").expand(4000, length)
    got = correlation_metrics(host(correlation_sums(delta, torch.ones_like(delta, dtype=torch.bool), segments)))
    for n in WINDOWS:
        assert got[f"actor/ratio/vif{n}"] == pytest.approx(1.0, abs=0.05), n
    assert got["actor/ratio/vif_segments"] == pytest.approx(1.0, abs=0.03)
    assert got["actor/ratio/corr_lag1"] == pytest.approx(-1 / (length - 1), abs=0.01)


def test_token_segments_of_independent_ratios_give_one():
    delta, mask, _ = random_rows(5)
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
