"""Start-up checks: ``run_startup_checks(config)`` checks a composed trainer config before Ray starts.

Recipes add their own checks with ``register_startup_check``; the module of a ``pkg://`` reward manager
named in the config is imported first, so a recipe's manager module can register its checks on import.
What a loss needs is asked of it: the segment rules in use declare the inputs they read and run their
own start-up work (``maspo_verl.core.segments.SegmentRule``).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

from maspo_verl.advantages import SPAN_GRPO
from maspo_verl.core.segments import FROM_MICRO_BATCH, WORD_IDS
from maspo_verl.core.surrogates import DEFAULT as DEFAULT_SURROGATE
from maspo_verl.core.surrogates import SURROGATES
from maspo_verl.core.token_sets import TOKEN_SETS, segment_rules
from maspo_verl.plugin.hooks import patch_problem
from maspo_verl.util import warn_once

logger = logging.getLogger("maspo_verl")

# verl's losses whose ratio is shared over the response (ours say so through TokenSet.token_level)
VERL_SEQUENCE_LEVEL_LOSSES = ("gspo", "geo_mean", "bypass_mode")

StartupCheck = Callable[[Any], list[str]]
_STARTUP_CHECKS: list[StartupCheck] = []


def register_startup_check(check: StartupCheck) -> StartupCheck:
    """Add ``check(config) -> warnings issued`` (raise for errors) to ``run_startup_checks``."""
    if check not in _STARTUP_CHECKS:
        _STARTUP_CHECKS.append(check)
    return check


def require_registered(loss_mode: str) -> None:
    """Fail loudly if one of our loss names is missing from verl's registry."""
    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise RuntimeError(
            f"policy_loss.loss_mode={loss_mode!r} is not registered in verl: the maspo_verl plugin did not "
            "load. Run `python -m maspo_verl check` in the same environment for the reason."
        )


def _import_reward_manager_module(config) -> None:
    """Import the ``pkg://`` modules of the reward manager and the custom reward function the config
    names, so their checks are registered."""
    reward = config.get("reward", {}) or {}
    manager = reward.get("reward_manager", {}) or {}
    paths = [(manager.get("module", {}) or {}).get("path") if manager.get("source") == "importlib" else None]
    paths.append((reward.get("custom_reward_function", {}) or {}).get("path"))
    for path in paths:
        if str(path or "").startswith("pkg://"):
            importlib.import_module(str(path)[len("pkg://") :])


def run_startup_checks(config) -> list[str]:
    """Checks on the composed trainer config before Ray starts; returns the warnings issued."""
    _import_reward_manager_module(config)
    from maspo_verl.plugin.engine_mismatch import EngineCheck

    EngineCheck.from_config(config)  # a bad maspo.engine_check is refused here, not at the first step
    issued: list[str] = []
    for check in (_loss_checks, _inspect_checks, _span_credit_checks, _bypass_checks, *_STARTUP_CHECKS):
        issued += check(config)
    return issued


def _loss_checks(config) -> list[str]:
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    loss_mode = policy_loss.get("loss_mode", "vanilla")
    if loss_mode not in TOKEN_SETS:
        return []
    from maspo_verl.config import TARGET  # not at import: ``import verl`` loads this module while config loads

    require_registered(loss_mode)
    target = policy_loss.get("_target_", "")
    if target != TARGET:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} needs policy_loss._target_={TARGET} "
            f"(got {target!r})"
        )
    # the actor fields the surrogate reads (SAPO's temperatures; verl checks none of them); an unknown
    # surrogate is the config's to refuse
    objective = SURROGATES.get(policy_loss.get("surrogate", DEFAULT_SURROGATE))
    if objective is not None:
        objective.check_actor(config.actor_rollout_ref.actor)
    issued: list[str] = []
    rules = segment_rules(policy_loss)
    for rule in rules:
        # ids from the micro-batch reach the loss through the ppo_loss hook, word ids also through the
        # v1 trainer's agent loop and the token_scores hook (maspo_verl.batch)
        hooks = ("ppo_loss",) * bool(rule.needs & FROM_MICRO_BATCH) + ("token_scores",) * (WORD_IDS in rule.needs)
        for hook in hooks:
            if patch_problem(hook):
                raise RuntimeError(f"segment_rule={rule.name!r} is unavailable: {patch_problem(hook)}")
        if WORD_IDS in rule.needs:
            issued += _word_ids_checks(config, rule)
        issued += rule.startup(config)
    return issued


def _inspect_checks(config) -> list[str]:
    """``policy_loss.inspect_dir``: made absolute here, on the driver (Ray workers have other working
    folders); the loss needs the actor-update hook to know the step."""
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    folder = policy_loss.get("inspect_dir", None)
    if folder is None:
        return []
    if patch_problem("update_step"):
        raise RuntimeError(f"policy_loss.inspect_dir is unavailable: {patch_problem('update_step')}")
    policy_loss.inspect_dir = os.path.abspath(os.path.expanduser(str(folder)))
    return []


def _word_ids_checks(config, rule) -> list[str]:
    """Word ids come from the reward through the v1 trainer's agent loop."""
    if not config.get("trainer", {}).get("use_v1", True):
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.segment_rule={rule.name!r} needs trainer.use_v1=true: word ids "
            "reach the loss through the v1 trainer's agent loop (the legacy trainer cannot carry them)"
        )
    manager = (config.get("reward", {}) or {}).get("reward_manager", {}) or {}
    if manager.get("source", "register") != "register":
        return []
    message = (
        f"segment_rule={rule.name!r} with one of verl's own reward managers, which return no word ids: every "
        f"sample takes policy_loss.{rule.fallback_field} (the speech recipe's reward returns them)"
    )
    warn_once(message, logger=logger)
    return [message]


def _span_credit_checks(config) -> list[str]:
    algorithm = config.get("algorithm", {}) or {}
    if algorithm.get("adv_estimator") != SPAN_GRPO:
        return []
    from maspo_verl.config import SpanCreditConfig

    SpanCreditConfig.from_algorithm(algorithm)
    manager = (config.get("reward", {}) or {}).get("reward_manager", {}) or {}
    if manager.get("source", "register") == "register":  # verl's own managers give no per-token scores
        return [warn_span_credit_is_grpo()]
    return []


def warn_span_credit_is_grpo() -> str:
    message = (
        f"algorithm.adv_estimator={SPAN_GRPO} without per-token reward scores: with an outcome reward "
        "(score on the last token) it gives verl's grpo advantages; for the speech reward set "
        "reward.custom_reward_function.reward_kwargs.token_scores=true (preset credit=span)"
    )
    warn_once(message, logger=logger)
    return message


def _bypass_checks(config) -> list[str]:
    rollout_correction = config.get("algorithm", {}).get("rollout_correction", {}) or {}
    policy_loss = config.actor_rollout_ref.actor.policy_loss
    loss_mode = policy_loss.get("loss_mode", "vanilla")
    token_set = TOKEN_SETS.get(loss_mode)
    token_level = token_set.token_level(policy_loss) if token_set else loss_mode not in VERL_SEQUENCE_LEVEL_LOSSES
    if not (rollout_correction.get("bypass_mode", False) and token_level):
        return []
    message = (
        f"algorithm.rollout_correction.bypass_mode=true with token-level loss {loss_mode!r}: the inference "
        "engine's log-probs become the old log-probs, and per-token ratios are the ones an engine/trainer "
        "precision mismatch distorts most; prefer a segment or sequence loss (maspo, ctpo, pgspo, gspo)"
    )
    warn_once(message, logger=logger)
    return [message]


def check_policy_loss(config) -> None:
    """Build our policy-loss config as verl will (its checks run), so a bad value is refused before anything
    starts (no Ray, no run folder), not by verl's validation inside the run."""
    from verl.utils.config import omega_conf_to_dataclass

    from maspo_verl.config import TARGET

    section = config.actor_rollout_ref.actor.policy_loss
    if section.get("_target_") == TARGET:
        omega_conf_to_dataclass(section)
