"""verl's side of turn credit (``maspo_turn_grpo``, ``maspo_verl.advantages``): verl hands an advantage
estimator tensors only, while the per-turn scores of its agent loops (``turn_scores``, ``tool_rewards``) are
non-tensor fields. Two hooks put them in scope (``advantages.turn_scores_scope``) for verl's advantage step:

- ``turn_scores.v1``: around the v1 trainer's ``PPOTrainer._compute_advantage(self, batch, metrics)``, which
  fetches only tensors from TransferQueue: with ``adv_estimator=maspo_turn_grpo`` the hook fetches the samples'
  ``extra_fields`` (where the agent loop's output puts them) in the batch's order, and logs
  ``turn_credit/scored_fraction`` (the share of samples with per-turn scores);
- ``turn_scores.legacy``: around ``ray_trainer.compute_advantage(data, adv_estimator, ...)``, whose
  ``data.non_tensor_batch`` holds them as verl's agent loop wrote them (one object array per key).

Each checks the signature it relies on; a run with ``maspo_turn_grpo`` on a verl where they are refused stops at
start-up with the reason.
"""

from __future__ import annotations

import inspect
import logging

from maspo_verl.advantages import TURN_GRPO, turn_score_lists, turn_scores_scope
from maspo_verl.plugin.hooks import PATCHES, TRAINER_MODULE, after_import, patch, patch_problem

logger = logging.getLogger("maspo_verl")

LEGACY_MODULE = "verl.trainer.ppo.ray_trainer"
V1_PARAMS = ("self", "batch", "metrics")
LEGACY_PARAMS = ("data", "adv_estimator")


def _fetch_extra_fields(batch) -> list:
    import transfer_queue as tq

    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])
    return data.pop("extra_fields").tolist()


def _v1_wrapper(original):
    def _compute_advantage(self, batch, metrics):
        if self.config.algorithm.get("adv_estimator") != TURN_GRPO:
            return original(self, batch, metrics)
        scores = [turn_score_lists(f or {}) for f in _fetch_extra_fields(batch)]
        metrics["turn_credit/scored_fraction"] = sum(s is not None for s in scores) / max(len(scores), 1)
        with turn_scores_scope(scores):
            return original(self, batch, metrics)

    return _compute_advantage


def _legacy_wrapper(original):
    def compute_advantage(data, adv_estimator, *args, **kwargs):
        fields = getattr(data, "non_tensor_batch", None) or {}
        if adv_estimator != TURN_GRPO or not any(k in fields for k in ("turn_scores", "tool_rewards")):
            return original(data, adv_estimator, *args, **kwargs)
        n = len(data)
        rows = [{k: fields[k][i] for k in ("turn_scores", "tool_rewards") if k in fields} for i in range(n)]
        with turn_scores_scope([turn_score_lists(r) for r in rows]):
            return original(data, adv_estimator, *args, **kwargs)

    return compute_advantage


def _params(expected):
    def check(original):
        params = tuple(inspect.signature(original).parameters)[: len(expected)]
        if params != expected:
            return f"{original.__qualname__} has parameters {params}, expected {expected} first"
        return None

    return check


def _install_v1(trainer_base) -> None:
    try:
        patch("turn_scores.v1", trainer_base.PPOTrainer, "_compute_advantage", _v1_wrapper, _params(V1_PARAMS))
    except Exception as exc:  # never break verl's import
        PATCHES["turn_scores.v1"] = f"{type(exc).__name__}: {exc}"
        logger.error("maspo_verl: turn-scores hook not installed", exc_info=True)


def _install_legacy(ray_trainer) -> None:
    try:
        patch("turn_scores.legacy", ray_trainer, "compute_advantage", _legacy_wrapper, _params(LEGACY_PARAMS))
    except Exception as exc:
        PATCHES["turn_scores.legacy"] = f"{type(exc).__name__}: {exc}"
        logger.error("maspo_verl: turn-scores hook not installed", exc_info=True)


def install_turn_score_hooks() -> None:
    """Both hooks, each when verl imports its module (not now: see ``hooks.install_trainer_reward_hooks``)."""
    after_import(TRAINER_MODULE, _install_v1)
    after_import(LEGACY_MODULE, _install_legacy)


def turn_credit_checks(config) -> list[str]:
    """``algorithm.adv_estimator=maspo_turn_grpo``: its settings, and the hook of the trainer that runs."""
    algorithm = config.get("algorithm", {}) or {}
    if algorithm.get("adv_estimator") != TURN_GRPO:
        return []
    import importlib

    from maspo_verl.config import TurnCreditConfig

    TurnCreditConfig.from_algorithm(algorithm)
    v1 = bool((config.get("trainer", {}) or {}).get("use_v1", True))
    importlib.import_module(TRAINER_MODULE if v1 else LEGACY_MODULE)
    name = "turn_scores.v1" if v1 else "turn_scores.legacy"
    if patch_problem(name):
        raise RuntimeError(f"algorithm.adv_estimator={TURN_GRPO} cannot read verl's turn scores: {patch_problem(name)}")
    return []
