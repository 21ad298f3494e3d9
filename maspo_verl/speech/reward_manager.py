"""verl 0.9.1 reward-loop manager for TTS: scores response *token ids* in batches.

Select it with (the recipe does)::

    reward.reward_manager.source=importlib
    reward.reward_manager.name=SpeechRewardManager
    reward.reward_manager.module.path=pkg://maspo_verl.speech.reward_manager
    +reward.custom_reward_function.reward_kwargs.<field>=...  # optional, or MASPO_SPEECH_<FIELD>

Where it runs: verl's ``RewardLoopManager`` starts ``reward.num_workers`` Ray actors
(``reward_loop_worker_<i>``, CPU-only scheduling, spread over nodes); each builds one manager. A
chunk of the batch reaches a worker, which calls ``run_single`` once per sample as concurrent
asyncio tasks; the manager maps ids -> codes without detokenising and awaits the process-wide
``AsyncBatcher``, so the codec and Whisper see the whole chunk at once. The codec and ASR models
load lazily on the first batch, once per worker process, on ``pick_device('auto')``: the worker's
node GPU ``i mod n`` (Ray 2.5x leaves CUDA_VISIBLE_DEVICES unset for zero-GPU actors), else CPU.

With ``token_scores=true`` (span credit, ``credit=span``) each sample's per-code penalties are placed
at the codes' positions in the response and returned as per-token scores under
``reward_extra_info[TOKEN_SCORES_KEY]``; maspo_verl's hook on verl's agent-loop output turns them into
the sample's ``rm_scores`` row (``maspo_verl.plugin.hooks.install_token_scores_hook``).

With MASPO's ``segment_rule=words`` (preset ``loss=maspo_words``) the manager turns on the reward's
``word_ids`` itself and returns, per sample, the word id of each response token (the codes' word ids
placed at their positions, -1 elsewhere) under ``reward_extra_info[WORD_IDS_KEY]``; the same hook
makes them a tensor field that verl carries to the loss's micro-batch (``maspo_verl.batch``).

Importing this module registers ``speech_startup_checks`` with the plugin; ``maspo_verl.main`` imports
the manager module a config names before it runs the start-up checks.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from verl import DataProto

from maspo_verl.advantages import SPAN_GRPO
from maspo_verl.batch import NO_WORD, TOKEN_SCORES_KEY, WORD_IDS_KEY
from maspo_verl.core.segments import WORD_IDS
from maspo_verl.core.token_sets import inputs_needed
from maspo_verl.plugin.checks import register_startup_check, warn_span_credit_is_grpo
from maspo_verl.plugin.hooks import patch_problem
from maspo_verl.plugin.rewards import RewardManager
from maspo_verl.speech.preflight import run_checks
from maspo_verl.speech.reward import get_batcher
from maspo_verl.speech.settings import SpeechRewardConfig, settings_from_config
from maspo_verl.speech.spans import token_scores
from maspo_verl.speech.tokens import LlasaTokenMap

logger = logging.getLogger(__name__)


def loss_uses_words(config: Any) -> bool:
    """The policy loss reads word ids (e.g. ``segment_rule=words``)."""
    try:
        policy_loss = config.actor_rollout_ref.actor.policy_loss
    except Exception:
        return False
    return WORD_IDS in inputs_needed(policy_loss)


def speech_settings(config: Any) -> SpeechRewardConfig:
    """The reward's settings; ``word_ids`` on when the policy loss segments at words."""
    speech = SpeechRewardConfig.from_env(settings_from_config(config))
    return dataclasses.replace(speech, word_ids=True) if loss_uses_words(config) else speech


@register_startup_check
def speech_startup_checks(config: Any) -> list[str]:
    """The speech reward's settings, whether its models load here (``maspo_verl.speech.preflight``), and
    where its per-token scores (span credit) and word ids (``segment_rule=words``) can reach the trainer."""
    reward = config.get("reward", {}) or {}
    if (reward.get("reward_manager", {}) or {}).get("name") != SpeechRewardManager.__name__:
        return []
    speech = speech_settings(config)
    return _token_checks(config, speech) + run_checks(speech, settings_from_config(config), config)


def _token_checks(config: Any, speech: SpeechRewardConfig) -> list[str]:
    """Where per-token scores and word ids reach the trainer (the config's shape, checked first)."""
    reward = config.get("reward", {}) or {}
    span_credit = (config.get("algorithm", {}) or {}).get("adv_estimator") == SPAN_GRPO
    if not (speech.token_scores or speech.word_ids):
        return [warn_span_credit_is_grpo()] if span_credit else []
    issued = [warn_span_credit_is_grpo()] if span_credit and not speech.token_scores else []
    where = (
        "reward.custom_reward_function.reward_kwargs.token_scores=true"
        if speech.token_scores
        else "actor_rollout_ref.actor.policy_loss.segment_rule=words (the reward's word ids)"
    )
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
    if patch_problem("token_scores"):
        raise RuntimeError(f"{where} is unavailable: {patch_problem('token_scores')}")
    return issued


class SpeechRewardManager(RewardManager):
    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)
        self.speech_config = speech_settings(config)
        try:
            self.token_map = LlasaTokenMap.from_tokenizer(tokenizer)
        except Exception as exc:
            logger.warning("speech reward: %s; using the documented Llasa defaults", exc)
            self.token_map = LlasaTokenMap()

    async def run_single(self, data: DataProto) -> dict:
        """One sample's reward; a failure of the sample scores 0 (counted), one that hits every sample
        raises here and stops the run (``maspo_verl.speech.scorer``)."""
        item, response_ids = self.response(data)
        codes, positions = self.token_map.codes_and_positions(response_ids)
        reward_model = item.non_tensor_batch.get("reward_model", None)
        text = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        extra = item.non_tensor_batch.get("extra_info", None)
        result = dict(
            await get_batcher(self.speech_config).score(codes, text, extra if isinstance(extra, dict) else None)
        )
        code_penalties = result.pop("code_penalties", None)
        code_words = result.pop("code_words", None)
        if self.speech_config.token_scores:
            penalties = [0.0] * len(response_ids)
            for pos, p in zip(positions, code_penalties or [0.0] * len(positions), strict=True):
                penalties[pos] = p
            result[TOKEN_SCORES_KEY] = token_scores(float(result["score"]), penalties)
        if self.speech_config.word_ids:
            # an empty list (a failed sample) becomes a row without words in the hook
            words = [NO_WORD] * len(response_ids)
            for pos, w in zip(positions, code_words or [NO_WORD] * len(positions), strict=True):
                words[pos] = w
            result[WORD_IDS_KEY] = words
        return {"reward_score": float(result["score"]), "reward_extra_info": result}
