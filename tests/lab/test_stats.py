"""The lab's statistics (``lab.engine.stats``) against closed forms, hand-derived values and exact enumeration."""

import itertools
import math

import pytest

from maspo_verl.lab.engine import stats


@pytest.mark.parametrize("t", [-7.0, -1.3, 0.0, 0.4, 2.5, 30.0])
def test_t_cdf_matches_the_closed_forms_of_one_and_two_degrees_of_freedom(t):
    assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)  # Cauchy
    assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


@pytest.mark.parametrize(
    "df, q975",
    [(1, 12.7062047), (4, 2.7764451), (15, 2.1314495), (63, 1.9983405), (1000, 1.9623391)],
)
def test_t_quantiles_are_the_tabulated_ones(df, q975):
    assert stats.t_quantile(0.975, df) == pytest.approx(q975, abs=1e-6)
    assert stats.t_quantile(0.025, df) == pytest.approx(-q975, abs=1e-6)


def test_the_t_interval_is_mean_plus_minus_quantile_times_standard_error():
    d = [0.1, 0.3, -0.2, 0.4, 0.0]  # mean 0.12, sd sqrt(0.057) by hand
    m, lo, hi = stats.t_interval(d)
    half = 2.7764451 * math.sqrt(0.057) / math.sqrt(5)
    assert (m, lo, hi) == pytest.approx((0.12, 0.12 - half, 0.12 + half), abs=1e-6)
    assert stats.t_test(d) == pytest.approx(2 * stats.t_cdf(-0.12 / (math.sqrt(0.057) / math.sqrt(5)), 4))


def _enumerated(d):
    observed = abs(sum(d))
    signs_all = itertools.product((1, -1), repeat=len(d))
    flips = [abs(sum(s * v for s, v in zip(signs, d, strict=True))) for signs in signs_all]
    return sum(f >= observed - 1e-12 for f in flips) / len(flips)


@pytest.mark.parametrize("d", [[0.3, 0.1, 0.2, 0.05, 0.4], [0.3, -0.1, 0.2, -0.05, 0.4, -0.2, 0.1], [1.0, -1.0]])
def test_the_sign_flip_p_is_the_exact_enumeration(d):
    p, how = stats.sign_flip(d)
    assert how == "exact" and p == pytest.approx(_enumerated(d))


def test_five_seeds_cannot_reach_below_one_sixteenth():
    assert stats.sign_flip([0.5, 0.6, 0.7, 0.8, 0.9])[0] == pytest.approx(2 / 32)


def test_the_random_sign_flip_agrees_with_the_exact_one_and_is_never_zero():
    d = [0.05 * (i % 7) - 0.1 for i in range(24)]
    exact = _enumerated(d[:20])
    p20, _ = stats.sign_flip(d[:20])
    assert p20 == pytest.approx(exact)
    p, how = stats.sign_flip(d, draws=50_000)
    assert how == "random" and p > 0
    big = [1.0] * 64
    assert stats.sign_flip(big, draws=1000)[0] == pytest.approx(1 / 1001)  # only a draw of all-equal signs ties


def test_tost_is_equivalent_exactly_when_the_90_percent_interval_is_inside_the_margin():
    d = [0.01, -0.02, 0.015, 0.0, 0.005, -0.01, 0.02, -0.005] * 4
    _, lo, hi = stats.t_interval(d, 0.90)
    inside = stats.tost(d, margin=max(abs(lo), abs(hi)) * 1.01)
    outside = stats.tost(d, margin=max(abs(lo), abs(hi)) * 0.99)
    assert inside["equivalent"] and not outside["equivalent"]
    assert inside["p"] < 0.05 < outside["p"]


def test_holm_adjusts_step_down_and_keeps_order():
    # by hand: sorted 0.01, 0.02, 0.04, 0.30 -> x4, x3, x2, x1 = 0.04, 0.06, 0.08, 0.30 (monotone)
    assert stats.holm([0.04, 0.01, 0.30, 0.02]) == pytest.approx([0.08, 0.04, 0.30, 0.06])
    assert stats.holm([0.5, 0.01]) == pytest.approx([0.5, 0.02])
    # 0.03 x 3 = 0.09, 0.04 x 2 = 0.08 lifted to the running maximum 0.09, 0.2 x 1
    assert stats.holm([0.03, 0.04, 0.2]) == pytest.approx([0.09, 0.09, 0.2])
    assert stats.holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])  # capped at 1


def test_too_few_differences_are_refused():
    with pytest.raises(ValueError, match="at least 2"):
        stats.t_interval([0.1])


def _runs(fingerprints: dict[tuple[str, int], object]) -> list[dict]:
    """Held-out runs of two arms on seeds 10-12 (a 0.1 above b on each), with ``fingerprints`` where given."""
    out = []
    for loss, final in (("a", 0.6), ("b", 0.5)):
        for seed in (10, 11, 12):
            r = {"task": "t", "cell": "c", "loss": loss, "band": "x", "seed": seed, "final_reward": final + seed / 1e3}
            if (loss, seed) in fingerprints:
                r[stats.FINGERPRINT] = fingerprints[(loss, seed)]
            out.append(r)
    return out


def test_runs_of_one_warm_model_pair_and_runs_without_a_fingerprint_pair_as_before():
    # committed tables have no fingerprint column; an empty or NaN cell is a run that recorded none
    for fingerprints in ({}, {("a", 11): "0123456789ab", ("b", 11): "0123456789ab"}, {("a", 10): "", ("b", 10): "f"}):
        held = stats.held(_runs(fingerprints), tune=10)
        assert sorted(stats.pairs(held, "t", "c", ("a", "x"), ("b", "x"))) == [10, 11, 12]
        assert stats.paired(held, "t", "c", ("a", "x"), ("b", "x"))["diff"] == pytest.approx(0.1)
    held = stats.held(_runs({("a", 12): math.nan, ("b", 12): "0123456789ab"}), tune=10)
    assert len(stats.pairs(held, "t", "c", ("a", "x"), ("b", "x"))) == 3


def test_runs_of_two_warm_models_are_refused_naming_both():
    held = stats.held(_runs({("a", 11): "0123456789ab", ("b", 11): "0123456789ac"}), tune=10)
    for pair in (stats.pairs, stats.paired):
        with pytest.raises(ValueError, match="different warm models") as e:
            pair(held, "t", "c", ("a", "x"), ("b", "x"))
        said = str(e.value)
        assert "t c a band x seed 11 (fingerprint 0123456789ab)" in said
        assert "t c b band x seed 11 (fingerprint 0123456789ac)" in said


def test_contrast_pairs_the_seeds_every_term_has():
    """(sign, value per seed) terms: seeds 0 and 1 are in both, so d = [1 - 0.5, 2 - 1] = [0.5, 1]; mean 0.75, se
    0.25 with 1 degree of freedom (t quantile 12.706), exact sign-flip p = 2 of the 4 sign vectors = 0.5."""
    n, mean, low, high, p = stats.contrast([(1, {0: 1.0, 1: 2.0, 2: 4.0}), (-1, {0: 0.5, 1: 1.0, 3: 9.0})])
    assert (n, p) == (2, 0.5) and mean == pytest.approx(0.75)
    assert (low, high) == pytest.approx((0.75 - 12.7062 * 0.25, 0.75 + 12.7062 * 0.25), abs=1e-3)
    assert stats.contrast([])[0] == 0 and math.isnan(stats.contrast([])[4])
