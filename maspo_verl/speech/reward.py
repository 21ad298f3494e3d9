"""The speech reward in verl: batching of concurrent calls, one scorer per process, ``compute_score``.

verl's reward loop scores samples as concurrent asyncio tasks; ``AsyncBatcher`` collects them into
batches for ``maspo_verl.speech.scorer.SpeechScorer``, one per process and settings (``get_scorer``).
``compute_score`` is the custom reward function for verl's naive manager; the token-id path
(``maspo_verl.speech.reward_manager.SpeechRewardManager``, what the recipe uses) awaits the same batcher.
Settings: ``maspo_verl.speech.settings``.

A batch whose scoring raises (a model that does not load, too many failed samples: a failure that hits
every sample) raises in every caller awaiting it, and is recorded for the trainer
(``maspo_verl.plugin.hooks.report_run_failure``): verl's v1 agent loop only logs an exception raised in a reward
and drops the sample, so the trainer stops at its next batch with this cause. No retry.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from maspo_verl.plugin.checks import register_startup_check
from maspo_verl.plugin.hooks import report_run_failure
from maspo_verl.speech.preflight import run_checks
from maspo_verl.speech.scorer import SpeechRewardFailure, SpeechScorer
from maspo_verl.speech.settings import SpeechRewardConfig, settings_from_config
from maspo_verl.speech.tokens import LlasaTokenMap

logger = logging.getLogger(__name__)


class AsyncBatcher:
    """Collects concurrent ``await score(...)`` calls into batches for ``SpeechScorer.score_codes``.

    verl 0.9.1's reward-loop worker scores a chunk of samples as concurrent asyncio tasks (one per
    sample); each awaits here, and after ``batch_window_s`` (or ``max_batch`` requests) the whole
    batch is decoded and transcribed at once in a worker thread, so the event loop stays free.
    """

    def __init__(self, scorer: SpeechScorer):
        self.scorer = scorer
        self._pending: list[tuple[list[int], Any, dict | None, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None

    async def score(self, codes: list[int], text: Any, extra_info: dict | None = None) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((codes, text, extra_info, fut))
        if len(self._pending) >= self.scorer.config.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.scorer.config.batch_window_s, self._flush)
        return await fut

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch) -> None:
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(
                None, self.scorer.score_codes, [b[0] for b in batch], [b[1] for b in batch], [b[2] for b in batch]
            )
        except Exception as exc:  # a failure that hits every sample of the batch: the run stops with it
            message = f"speech reward: {type(exc).__name__}: {exc}"
            message = str(exc) if isinstance(exc, SpeechRewardFailure) else message
            logger.error("%s", message)
            report_run_failure(message)
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (*_, fut), r in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(r)


# ---- per-process singletons (one per Ray reward-loop worker) --------------------------------------
_scorers: dict[tuple, SpeechScorer] = {}
_batchers: dict[tuple, AsyncBatcher] = {}
_singleton_lock = threading.Lock()


def get_scorer(config: SpeechRewardConfig) -> SpeechScorer:
    key = tuple(sorted(vars(config).items()))
    with _singleton_lock:
        if key not in _scorers:
            _scorers[key] = SpeechScorer(config)
        return _scorers[key]


def register_scorer(config: SpeechRewardConfig, scorer: SpeechScorer) -> None:
    """Use ``scorer`` (e.g. with a stand-in codec or a shared ASR model) for ``config`` in this process."""
    key = tuple(sorted(vars(config).items()))
    with _singleton_lock:
        _scorers[key] = scorer
        for k in [k for k in _batchers if k[: len(key)] == key]:
            del _batchers[k]


def get_batcher(config: SpeechRewardConfig) -> AsyncBatcher:
    key = tuple(sorted(vars(config).items())) + (id(asyncio.get_running_loop()),)
    if key not in _batchers:
        _batchers[key] = AsyncBatcher(get_scorer(config))
    return _batchers[key]


async def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> dict[str, float]:
    """verl custom reward function (async: verl awaits it; concurrent calls are batched).

    Use with the *naive* reward manager: ``reward.custom_reward_function.path=pkg://maspo_verl.speech.reward``
    ``reward.custom_reward_function.name=compute_score``; settings via
    ``+reward.custom_reward_function.reward_kwargs.<field>=...`` or ``MASPO_SPEECH_<FIELD>``.
    It parses ``<|s_N|>`` from the decoded response, which needs a tokenizer that does not treat
    the codec tokens as special (the naive manager decodes with ``skip_special_tokens=True``); the
    token-id path ``maspo_verl.speech.reward_manager.SpeechRewardManager`` has no such caveat and is
    what the recipe uses. A failure of the sample scores 0 (counted); one that hits every sample raises.
    """
    config = SpeechRewardConfig.from_env(_settings(kwargs))
    codes = LlasaTokenMap(codec_size=65536).codes_from_text(solution_str)
    result = await get_batcher(config).score(codes, ground_truth, extra_info)
    result.pop("code_penalties", None)  # per-token scores need SpeechRewardManager (token positions)
    result.pop("code_words", None)
    return result


def _settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The reward settings among the keyword arguments verl passes to ``compute_score``."""
    return {k: v for k, v in kwargs.items() if k not in ("reward_router_address", "reward_model_tokenizer")}


@register_startup_check
def compute_score_startup_checks(config: Any) -> list[str]:
    """With verl's naive manager and this module's ``compute_score``: the settings, and whether their
    models load here (the manager path's check, ``speech_startup_checks``, does the same)."""
    reward = config.get("reward", {}) or {}
    function = reward.get("custom_reward_function", {}) or {}
    path = str(function.get("path") or "").replace("/", ".").removesuffix(".py")
    manager = (reward.get("reward_manager", {}) or {}).get("name")
    if not path.endswith(__name__) or function.get("name") != "compute_score" or manager == "SpeechRewardManager":
        return []
    settings = _settings(settings_from_config(config))
    return run_checks(SpeechRewardConfig.from_env(settings), settings, config)
