"""Property-based fuzzing of our loss presets, every surrogate and every aggregation mode (3,000 cases per
run; 10,500 with ``pytest --run-slow``).

(verl's own `grpo`/`gspo` presets are not fuzzed: padding with NaN advantages poisons verl's loss by
design, which is what ours must not do.)

Each case: a surrogate of ``SURROGATES`` on the preset's token set (with a clip schedule it accepts),
B 1-8, T 1-300, right/left-padded or holey masks, log-ratio drift up to +-100, fp64/fp32/bf16/fp16 inputs,
optional importance weights, token ids in and out of the codec range, and non-finite log-probs at some
valid tokens. Asserted:

- no exception;
- the loss and the gradient are finite (inputs at the kept tokens are finite and |A| <= 1e3);
- padded positions have no effect: filling them with NaN, +-inf or huge values gives the same loss
  and gradient as filling them with zeros, and their gradient is zero;
- ``actor/ratio/nonfinite_tokens`` counts exactly the valid tokens with a non-finite log-prob, and
  those tokens have no effect either (same loss as with them masked out).
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from maspo_verl.batch import micro_batch_scope
from maspo_verl.config import actor_config
from maspo_verl.core.surrogates import SURROGATES, switch_fields
from maspo_verl.core.token_sets import TOKEN_SETS, segment_rules
from maspo_verl.util import preset_names
from tests.helpers import BYTE_VOCABULARY, VERL_AGG, compose_config, preset_fields, random_mask


def our_presets() -> list[str]:
    """Every shipped preset of one of our losses (verl's own, grpo and gspo, are verl's to test)."""
    loss_mode = {p: compose_config(f"loss={p}").actor_rollout_ref.actor.policy_loss.loss_mode for p in preset_names()}
    return [p for p, mode in loss_mode.items() if mode in TOKEN_SETS]


PRESETS = our_presets()
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# cases in all, shared by the presets (``tests/conftest.py`` sets MASPO_RUN_SLOW for --run-slow)
CASES = 10_500 if os.environ.get("MASPO_RUN_SLOW") == "1" else 3_000
EXAMPLES_PER_PRESET = int(os.environ.get("MASPO_FUZZ_EXAMPLES", CASES // len(PRESETS)))


def preset_config(preset: str, agg: str, surrogate: str):
    clips, policy_loss = preset_fields(preset)
    policy_loss = switch_fields(policy_loss, surrogate)
    if agg == "seg-mean-token-mean":
        policy_loss["agg_mode"] = agg
    if any(rule.reads_codec for rule in segment_rules(policy_loss)):  # codes 0..255: random ids often in range
        policy_loss.update(codec_offset=0, codec_size=256, fsq_levels=[4, 4, 4, 4])
    return actor_config(**clips, **policy_loss)


CONFIGS = {}


def config_for(preset, agg, surrogate):
    if (preset, agg, surrogate) not in CONFIGS:
        CONFIGS[preset, agg, surrogate] = preset_config(preset, agg, surrogate)
    return CONFIGS[preset, agg, surrogate]


def make_case(seed, B, T, layout, dtype, drift, weighted, bad_frac):
    g = torch.Generator().manual_seed(seed)
    mask = random_mask(B, T, layout, g)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 5
    new = old + drift * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64) * torch.rand(1, generator=g).item() * 1e3
    adv = adv.expand(B, T) + torch.randn(B, T, generator=g, dtype=torch.float64) * (torch.rand(1, generator=g) < 0.3)
    adv = adv.clamp(-1e3, 1e3)
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) * 3 if weighted else None
    ids = torch.randint(-50, 400, (B, T), generator=g)  # in and out of the codec range 0..255
    bad = mask & (torch.rand(B, T, generator=g) < bad_frac)  # valid tokens with a non-finite log-prob
    kinds = torch.randint(0, 3, (B, T), generator=g)
    garbage = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=torch.float64)[kinds]
    return mask, old, new, adv, weights, ids, bad, garbage


def call(preset, agg, surrogate, mask, old, new, adv, weights, ids, dtype):
    config = config_for(preset, agg, surrogate)
    lp = new.to(dtype).requires_grad_()
    loss_agg = "seq-mean-token-mean" if agg == "seg-mean-token-mean" else agg
    with micro_batch_scope({"responses": ids}, BYTE_VOCABULARY):  # ids -50..399: bytes and beyond
        loss, metrics = get_policy_loss_fn(config.policy_loss.loss_mode)(
            old.to(dtype), lp, adv.to(dtype), mask, loss_agg, config, None if weights is None else weights.to(dtype)
        )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach().double(), grad.double(), metrics


def fill(x, where, value):
    return None if x is None else torch.where(where, value.to(x.dtype) if torch.is_tensor(value) else value, x)


@pytest.mark.parametrize("preset", PRESETS)
@settings(
    max_examples=EXAMPLES_PER_PRESET, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 8),
    T=st.integers(1, 300),
    layout=st.sampled_from(["right", "left", "holes"]),
    dtype=st.sampled_from(DTYPES),
    drift=st.sampled_from([0.0, 0.01, 0.3, 3.0, 100.0]),
    weighted=st.booleans(),
    bad_frac=st.sampled_from([0.0, 0.0, 0.05]),
    agg=st.sampled_from([*VERL_AGG, "seg-mean-token-mean"]),
    surrogate=st.sampled_from(tuple(SURROGATES)),
)
def test_fuzz(preset, seed, B, T, layout, dtype, drift, weighted, bad_frac, agg, surrogate):
    if agg == "seg-mean-token-mean" and preset == "ctpo":
        agg = "token-mean"  # segment aggregation needs our partition token sets
    mask, old, new, adv, weights, ids, bad, garbage = make_case(seed, B, T, layout, dtype, drift, weighted, bad_frac)
    pad = ~mask
    bad_new = bad & (torch.arange(T) % 2 == 0)  # a non-finite new log-prob, else a non-finite old one

    # reference: zeros in the padding
    ref = call(
        preset,
        agg,
        surrogate,
        mask,
        fill(old, pad, 0.0),
        fill(new, pad, 0.0),
        fill(adv, pad, 0.0),
        fill(weights, pad, 0.0),
        ids.masked_fill(pad, 0),
        dtype,
    )
    # the same batch with NaN / +-inf / out-of-range ids in the padding, and non-finite log-probs at
    # the ``bad`` valid tokens
    old_g = torch.where(pad | (bad & ~bad_new), garbage, old)
    new_g = torch.where(pad | bad_new, garbage, new)
    got = call(
        preset,
        agg,
        surrogate,
        mask,
        old_g,
        new_g,
        fill(adv, pad, garbage),
        fill(weights, pad, garbage),
        ids.masked_fill(pad, 10**9),
        dtype,
    )

    loss, grad, metrics = got
    assert torch.isfinite(loss), loss
    assert torch.isfinite(grad).all()
    assert metrics["actor/ratio/nonfinite_tokens"] == bad.sum().item()
    assert (grad[pad | bad] == 0).all()
    if not bad.any():  # padding has no effect at all
        assert torch.equal(loss, ref[0]) and torch.equal(grad, ref[1])
