"""Everything that touches verl beyond its public registries, behind a version guard (SPEC §6).

- ``install_ppo_loss_hook``: verl's registered losses never see the response token ids, although
  the micro-batch handed to ``verl.workers.utils.losses.ppo_loss`` holds them. We wrap ``ppo_loss``
  so the micro-batch is visible (through a context variable) for the duration of the call. The
  wrapper is installed at plugin import, before ``verl.workers.engine_workers`` binds the name; it
  refuses (and says why) on a verl version or ``ppo_loss`` signature it does not know.
- ``install_token_scores_hook``: verl's agent loop turns a reward into ``rm_scores`` with the
  scalar score on the last token. A reward that also returns per-token scores (in
  ``reward_extra_info[TOKEN_SCORES_KEY]``, one per response token, summing to the score) gets them
  as its ``rm_scores`` row instead: we wrap ``AgentLoopOutput.as_dict``, where the v1 trainer builds
  that row, and drop the list from the extra info so nothing downstream tries to average it.
- ``startup_checks``: config errors that verl would only report at the first actor update.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import sys
import warnings
from typing import Any

import torch

logger = logging.getLogger("maspo_verl")

SUPPORTED_VERL = ("0.9.1", "0.10")  # [min, max)
PPO_LOSS_PARAMS = ("config", "model_output", "data", "dp_group")
# modules that bind ``ppo_loss`` by name at import time
PPO_LOSS_IMPORTERS = ("verl.workers.engine_workers", "verl.trainer.distillation.losses")
# verl losses whose ratio is per token (hurt most by an engine/trainer precision mismatch)
SEQUENCE_LEVEL_LOSSES = ("gspo", "geo_mean", "ctpo", "pgspo", "bypass_mode")

TOKEN_SCORES_KEY = "maspo_token_scores"

_micro_batch: contextvars.ContextVar[Any] = contextvars.ContextVar("maspo_micro_batch", default=None)
_hook_error: str | None = "not installed yet"
_token_scores_error: str | None = "not installed yet"


def verl_version_problem() -> str | None:
    """None when the installed verl is one this glue was written against, else the reason."""
    import verl
    from packaging.version import Version

    version = getattr(verl, "__version__", "unknown")
    try:
        ok = Version(SUPPORTED_VERL[0]) <= Version(version) < Version(SUPPORTED_VERL[1])
    except Exception:
        ok = False
    if not ok:
        return f"verl {version} is not supported (maspo-verl needs >={SUPPORTED_VERL[0]},<{SUPPORTED_VERL[1]})"
    return None


def _wrap(original):
    @functools.wraps(original)
    def ppo_loss(config, model_output, data, dp_group=None):
        token = _micro_batch.set(data)
        try:
            return original(config, model_output, data, dp_group)
        finally:
            _micro_batch.reset(token)

    ppo_loss.__maspo_original__ = original
    return ppo_loss


def install_ppo_loss_hook() -> str | None:
    """Install the ``ppo_loss`` wrapper; returns None on success, else why it was refused."""
    global _hook_error
    problem = verl_version_problem()
    if problem is None:
        from verl.workers.utils import losses

        current = losses.ppo_loss
        original = getattr(current, "__maspo_original__", current)
        params = tuple(inspect.signature(original).parameters)
        if params != PPO_LOSS_PARAMS:
            problem = f"verl.workers.utils.losses.ppo_loss has parameters {params}, expected {PPO_LOSS_PARAMS}"
        else:
            wrapped = current if current is not original else _wrap(original)
            losses.ppo_loss = wrapped
            for name in PPO_LOSS_IMPORTERS:
                module = sys.modules.get(name)
                if module is not None and getattr(module, "ppo_loss", None) is original:
                    module.ppo_loss = wrapped
    _hook_error = problem
    if problem:
        logger.error("maspo_verl: token ids cannot reach the loss (segment_rule=tokenval unavailable): %s", problem)
    return problem


def hook_problem() -> str | None:
    return _hook_error


def _with_token_scores(original):
    @functools.wraps(original)
    def as_dict(self):
        out = original(self)
        info = (out.get("extra_fields") or {}).get("reward_extra_info")
        if not isinstance(info, dict) or TOKEN_SCORES_KEY not in info:
            return out
        info = dict(info)  # the info dict is shared by a session's outputs: never mutate it
        scores = info.pop(TOKEN_SCORES_KEY)
        out["extra_fields"] = {**out["extra_fields"], "reward_extra_info": info}
        row = out.get("rm_scores")
        if row is not None and scores is not None and len(scores) == row.shape[0]:
            out["rm_scores"] = torch.tensor(scores, dtype=torch.float32)
        elif row is not None:
            logger.debug("per-token scores: %d values for %d response tokens", len(scores or []), row.shape[0])
            _warn_once(
                "per-token reward scores do not match the response length: using the scalar score on the "
                "last token for such samples"
            )
        return out

    as_dict.__maspo_original__ = original
    return as_dict


def install_token_scores_hook() -> str | None:
    """Wrap ``AgentLoopOutput.as_dict``; returns None on success, else why it was refused."""
    global _token_scores_error
    problem = verl_version_problem()
    if problem is None:
        try:
            from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
        except ImportError as exc:
            problem = f"verl.experimental.agent_loop is unavailable ({exc})"
        else:
            current = AgentLoopOutput.as_dict
            if not hasattr(current, "__maspo_original__"):
                AgentLoopOutput.as_dict = _with_token_scores(current)
    _token_scores_error = problem
    return problem


def token_scores_problem() -> str | None:
    return _token_scores_error


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)
    logger.warning(message)


def current_response_ids(mask: torch.Tensor) -> torch.Tensor:
    """Response token ids of the micro-batch being scored, right-padded to ``mask``'s shape."""
    data = _micro_batch.get()
    if data is None:
        raise RuntimeError(
            "segment_rule='tokenval' needs the response token ids, but no verl micro-batch is in scope: "
            + (hook_problem() or "the loss was called outside verl's ppo_loss; wrap the call in micro_batch_scope()")
        )
    responses = data["responses"]
    B, T = mask.shape
    if responses.is_nested:
        # every response fits in the loss width T (verl pads log-probs to the longest response)
        responses = responses.to_padded_tensor(0, output_size=(B, T))
    if responses.shape[0] != B or responses.shape[1] < T:
        raise RuntimeError(f"micro-batch responses have shape {tuple(responses.shape)}, loss mask {tuple(mask.shape)}")
    return responses[:, :T].to(mask.device)


class micro_batch_scope:
    """Make ``data`` (a dict or TensorDict with ``responses``) visible to the loss, as the hook does."""

    def __init__(self, data):
        self.data = data

    def __enter__(self):
        self._token = _micro_batch.set(self.data)
        return self.data

    def __exit__(self, *exc):
        _micro_batch.reset(self._token)


def require_registered(loss_mode: str) -> None:
    """Fail loudly if one of our loss names is missing from verl's registry (plugin not loaded)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise RuntimeError(
            f"policy_loss.loss_mode={loss_mode!r} is not registered in verl: the maspo_verl plugin did not "
            "load. Run `python -m maspo_verl check` in the same environment for the reason."
        )


def startup_checks(config) -> list[str]:
    """Checks on the composed trainer config before Ray starts; returns the warnings issued."""
    from maspo_verl.config import OUR_LOSS_MODES

    actor = config.actor_rollout_ref.actor
    policy_loss = actor.policy_loss
    loss_mode = policy_loss.get("loss_mode", "vanilla")
    target = policy_loss.get("_target_", "")
    if loss_mode in OUR_LOSS_MODES:
        require_registered(loss_mode)
        if target != "maspo_verl.config.GranularLossConfig":
            raise ValueError(
                f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} needs "
                f"policy_loss._target_=maspo_verl.config.GranularLossConfig (got {target!r})"
            )
        if loss_mode == "maspo" and policy_loss.get("segment_rule") == "tokenval" and hook_problem():
            raise RuntimeError(f"segment_rule='tokenval' is unavailable: {hook_problem()}")
    issued = _span_credit_checks(config)
    rollout_correction = config.get("algorithm", {}).get("rollout_correction", {}) or {}
    if rollout_correction.get("bypass_mode", False) and _is_token_level(loss_mode, policy_loss):
        message = (
            f"algorithm.rollout_correction.bypass_mode=true with token-level loss {loss_mode!r}: the inference "
            "engine's log-probs become the old log-probs, and per-token ratios are the ones an engine/trainer "
            "precision mismatch distorts most; prefer a segment or sequence loss (maspo, ctpo, pgspo, gspo)"
        )
        _warn_once(message)
        issued.append(message)
    return issued


def _speech_reward_settings(config):
    """The speech reward's settings (validated) from the run's config."""
    from maspo_verl.speech.reward import SpeechRewardConfig
    from maspo_verl.speech.reward_manager import settings_from_config

    return SpeechRewardConfig.from_env(settings_from_config(config))


def _span_credit_checks(config) -> list[str]:
    from maspo_verl.advantages import SPAN_GRPO
    from maspo_verl.config import SpanCreditConfig

    algorithm = config.get("algorithm", {}) or {}
    span_credit = algorithm.get("adv_estimator") == SPAN_GRPO
    if span_credit:
        SpanCreditConfig.from_algorithm(algorithm)
    reward = config.get("reward", {}) or {}
    manager = reward.get("reward_manager", {}) or {}
    speech = _speech_reward_settings(config) if manager.get("name") == "SpeechRewardManager" else None
    token_scores = speech is not None and speech.token_scores
    if token_scores:
        where = "reward.custom_reward_function.reward_kwargs.token_scores=true"
        if not config.get("trainer", {}).get("use_v1", True):
            raise ValueError(
                f"{where} needs trainer.use_v1=true: per-token reward scores reach rm_scores "
                "through the v1 trainer's agent loop (the legacy trainer cannot carry them)"
            )
        rm = reward.get("reward_model", {}) or {}
        if rm.get("enable", False) and not rm.get("enable_resource_pool", False):
            raise ValueError(
                f"{where} needs the reward computed in the agent loop: with a colocated reward model "
                "(reward.reward_model.enable=true, enable_resource_pool=false) verl scores after "
                "the rollout and keeps only the scalar score"
            )
        if token_scores_problem():
            raise RuntimeError(f"{where} is unavailable: {token_scores_problem()}")
    # verl's own managers never return per-token scores; a custom one may
    builtin = manager.get("source", "register") == "register"
    if span_credit and not token_scores and (speech is not None or builtin):
        message = (
            f"algorithm.adv_estimator={SPAN_GRPO} without per-token reward scores: with an outcome reward "
            "(score on the last token) it gives verl's grpo advantages; for the speech reward set "
            "reward.custom_reward_function.reward_kwargs.token_scores=true (preset credit=span)"
        )
        _warn_once(message)
        return [message]
    return []


def _is_token_level(loss_mode: str, policy_loss) -> bool:
    if loss_mode == "maspo":
        window_one = policy_loss.get("segment_rule") == "fixed" and policy_loss.get("segment_window") == 1
        return window_one or policy_loss.get("max_segment_len") == 1
    return loss_mode not in SEQUENCE_LEVEL_LOSSES
