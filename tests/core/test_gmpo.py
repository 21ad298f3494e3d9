"""surrogate=gmpo (docs/algorithms.md §2, GMPO) in float64: verl's ``geo_mean`` at its limit (one set per response,
per-token clip), the plain GMPO objective written with autograd at segment granularity, and PPO's clip at one
token per set."""

from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn

from tests.helpers import actor_config, random_batch

# verl's geo_mean divides by (token count + 1e-8); a 0/1 mask scaled by 2**27 (exact in float64) makes that guard
# 7e-17 tokens, below float64's resolution of the count, so the comparison sees the formula itself
MASK_SCALE = 2.0**27
CLIPS = {"clip_low": 0.15, "clip_high": 0.25}  # verl's clip_ratio_low/high: geo_mean's log-space band


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def need_geo_mean():
    if "geo_mean" not in POLICY_LOSS_REGISTRY:
        pytest.skip("the installed verl has no 'geo_mean' policy loss")


def verl_geo_mean(old, new, adv, mask, scale=MASK_SCALE):
    config = actor_config(**CLIPS, loss_mode="vanilla")
    loss, metrics = get_policy_loss_fn("geo_mean")(old, new, adv, mask.double() * scale, "token-mean", config)
    return loss, metrics


@pytest.mark.parametrize("scale", [0.05, 0.6])
@pytest.mark.parametrize("fields", [{"loss_mode": "pgspo"}, {"segment_rule": "fixed", "segment_window": 64}])
def test_one_set_per_response_is_verl_geo_mean(scale, fields):
    """pgspo (alpha 1) or a window longer than every row, surrogate=gmpo, ratio schedule, seq-mean-token-mean:
    verl's geo_mean, loss and gradient within 1e-12; its clip fractions are the tokens clipped on the side the
    advantage's sign picks."""
    need_geo_mean()
    old, new, adv, mask = random_batch(B=8, T=24, scale=scale, seed=21)
    ours_cfg = actor_config(**CLIPS, surrogate="gmpo", **fields)
    ours, metrics = get_policy_loss_fn(ours_cfg.policy_loss.loss_mode)(
        old, new, adv, mask, "seq-mean-token-mean", ours_cfg
    )
    verl, _ = verl_geo_mean(old, new, adv, mask)
    assert max_diff(ours, verl) <= 1e-12
    ours_grad, verl_grad = (torch.autograd.grad(loss, new)[0] for loss in (ours, verl))
    assert max_diff(ours_grad, verl_grad) <= 1e-12
    assert ours_grad.abs().sum() > 0
    # with verl's own 0/1 mask the guard moves the loss by about 1e-8 / L relative, nothing more
    plain, _ = verl_geo_mean(old, new, adv, mask, scale=1.0)
    assert max_diff(ours, plain) <= 1e-8 * ours.abs().item()
    delta = (new - old).detach()
    high = (adv > 0) & (delta > CLIPS["clip_high"]) & mask
    low = (adv < 0) & (delta < -CLIPS["clip_low"]) & mask
    assert metrics["actor/ratio/clipfrac_high"] == pytest.approx(high.sum().item() / mask.sum().item(), abs=1e-12)
    assert metrics["actor/ratio/clipfrac_low"] == pytest.approx(low.sum().item() / mask.sum().item(), abs=1e-12)
    if scale > 0.5:
        assert high.any() and low.any()  # both sides bind: the masks were exercised


def test_per_token_advantages_of_one_sign_keep_verls_value():
    """Per-token advantages of one sign per response (span credit): each token weighs the set's ratio by its own A_t
    (as GSPO-token does), so the loss still equals verl's geo_mean (its mean advantage times the ratio); the
    gradients differ by design. With both signs in one set PPO's band after sharing can bind (docs: §2)."""
    need_geo_mean()
    old, new, adv, mask = random_batch(B=6, T=20, scale=0.4, seed=22, per_token=True)
    adv = adv[:, :1].sign() * adv.abs()
    cfg = actor_config(**CLIPS, surrogate="gmpo", loss_mode="pgspo")
    ours, _ = get_policy_loss_fn("pgspo")(old, new, adv, mask, "seq-mean-token-mean", cfg)
    verl, _ = verl_geo_mean(old, new, adv, mask)
    assert max_diff(ours, verl) <= 1e-12
    assert (adv * mask).std(-1).min() > 0  # the advantages do vary within each response


def plain_gmpo(old, new, adv, mask, window, low, high):
    """The GMPO objective per window of ``window`` valid tokens, written out with autograd (no stop-gradient
    form): -A exp(mean over the window of the sign-clipped log-ratios), mean over each row's windows, mean over
    rows; one advantage per row."""
    total = 0.0
    for i in range(mask.shape[0]):
        positions = mask[i].nonzero().flatten().tolist()
        a = adv[i, positions[0]]
        windows = [positions[k : k + window] for k in range(0, len(positions), window)]
        row = 0.0
        for members in windows:
            d = new[i, members] - old[i, members]
            clipped = d.clamp(max=high) if a > 0 else d.clamp(min=-low)
            row = row - a * torch.exp(clipped.mean())
        total = total + row / len(windows)
    return total / mask.shape[0]


@pytest.mark.parametrize("window", [1, 3, 7])
def test_segments_are_the_plain_objective_under_autograd(window):
    """maspo fixed windows with surrogate=gmpo and agg_mode=seg-mean-token-mean, log_adaptive band: the mean over
    segments of -A exp(mean of the clipped log-ratios), gradient against float64 autograd of that formula."""
    old, new, adv, mask = random_batch(B=5, T=19, scale=0.5, seed=23)
    band = {"log_clip_low": 0.1, "log_clip_high": 0.3, "log_clip_dual": 5.0}  # dual clip at e^5: out of reach
    cfg = actor_config(
        surrogate="gmpo", segment_window=window, agg_mode="seg-mean-token-mean", clip_schedule="log_adaptive", **band
    )
    ours, _ = get_policy_loss_fn("maspo")(old, new, adv, mask, "seq-mean-token-mean", cfg)
    ref = plain_gmpo(old, new, adv, mask, window, band["log_clip_low"], band["log_clip_high"])
    assert max_diff(ours, ref) <= 1e-12
    grads = [torch.autograd.grad(loss, new)[0] for loss in (ours, ref)]
    assert max_diff(*grads) <= 1e-12
    assert (grads[0] == 0).logical_and(mask).any()  # some clipped tokens lost their gradient


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_one_token_per_set_is_ppo(agg):
    """At W = 1 the geometric mean is the token's own clipped ratio: gmpo equals PPO's clip on the same log-space
    band (exp(-eps_low), exp(eps_high)) and dual constant, loss and gradient."""
    old, new, adv, mask = random_batch(B=6, T=16, scale=1.5, seed=24, per_token=True)
    band = {"clip_schedule": "log_adaptive", "log_clip_low": 0.2, "log_clip_high": 0.28, "log_clip_dual": 1.0}
    losses = []
    for surrogate in ("gmpo", "ppo"):
        cfg = actor_config(surrogate=surrogate, segment_window=1, **band)
        losses.append(get_policy_loss_fn("maspo")(old, new, adv, mask, agg, cfg)[0])
    assert max_diff(*losses) <= 1e-12
    assert max_diff(*(torch.autograd.grad(loss, new)[0] for loss in losses)) <= 1e-12
    assert ((adv < 0) & ((new - old) > 1.0) & mask).any()  # the dual clip bound somewhere
