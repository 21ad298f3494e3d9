"""verl's own losses (``vanilla``, ``gspo``: grpo's and gspo's) report the ratio correlation as ours do: the
wrapper's ``actor/ratio/*`` on planted AR(1) log-ratios against the closed form, and verl's own metrics kept."""

from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn

import maspo_verl.plugin  # noqa: F401  (registers our losses, wraps verl's)
from tests.core.test_correlation import ar1, ar1_vif
from tests.helpers import actor_config


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
@pytest.mark.parametrize("rho", [0.0, 0.6])
def test_verl_losses_report_the_planted_correlation(name, rho):
    B, T = 32, 1500
    old = torch.full((B, T), -2.0, dtype=torch.float64)
    new = old + 0.05 * ar1(rho, B, T, seed=5)
    mask = torch.ones(B, T)
    mask[:, -100:] = 0  # padding: outside the loss, whatever its values
    new[:, -100:] = 7.0
    adv = torch.randn(B, T, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    cfg = actor_config(loss_mode=name)
    _, metrics = get_policy_loss_fn(name)(old, new, adv, mask, cfg.loss_agg_mode, cfg, None)
    assert "actor/pg_clipfrac" in metrics  # verl's own metrics stay
    assert metrics["actor/ratio/corr_lag1"] == pytest.approx(rho, abs=0.03)
    for n in (5, 15, 50):
        assert metrics[f"actor/ratio/vif{n}"] == pytest.approx(ar1_vif(rho, n), rel=0.12), n
