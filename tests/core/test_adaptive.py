"""The ``adaptive`` rule's two criteria (``adaptive_choice``): against a float64 plain loop; correlation on AR(1)
log-ratios of known correlation, on independent ones, on all-equal ones; band on drifted rows against the length
worked out by hand, on zero-mean ones, at its limits; the rule without log-ratios; refused settings; its metrics in
the loss. Its worked examples, its reference on random rows and its limits against verl run in the discovered
tests."""

from __future__ import annotations

import math

import pytest
import torch

from maspo_verl.config import actor_config
from maspo_verl.core.losses import verl_loss_fn
from maspo_verl.core.segments import compute_segment_ids
from maspo_verl.core.segments.rules.adaptive import BAND, MIN_WINDOWS, UNBOUNDED, adaptive_choice, plain_choice
from tests.helpers import random_mask


def ar1(rho: float, rows: int, length: int, seed: int) -> torch.Tensor:
    """Stationary AR(1) rows of unit variance: x_t = rho x_{t-1} + sqrt(1 - rho^2) e_t."""
    e = torch.randn(rows, length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    x = torch.empty_like(e)
    x[:, 0] = e[:, 0]
    for t in range(1, length):
        x[:, t] = rho * x[:, t - 1] + math.sqrt(1 - rho * rho) * e[:, t]
    return x


def ar1_vif(rho: float, m: int) -> float:
    """VIF(m) of AR(1) ratios: 1 + 2 sum_{k<m} (1 - k/m) rho^k."""
    return 1 + 2 * sum((1 - k / m) * rho**k for k in range(1, m))


@pytest.mark.parametrize("seed", range(6))
def test_choice_equals_a_float64_loop(seed):
    """Real-valued log-ratios on long rows with holes and padding: VIF(M) as the loop computes it, the same
    window M and length n (n compared away from integer VIFs, where the two summation orders may round apart)."""
    g = torch.Generator().manual_seed(seed)
    B, T = 12, 400
    mask = random_mask(B, T, ["right", "left", "holes"][seed % 3], g)
    delta = ar1(0.3 * (seed % 4), B, T, seed) * 0.1 + 0.05 * torch.randn(B, 1, generator=g, dtype=torch.float64)
    min_len, max_len = (1, 64) if seed % 2 else (2, 16)
    got = adaptive_choice(delta.float(), mask, min_len, max_len)
    for b in range(B):
        row = [float(v) for v in delta.float()[b][mask[b]].double()]
        n, window, vif = plain_choice(row, min_len, max_len)
        assert int(got.window[b]) == window
        assert bool(got.measured[b]) == (vif is not None)
        if vif is not None:
            assert float(got.vif[b]) == pytest.approx(vif, rel=1e-9)
            if abs(vif - round(vif)) > 1e-9:
                assert int(got.length[b]) == n
    assert got.measured.any() and (got.length > 1).any()  # some rows were measured, and chose windows


@pytest.mark.parametrize("rho", [0.5, 0.8, 0.95])
def test_ar1_ratios_give_their_correlation_length(rho):
    """Rows of 512 AR(1) log-ratios: M = 64; VIF(64) within 8 % of 1 + 2 sum (1 - k/64) rho^k on average over
    rows, and the median n its integer part or one below (each row's estimate rests on 8 windows)."""
    delta = ar1(rho, 600, 512, seed=int(rho * 100))
    choice = adaptive_choice(delta, torch.ones(delta.shape, dtype=torch.bool), 1, 64)
    assert (choice.window == 64).all()
    want = ar1_vif(rho, 64)
    assert choice.vif.mean().item() == pytest.approx(want, rel=0.08)
    assert math.floor(want) - 1 <= choice.length.double().median().item() <= math.floor(want)


@pytest.mark.parametrize("length", [96, 512])
def test_independent_ratios_give_grpo(length):
    """White log-ratios: n = 1 in at least 90 % of rows and a mean n below 1.15, on each of 8 seeds (the
    estimator's false alarms: about 1-6 % of rows read VIF >= 2)."""
    for seed in range(8):
        delta = torch.randn(256, length, generator=torch.Generator().manual_seed(seed)) * 0.1
        choice = adaptive_choice(delta, torch.ones(delta.shape, dtype=torch.bool), 1, 64)
        n = choice.length.double()
        assert (n == 1).double().mean() >= 0.9, seed
        assert n.mean() < 1.15, seed
        assert choice.vif.mean().item() == pytest.approx(1.0, abs=0.1)  # 4 standard errors at L = 96


def test_equal_ratios_along_a_row_give_long_windows_and_all_equal_ones_the_minimum():
    rows = torch.linspace(-1, 1, 8).reshape(8, 1).expand(8, 256).clone()  # each row constant: no statistic
    rows[:4, 128:] *= -1  # a step half-way: equal ratios over 128 tokens
    choice = adaptive_choice(rows, torch.ones(rows.shape, dtype=torch.bool), 2, 32)
    assert choice.length[:4].flatten().tolist() == [32] * 4  # VIF(32) > 32: kept to M
    assert choice.length[4:].flatten().tolist() == [2] * 4 and not choice.measured[4:].any()


def test_short_rows_measure_no_window_longer_than_one():
    delta = torch.tensor([[1.0] * 8 + [-1.0] * 8] * 2)
    mask = torch.ones(delta.shape, dtype=torch.bool)
    mask[1, 2 * MIN_WINDOWS - 1] = False  # 15 tokens: fewer than 8 windows of 2
    choice = adaptive_choice(delta, mask, 1, 64)
    assert choice.window.flatten().tolist() == [2, 1]
    assert choice.length.flatten().tolist() == [2, 1]


def test_segment_ids_without_log_ratios_fail_naming_them():
    config = actor_config(loss_mode="maspo", segment_rule="adaptive").policy_loss
    with pytest.raises(ValueError, match="segment_rule='adaptive' needs log_ratio"):
        compute_segment_ids(torch.ones(2, 8, dtype=torch.bool), config)


def test_min_above_max_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="adaptive_min_len"):
        actor_config(loss_mode="maspo", segment_rule="adaptive", adaptive_min_len=8, adaptive_max_len=4)


def test_the_loss_reports_the_chosen_length_and_its_statistic():
    """Rows 0-1 correlated (a step: long windows), rows 2-3 independent: the loss's metrics are the means of
    the choice over the micro-batch, and its segments are the chosen windows."""
    B, T = 4, 128
    old = torch.full((B, T), -1.0, dtype=torch.float64)
    delta = 0.01 * torch.randn(B, T, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    delta[:2] = 0.01 * torch.where(torch.arange(T) < T // 2, 1.0, -1.0)
    new = (old + delta).requires_grad_()
    mask = torch.ones(B, T, dtype=torch.bool)
    config = actor_config(loss_mode="maspo", segment_rule="adaptive", adaptive_max_len=16)
    _, metrics = verl_loss_fn("maspo")(old, new, torch.ones(B, T), mask, "seq-mean-token-mean", config)
    choice = adaptive_choice(new.detach() - old, mask, 1, 16)
    assert choice.length[:2].flatten().tolist() == [16, 16]
    assert metrics["actor/ratio/adaptive_len"] == pytest.approx(choice.length.double().mean().item())
    assert metrics["actor/ratio/adaptive_vif"] == pytest.approx(choice.vif.mean().item())
    assert metrics["actor/ratio/adaptive_window"] == 16
    assert metrics["actor/ratio/adaptive_measured_frac"] == 1.0
    assert metrics["actor/ratio/segments_per_seq"] == pytest.approx((T / choice.length.double()).ceil().mean().item())


def test_a_micro_batch_with_no_measured_row_reports_no_statistic():
    """All-equal log-ratios (verl's first on-policy update): the rows take adaptive_min_len, and VIF(M) and M are
    left out (verl averages a metric over the micro-batches that report it) rather than reported as 0."""
    B, T = 3, 64
    old = torch.full((B, T), -1.0, dtype=torch.float64)
    new = old.clone().requires_grad_()
    config = actor_config(loss_mode="maspo", segment_rule="adaptive", adaptive_min_len=2)
    _, metrics = verl_loss_fn("maspo")(old, new, torch.ones(B, T), torch.ones(B, T), "seq-mean-token-mean", config)
    assert metrics["actor/ratio/adaptive_len"] == 2.0 and metrics["actor/ratio/adaptive_measured_frac"] == 0.0
    assert "actor/ratio/adaptive_vif" not in metrics and "actor/ratio/adaptive_window" not in metrics


SHIPPED_BAND = (0.2, 0.2, -0.5)  # maspo_adaptive's log_clip_low/high and clip_exponent


@pytest.mark.parametrize("seed", range(4))
def test_band_choice_equals_a_float64_loop(seed):
    """Drifted noisy rows (a per-row bias, either sign) with holes and padding, sides of different widths: the
    vectorised band choice equals the plain loop's, row by row."""
    g = torch.Generator().manual_seed(100 + seed)
    B, T = 16, 200
    mask = random_mask(B, T, ["right", "left", "holes"][seed % 3], g)
    delta = 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    delta += 0.04 * torch.randn(B, 1, generator=g, dtype=torch.float64)
    band = (0.2, 0.35, -0.5) if seed % 2 else (0.3, 0.1, -0.25)
    got = adaptive_choice(delta, mask, 1 + seed % 2, 64, band)
    lengths = set()
    for b in range(B):
        row = delta[b][mask[b]].tolist()
        n, window, _ = plain_choice(row, 1 + seed % 2, 64, band)
        assert min(int(got.length[b]), len(row)) == min(n, len(row)), b
        assert float(got.bias[b]) == pytest.approx(sum(row) / max(len(row), 1), abs=1e-15)
        lengths.add(n)
    assert len(lengths) >= 3  # the rows chose different lengths


@pytest.mark.parametrize(("bias", "want"), [(0.01, 64), (0.02, 16), (0.024, 16), (0.03, 8), (0.05, 4), (0.08, 1)])
def test_band_length_is_the_longest_power_of_two_whose_half_band_holds_the_drift(bias, want):
    """A row drifted by ``bias`` per token (either sign), under the shipped band 0.2 / sqrt(n): the longest power of
    two n <= 64 with bias <= 0.1 / sqrt(n), i.e. n <= (0.1 / bias)^2, worked out by hand (0.01: 100 -> 64;
    0.02: 25 -> 16; 0.024: 17.4 -> 16; 0.03: 11.1 -> 8; 0.05: 4 -> 4; 0.08: 1.56 -> 1)."""
    rows = torch.tensor([[bias] * 256, [-bias] * 256], dtype=torch.float64)
    rows += 0.5 * torch.tensor([1.0, -1.0]).repeat(128)  # zero-mean wiggle: only the mean counts
    choice = adaptive_choice(rows, torch.ones(rows.shape, dtype=torch.bool), 1, 64, SHIPPED_BAND)
    assert choice.length.flatten().tolist() == [want, want]


def test_band_gives_zero_mean_rows_the_longest_window_and_drifted_rows_shorter_ones():
    """White zero-mean log-ratios of any spread (no drift): the band holds the mean at every n, so n = the max;
    the same rows shifted by -KL-like drift 0.04 shorten to 4 ((0.1 / 0.04)^2 = 6.25); the correlation criterion
    gives both n ~ 1."""
    white = 0.3 * torch.randn(64, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    white -= white.mean(-1, keepdim=True)
    mask = torch.ones(white.shape, dtype=torch.bool)
    assert (adaptive_choice(white, mask, 1, 64, SHIPPED_BAND).length == 64).all()
    assert (adaptive_choice(white - 0.04, mask, 1, 64, SHIPPED_BAND).length == 4).all()
    assert adaptive_choice(white, mask, 1, 64).length.double().mean() < 1.2


def test_band_limits_are_the_token_and_the_sequence_ratio():
    """adaptive_min_len = adaptive_max_len = 1: a segment per token; both 2^30: one per row (segment ids), as the
    correlation criterion's limits, which the discovered tests hold equal to verl's losses."""
    delta = torch.randn(3, 40, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.01
    mask = torch.ones(delta.shape, dtype=torch.bool)
    mask[2, 30:] = False
    for lo_hi, want in ((1, torch.arange(40).expand(3, 40)), (UNBOUNDED, torch.zeros(3, 40, dtype=torch.long))):
        config = actor_config(
            loss_mode="maspo", segment_rule="adaptive", adaptive_min_len=lo_hi, adaptive_max_len=lo_hi, **BAND
        ).policy_loss
        ids = compute_segment_ids(mask, config, log_ratio=delta)
        assert torch.equal(ids[mask], want[mask]), lo_hi


@pytest.mark.parametrize("exponent", [0.5, 0.0])
def test_band_needs_a_band_that_narrows(exponent):
    """The band criterion with a log-space band that does not narrow with n (the default clip_exponent 0.5 is
    CTPO's, which widens) is refused at start-up, naming the field, the allowed values and the exponent; with
    verl's ratio clip (e.g. for SAPO) it still reads the log-space band, as a drift tolerance."""
    refused = rf"adaptive_criterion='band'.*clip_exponent < 0 .*now clip_exponent={exponent}"
    with pytest.raises(ValueError, match=refused):
        actor_config(loss_mode="maspo", segment_rule="adaptive", adaptive_criterion="band", clip_exponent=exponent)
    # another rule in use: the field is not read, nothing to refuse
    actor_config(loss_mode="maspo", segment_rule="fixed", adaptive_criterion="band", clip_exponent=exponent)
    config = actor_config(
        loss_mode="maspo", segment_rule="adaptive", **{**BAND, "clip_schedule": "ratio"}, surrogate="sapo"
    ).policy_loss
    delta = torch.full((1, 64), 0.04, dtype=torch.float64)  # (0.1 / 0.04)^2 = 6.25: windows of 4
    assert compute_segment_ids(torch.ones(1, 64, dtype=torch.bool), config, log_ratio=delta).max() == 15


def test_the_loss_reports_the_band_choice_and_the_drift_it_read():
    """Two rows drifted by 0.04 (n = 4) and two by 0.01 (n = 64): adaptive_len and adaptive_bias are their means."""
    B, T = 4, 128
    old = torch.full((B, T), -1.0, dtype=torch.float64)
    wiggle = 0.02 * torch.tensor([1.0, -1.0]).repeat(T // 2)
    delta = torch.tensor([[0.04], [-0.04], [0.01], [-0.01]], dtype=torch.float64) + wiggle
    new = (old + delta).requires_grad_()
    config = actor_config(loss_mode="maspo", segment_rule="adaptive", **BAND)
    _, metrics = verl_loss_fn("maspo")(old, new, torch.ones(B, T), torch.ones(B, T), "seq-mean-token-mean", config)
    assert metrics["actor/ratio/adaptive_len"] == pytest.approx((4 + 4 + 64 + 64) / 4)
    assert metrics["actor/ratio/adaptive_bias"] == pytest.approx(0.025)
    assert metrics["actor/ratio/segments_per_seq"] == pytest.approx((32 + 32 + 2 + 2) / 4)
