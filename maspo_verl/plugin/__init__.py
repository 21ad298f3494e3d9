"""The ``verl.plugins`` entry point: registers our losses and estimator in verl.

``import verl`` loads this package in the driver and in every Ray worker (``pip install`` declares the
entry point). Importing it registers every token set of ``maspo_verl.core.token_sets`` as a verl policy loss
(``maspo``, ``ctpo``, ``pgspo``), ``maspo_span_grpo`` and ``maspo_turn_grpo`` as advantage estimators, and
installs the hooks of ``maspo_verl.plugin.hooks``, ``rollout_correction`` (segment-level rollout correction)
and ``turn_credit`` (verl's turn scores for the estimator). The start-up checks that run before Ray are in
``maspo_verl.plugin.checks`` (``register_startup_check`` and ``run_startup_checks`` are re-exported
here for recipes).
"""

from __future__ import annotations

import functools
import logging

from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY, register_adv_est

logger = logging.getLogger("maspo_verl")


def _failed_to_load(error: BaseException) -> None:
    """verl logs a failing plugin at debug level only: log it as an error, and make verl's own
    policy-loss config refuse a loss_mode nobody registered, naming this error, so that a run fails
    in the driver's config validation instead of at the first actor update."""
    logger.error(
        "maspo_verl failed to load: its losses are NOT registered in verl (run `python -m maspo_verl check`)",
        exc_info=error,
    )
    from verl.workers.config import PolicyLossConfig

    generated = PolicyLossConfig.__init__

    @functools.wraps(generated)
    def __init__(self, *args, **kwargs):
        generated(self, *args, **kwargs)
        if self.loss_mode not in POLICY_LOSS_REGISTRY:
            raise RuntimeError(
                f"policy_loss.loss_mode={self.loss_mode!r} is not registered in verl (registered: "
                f"{', '.join(sorted(POLICY_LOSS_REGISTRY))}); the maspo_verl plugin failed to load: "
                f"{type(error).__name__}: {error}"
            )

    PolicyLossConfig.__init__ = __init__


# Only core modules that do not import verl at import time: ``import maspo_verl.config`` imports verl,
# whose plugin loader imports this module while ``maspo_verl.config`` is still half-initialised.
try:
    from maspo_verl.advantages import (
        ESTIMATOR_NAMES,
        SPAN_GRPO,
        TURN_GRPO,
        compute_span_grpo_advantage,
        compute_turn_grpo_advantage,
    )
    from maspo_verl.core.losses import verl_loss_fn
    from maspo_verl.core.token_sets import TOKEN_SETS
    from maspo_verl.plugin.checks import register_startup_check, run_startup_checks
    from maspo_verl.plugin.hooks import install_hooks
    from maspo_verl.plugin.rollout_correction import install_rollout_correction_hook, rollout_correction_checks
    from maspo_verl.plugin.turn_credit import install_turn_score_hooks, turn_credit_checks
except Exception as exc:
    _failed_to_load(exc)
    raise

ESTIMATORS = {SPAN_GRPO: compute_span_grpo_advantage, TURN_GRPO: compute_turn_grpo_advantage}
assert tuple(ESTIMATORS) == ESTIMATOR_NAMES

__all__ = ["register", "register_startup_check", "registered", "run_startup_checks"]


def register() -> None:
    """Register the losses and the estimator, install the hooks (idempotent)."""
    for name in TOKEN_SETS:
        if name not in POLICY_LOSS_REGISTRY:
            POLICY_LOSS_REGISTRY[name] = verl_loss_fn(name)
    for name, fn in ESTIMATORS.items():
        if ADV_ESTIMATOR_REGISTRY.get(name) is not fn:
            register_adv_est(name)(fn)
    install_hooks()
    install_rollout_correction_hook()
    install_turn_score_hooks()
    register_startup_check(rollout_correction_checks)
    register_startup_check(turn_credit_checks)


def registered() -> dict[str, list[str]]:
    """What of ours verl's registries hold now."""
    return {
        "policy_losses": [n for n in TOKEN_SETS if n in POLICY_LOSS_REGISTRY],
        "advantage_estimators": [n for n in ESTIMATORS if n in ADV_ESTIMATOR_REGISTRY],
    }


try:
    register()
except Exception as exc:
    _failed_to_load(exc)
    raise
