"""The SmolLM2 study's pieces on a tiny random Llama: its per-token gradient factors of the last MLP give
autograd's gradient of any per-token weighting, its log-probs are a plain forward's, its band calibration
reaches the target clip fraction."""

import pytest
import torch

from maspo_verl.lab.studies import smollm2 as study
from tests.lab.conftest import plain_log_probs, tiny_llama

MASKED = [0, 2]


@pytest.fixture(scope="module")
def tiny():
    model = tiny_llama()
    ids = torch.randint(3, 40, (5, 7))
    attn = torch.ones_like(ids)
    attn[1, :2] = 0  # a left-padded prompt
    resp = torch.randint(3, 40, (5, 6))
    return model, ids, attn, resp


def _plain_log_probs(model, ids, attn, resp):
    return plain_log_probs(model, ids, attn, resp, MASKED)


def test_log_probs_and_mlp_gradient_equal_autograd(tiny):
    model, ids, attn, resp = tiny
    lp, parts = study.log_probs(model, ids, attn, resp, MASKED, chunk=2, parts=True)
    mlp = model.model.layers[-1].mlp
    params = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    c = torch.randn_like(lp)
    for p in params:
        p.requires_grad_(True)
    try:
        plain = _plain_log_probs(model, ids, attn, resp)
        want = torch.cat([g.flatten() for g in torch.autograd.grad((c * plain).sum(), params)])
    finally:
        for p in params:
            p.requires_grad_(False)
    torch.testing.assert_close(lp, plain.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(study.mlp_grad(parts, c), want, rtol=1e-4, atol=1e-6)
    # rows select: the gradient of a subset is the subset's parts
    rows = torch.tensor([0, 3])
    sub = study.mlp_grad({k: v[rows] for k, v in parts.items()}, c[rows])
    c_masked = torch.zeros_like(c)
    c_masked[rows] = c[rows]
    torch.testing.assert_close(sub, study.mlp_grad(parts, c_masked), rtol=1e-5, atol=1e-7)


def test_calibrated_band_reaches_the_clip_fraction():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from maspo_verl.lab.engine.presets import discover_presets

    torch.manual_seed(1)
    old = torch.randn(8, 64) * 0.5 - 2
    lp = old + 0.05 * torch.randn(8, 64)
    adv = torch.randn(8, 1).expand(8, 64).contiguous()
    resp = torch.randint(3, 40, (8, 64))
    for preset in discover_presets(["grpo", "maspo_fixed"]):
        fn = get_policy_loss_fn(preset.loss_mode)
        scale, at_scale = study.calibrate(fn, preset, old, lp, adv, resp, target=0.1)
        frac = at_scale["actor/pg_clipfrac"]
        assert abs(frac - 0.1) < 0.02, (preset.name, scale, frac)
        _, metrics = study.loss_weights(fn, study.scaled(preset, scale * 4), old, lp, adv, resp)
        assert metrics["actor/pg_clipfrac"] < frac  # a wider band clips less


def test_on_policy_loss_weights_are_the_advantages_token_mean():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from maspo_verl.lab.engine.presets import discover_presets

    grpo = discover_presets(["grpo"])[0]
    lp = torch.randn(4, 10)
    adv = torch.randn(4, 10)
    c, _ = study.loss_weights(
        get_policy_loss_fn(grpo.loss_mode), study.scaled(grpo, 1.0), lp, lp, adv, torch.zeros(4, 10, dtype=torch.long)
    )
    torch.testing.assert_close(c, -adv / adv.numel())
