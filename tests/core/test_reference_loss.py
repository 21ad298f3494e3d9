"""The production loss (``maspo_verl.core.losses``) against the plain reference
(``maspo_verl.core.reference_loss``) in float64:
the same loss and the same gradient for every discovered preset of our token sets and every discovered segment
rule, with every surrogate (and each clip schedule it accepts), every aggregation mode, optional rollout
weights, right/left padding and holes, and non-finite log-probs at some valid tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from maspo_verl.batch import WORD_IDS_KEY, micro_batch_scope
from maspo_verl.config import actor_config
from maspo_verl.core.reference_loss import reference_loss
from maspo_verl.core.segments import SEGMENT_RULES
from maspo_verl.core.surrogates import SURROGATES, switch_fields
from maspo_verl.core.token_sets import TOKEN_SETS, segment_rules
from maspo_verl.util import preset_names
from tests.helpers import BYTE_VOCABULARY, VERL_AGG, preset_fields, random_mask

SCHEDULES = ("ratio", "log_adaptive")


def cases() -> dict[str, tuple[dict, dict]]:
    """Every preset of one of our losses, and every rule on ``maspo_fixed``'s other settings."""
    out = {}
    for preset in preset_names():
        clips, policy_loss = preset_fields(preset)
        if policy_loss["loss_mode"] in TOKEN_SETS:
            out[preset] = (clips, policy_loss)
    clips, base = preset_fields("maspo_fixed")
    for rule in SEGMENT_RULES:
        out[f"rule={rule}"] = (clips, {**base, "segment_rule": rule, "min_segment_len": 2})
    return out


CASES = cases()


def make_config(clips, policy_loss, surrogate, schedule, agg):
    fields = switch_fields({**policy_loss, "clip_schedule": schedule}, surrogate)
    if agg == "seg-mean-token-mean":
        fields["agg_mode"] = agg
    if any(rule.reads_codec for rule in segment_rules(fields)):  # codes 0..255: random ids often in range
        fields.update(codec_offset=0, codec_size=256, fsq_levels=[4, 4, 4, 4])
    return actor_config(**clips, **fields)


@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 4),
    T=st.integers(1, 24),
    layout=st.sampled_from(["right", "left", "holes"]),
    drift=st.sampled_from([0.0, 0.05, 0.3, 3.0, 50.0]),
    weighted=st.booleans(),
    bad=st.booleans(),
    agg=st.sampled_from([*VERL_AGG, "seg-mean-token-mean"]),
    surrogate=st.sampled_from(tuple(SURROGATES)),
    schedule=st.sampled_from(SCHEDULES),
)
def test_production_equals_reference(case, seed, B, T, layout, drift, weighted, bad, agg, surrogate, schedule):
    clips, policy_loss = CASES[case]
    accepted = SURROGATES[surrogate].clip_schedules
    if accepted is not None and schedule not in accepted:
        schedule = accepted[0]
    if agg == "seg-mean-token-mean" and not TOKEN_SETS[policy_loss["loss_mode"]].partition:
        agg = "token-mean"
    actor = make_config(clips, policy_loss, surrogate, schedule, agg)

    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    mask = random_mask(B, T, layout, g)
    old = -torch.rand(B, T, **f64) * 5
    new = old + drift * torch.randn(B, T, **f64)
    if bad:  # non-finite log-probs at some valid tokens: dropped by both
        pos = torch.arange(T)[None, :]
        hit = mask & (torch.rand(B, T, generator=g) < 0.15)
        new = torch.where(hit & (pos % 2 == 0), float("nan"), new)
        old = torch.where(hit & (pos % 2 == 1), -float("inf"), old)
    adv = (torch.randn(B, 1, **f64) * 3).expand(B, T) + torch.randn(B, T, **f64) * 0.5
    weights = torch.rand(B, T, **f64) * 2 if weighted else None
    ids = torch.randint(0, 300, (B, T), generator=g)
    words = torch.randint(-1, 4, (B, T), generator=g).sort(-1).values
    words[torch.rand(B, generator=g) < 0.3] = -1  # rows without words take the fallback rule
    loss_agg = "seq-mean-token-mean" if agg == "seg-mean-token-mean" else agg

    def loss_and_grad(fn):
        lp = new.clone().requires_grad_()
        with micro_batch_scope({"responses": ids, WORD_IDS_KEY: words}, BYTE_VOCABULARY):
            loss = fn(old, lp, adv, mask, loss_agg, actor, weights)
        loss = loss[0] if isinstance(loss, tuple) else loss
        (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
        return loss.detach(), torch.zeros_like(lp) if grad is None else grad

    got_loss, got_grad = loss_and_grad(get_policy_loss_fn(actor.policy_loss.loss_mode))
    want_loss, want_grad = loss_and_grad(reference_loss)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
