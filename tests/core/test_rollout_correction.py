"""Rollout correction per segment (``maspo_verl.rollout_correction``) against verl's own functions in float64:
one token a segment is ``rollout_is=token`` (and the ``seg_*`` options verl's ``token_*``), one segment a
response is ``rollout_is=sequence`` (``seq_*``), for the TIS cap and the IcePop band; per-turn weights by hand;
data-parallel invariance; the refusals; the hook inside verl's ``compute_rollout_correction_and_add_to_batch``."""

from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo import rollout_corr_helper as verl_rc

import maspo_verl.plugin  # noqa: F401  (installs the hook)
from maspo_verl.rollout_correction import (
    SEGMENT_RS_OPTIONS,
    CorrectionSettings,
    correction_rules,
    segment_correction,
)
from maspo_verl.validation import FieldError

VERL_RS = verl_rc.SUPPORTED_ROLLOUT_RS_OPTIONS
THRESHOLDS = [2.0, 1.3, "0.5_2.0", "0.8_1.2"]  # TIS caps and IcePop bands that bite at this scale


def batch(seed=0, B=7, T=16, scale=0.4, holes=True):
    """float64 trainer and rollout log-probs, and a mask with padding and (``holes``) masked environment
    tokens inside rows."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    rollout = old + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    if holes:
        mask[0, 3:6] = 0
        mask[2, 1:2] = 0
        mask[3, 5:9] = 0
    mask[4] = 0
    mask[4, :1] = 1  # a response of one token
    return old, rollout, mask


def settings(**section):
    return CorrectionSettings.from_mapping(section, VERL_RS)


def token_per_segment(**section):
    return settings(rollout_segment_rule="fixed", rollout_segment={"segment_window": 1}, **section)


def one_segment(**section):
    return settings(rollout_segment_rule="fixed", rollout_segment={"segment_window": 10_000}, **section)


def verl_weights(old, rollout, mask, level, threshold):
    w, _ = verl_rc.compute_rollout_correction_weights(
        old - rollout, mask, rollout_is=level, rollout_is_threshold=threshold
    )
    return w


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_one_token_a_segment_is_verl_token_level(seed, threshold):
    old, rollout, mask = batch(seed)
    ours = segment_correction(
        old, rollout, mask, token_per_segment(rollout_is="segment", rollout_is_threshold=threshold)
    )
    expected = verl_weights(old, rollout, mask, "token", threshold)
    assert torch.equal(ours.weights, expected)
    assert 0 < (expected[mask.bool()] != torch.exp((old - rollout)[mask.bool()])).sum()  # the cap/band bites


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("holes", [False, True])
def test_one_segment_a_response_is_verl_sequence_level(seed, threshold, holes):
    old, rollout, mask = batch(seed, holes=holes, scale=0.12)  # (verl's ESS divides by 0 if the band drops all)
    config = one_segment(rollout_is="segment", rollout_is_threshold=threshold)
    ours = segment_correction(old, rollout, mask, config)
    expected = verl_weights(old, rollout, mask, "sequence", threshold)
    torch.testing.assert_close(ours.weights, expected, rtol=1e-12, atol=1e-14)
    if not holes:  # without holes, `turns` has one segment a response too
        turns = segment_correction(old, rollout, mask, settings(rollout_is="segment", rollout_is_threshold=threshold))
        torch.testing.assert_close(turns.weights, expected, rtol=1e-12, atol=1e-14)


def _options(level: str):
    """(our seg_* option, verl's option at ``level`` with the same criterion) pairs."""
    for ours in SEGMENT_RS_OPTIONS:
        _, how, k = ours.split("_")
        theirs = f"token_{k}" if level == "token" else f"seq_{how}_{k}"
        if theirs in VERL_RS:
            yield ours, theirs


RS_THRESHOLDS = {"k1": "0.6_1.6", "k2": "0.05", "k3": "0.04"}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed", range(3))
def test_segment_rejection_limits_are_verl_options(level, seed):
    old, rollout, mask = batch(seed, scale=0.3)
    make = token_per_segment if level == "token" else one_segment
    seen = set()
    for ours, theirs in _options(level):
        seen.add(theirs)  # at one token a segment, sum, mean and max are each verl's token option
        threshold = RS_THRESHOLDS[ours[-2:]]
        result = segment_correction(old, rollout, mask, make(rollout_rs=ours, rollout_rs_threshold=threshold))
        expected, _ = verl_rc.compute_rollout_rejection_mask(old - rollout, mask, theirs, threshold)
        assert torch.equal(result.keep * mask, expected), (ours, theirs)
    assert seen


def test_rejection_masks_one_turn_and_keeps_the_others():
    """Three turns; the middle one far off: seg_mean_k3 masks it alone, verl's seq_mean_k3 the whole response."""
    T = 14
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0]], dtype=torch.float64)
    old = torch.full((1, T), -1.0, dtype=torch.float64)
    rollout = old.clone()
    rollout[0, 5:8] = old[0, 5:8] + 1.5  # the second turn: ratio e^-1.5 per token
    result = segment_correction(old, rollout, mask, settings(rollout_rs="seg_mean_k3", rollout_rs_threshold=0.1))
    assert (result.keep * mask).tolist() == [[1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0]]
    assert result.metrics["rollout_rs_segment_rejected_fraction"].item() == pytest.approx(1 / 3)
    whole, _ = verl_rc.compute_rollout_rejection_mask(old - rollout, mask, "seq_mean_k3", 0.1)
    assert whole.sum() == 0


def test_turn_weights_by_hand():
    """One weight per turn, the product of its token ratios, capped per turn; metrics over turns."""
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 1], [1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.float64)
    delta = torch.tensor(
        [[0.1, 0.2, 9.0, -0.3, 0.1, 0.1, 9.0, 1.0], [0.05, 0.05, 0.05, 0.05, 0, 0, 0, 0]], dtype=torch.float64
    )
    rollout = torch.full_like(delta, -2.0)
    old = rollout + delta
    result = segment_correction(old, rollout, mask, settings(rollout_is="segment", rollout_is_threshold=2.0))
    raw = [[0.3, -0.1, 1.0], [0.2]]
    w = [[min(torch.exp(torch.tensor(x)).item(), 2.0) for x in row] for row in raw]
    expected = [[w[0][0]] * 2 + [0] + [w[0][1]] * 3 + [0] + [w[0][2]], [w[1][0]] * 4 + [0] * 4]
    torch.testing.assert_close(result.weights, torch.tensor(expected, dtype=torch.float64))
    m = {k: v.item() for k, v in result.metrics.items()}
    assert m["segments_per_response"] == 2.0
    flat_raw = [torch.exp(torch.tensor(x)).item() for x in (0.3, -0.1, 1.0, 0.2)]
    flat = [min(x, 2.0) for x in flat_raw]
    assert m["rollout_is_segment_raw_max"] == pytest.approx(max(flat_raw)) and m["rollout_is_segment_max"] == 2.0
    assert m["rollout_is_segment_mean"] == pytest.approx(sum(flat) / 4)
    assert m["rollout_is_segment_ess"] == pytest.approx(sum(flat) ** 2 / (4 * sum(x * x for x in flat)))
    assert m["rollout_is_segment_raw_ess"] == pytest.approx(sum(flat_raw) ** 2 / (4 * sum(x * x for x in flat_raw)))
    assert m["rollout_is_segment_capped_fraction"] == 0.25


@pytest.mark.parametrize(
    "section",
    [
        dict(
            rollout_is="segment",
            rollout_is_threshold="0.5_2.0",
            rollout_rs="seg_sum_k1,token_k3",
            rollout_rs_threshold="0.5_2.0,0.05",
        ),
        dict(
            rollout_is="segment",
            rollout_is_threshold=1.5,
            rollout_rs="seg_max_k2",
            rollout_rs_threshold=0.1,
            rollout_segment={"turn_window": 3},
        ),
    ],
)
def test_data_parallel_invariance(section):
    """Weights and masks are per sample: any split of the batch, and any order, gives the same rows."""
    old, rollout, mask = batch(1, B=8)
    config = settings(**section)
    whole = segment_correction(old, rollout, mask, config)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    parts = [segment_correction(old[p], rollout[p], mask[p], config) for p in perm.split(3)]
    weights = torch.cat([p.weights for p in parts])
    keep = torch.cat([p.keep * mask[idx] for p, idx in zip(parts, perm.split(3), strict=True)])
    assert torch.equal(weights, whole.weights[perm]) and torch.equal(keep, (whole.keep * mask)[perm])
    # a planted batch statistic breaks it
    normalised = settings(**section, rollout_is_batch_normalize=True)
    assert not torch.equal(
        segment_correction(old[:3], rollout[:3], mask[:3], normalised).weights,
        segment_correction(old, rollout, mask, normalised).weights[:3],
    )


@pytest.mark.parametrize(
    ("section", "field", "allowed"),
    [
        (dict(rollout_is="turn"), "rollout_is", "null, token, sequence, segment"),
        (dict(rollout_is="segment", rollout_segment_rule="words"), "rollout_segment_rule", "one of"),
        (dict(rollout_is="segment", rollout_segment={"turn_windw": 2}), "rollout_segment", "turn_window"),
        (dict(rollout_is="segment", rollout_segment={"turn_window": -1}), "rollout_segment.turn_window", ">= 0"),
        (dict(rollout_rs="seg_avg_k1", rollout_rs_threshold=2.0), "rollout_rs", "seg_mean_k1"),
        (dict(rollout_rs="seg_mean_k3", rollout_rs_threshold="0.1_0.2"), "rollout_rs_threshold", "one positive upper"),
        (dict(rollout_rs="seg_mean_k3,seg_sum_k1", rollout_rs_threshold="1,2,3"), "rollout_rs_threshold", "one per"),
        (dict(rollout_is="segment", rollout_is_threshold="3_2"), "rollout_is_threshold", "IcePop"),
    ],
)
def test_bad_values_are_refused_naming_field_and_allowed(section, field, allowed):
    with pytest.raises(FieldError, match=rf"algorithm.rollout_correction.{field}") as info:
        settings(**section)
    assert allowed in str(info.value)


def test_correction_rules_are_those_reading_mask_and_log_probs():
    rules = correction_rules()
    assert {"turns", "fixed", "logprob"} <= set(rules) and "words" not in rules and "tokenval" not in rules


def test_hook_in_verl_add_to_batch():
    """verl's own entry point: verl's options go to verl, ours to us; the masks multiply; the weights land
    where verl puts its own; a config without our options is verl's untouched."""
    from verl.protocol import DataProto

    old, rollout, mask = batch(2, scale=0.3)

    def run(**section):
        data = DataProto.from_dict(
            tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask.clone()}
        )
        return verl_rc.compute_rollout_correction_and_add_to_batch(data, dict(section))

    plain, plain_metrics = run(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6"
    )
    w, m, verl_metrics = verl_rc.compute_rollout_correction_and_rejection_mask(
        old,
        rollout,
        mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k1",
        rollout_rs_threshold="0.6_1.6",
    )
    assert torch.equal(plain.batch["rollout_is_weights"], w.batch["rollout_is_weights"])
    assert plain_metrics == verl_metrics
    out, metrics = run(
        rollout_is="segment",
        rollout_is_threshold=2.0,
        rollout_rs="token_k1,seg_mean_k3",
        rollout_rs_threshold="0.6_1.6,0.04",
        rollout_segment_rule="turns",
        rollout_segment={},
    )
    direct = segment_correction(
        old, rollout, mask, settings(rollout_is="segment", rollout_rs="seg_mean_k3", rollout_rs_threshold=0.04)
    )
    assert torch.equal(out.batch["rollout_is_weights"], direct.weights)
    assert torch.equal(out.batch["response_mask"], plain.batch["response_mask"] * direct.keep)
    for key in (
        "rollout_corr/rollout_is_segment_raw_ess",
        "rollout_corr/rollout_is_segment_ess",
        "rollout_corr/segments_per_response",
        "rollout_corr/rollout_rs_segment_rejected_fraction",
        "rollout_corr/rollout_rs_token_k1_masked_fraction",
        "rollout_corr/kl",
        "rollout_corr/rollout_is_mean",
    ):
        assert isinstance(metrics[key], float), key
