"""End-to-end: the speech recipe's pieces in verl's real trainer on CPU.

A tiny random Llama with Llasa-1B's vocabulary layout (128256 base ids + 8 specials + 65536
``<|s_N|>`` codec tokens), the Llasa TTS prompt, and the speech reward manager (stand-in codec +
bundled Whisper tiny.en). A random model's codes decode to noise, so rewards are 0: this checks the
plumbing (prompt, codec ids reaching the loss, reward workers), not learning.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest

from maspo_verl.speech.local_assets import build

pytestmark = pytest.mark.e2e

RESPONSE_LEN = 30
# One speech run per behaviour: Llasa's 193,800-token vocabulary makes a step ~1 min on this CPU. The
# other presets run on the cheaper text model (maspo_fixed in test_local_cpu.py and the Ray job tests,
# maspo_logprob in test_local_trainer_features.py); maspo_tokenval's rule runs here as maspo_words'
# fallback, on every sample a random model's noise leaves without words.


@pytest.fixture(scope="module")
def speech_assets(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("speech_local")))


def test_word_segments_full_setting(speech_assets, local_run):
    """`loss=maspo_words credit=span`, the recipe's full setting: the speech reward returns per-token
    scores and word ids (turned on by the loss), our hook carries both into rm_scores and the batch,
    maspo_span_grpo computes the advantages, and the loss segments at the words Whisper found and falls
    back to tokenval where it found none (a random model's codes are noise)."""
    run = local_run(
        [f"{k}={v}" for k, v in speech_assets.items()]
        + [
            "loss=maspo_words",
            "credit=span",
            "trainer.total_training_steps=1",
            f"data.max_response_length={RESPONSE_LEN}",
            "actor_rollout_ref.rollout.ignore_eos=true",
        ]
    )
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    metrics = run.steps[1]
    assert math.isfinite(metrics["actor/pg_loss"]), context
    assert metrics["response_length/mean"] == pytest.approx(RESPONSE_LEN), context
    # the reward's own numbers reach the step's log (maspo_verl's hook): nothing failed, its time
    assert metrics["reward/failed/mean"] == 0.0 and metrics["reward/score_s/mean"] > 0, context
    # a sample Whisper transcribed scores 1 - tanh(3 WER) > 0 and has word times; one it did not
    # (non-speech, invalid) scores 0 and has none: every sample fell back exactly when all scored 0
    fallback = metrics["actor/ratio/words_fallback_frac"]
    assert 0.0 <= fallback <= 1.0, context
    assert (fallback == 1.0) == (metrics["critic/score/max"] == 0.0), context
    per_seq, seg_len = metrics["actor/ratio/segments_per_seq"], metrics["actor/ratio/segment_len_mean"]
    # verl averages both over micro-batches; with per-batch counts p_k, mean(30 / p_k) * mean(p_k)
    # is at least 30 (AM-HM) and equals it when every micro-batch has the same count
    assert 1.0 <= per_seq <= RESPONSE_LEN, context
    assert RESPONSE_LEN * (1 - 1e-6) <= seg_len * per_seq <= 1.5 * RESPONSE_LEN, context
    assert "do not match the response length" not in run.full_log, context
    assert all(math.isfinite(metrics[k]) for k in ("critic/advantages/mean", "critic/advantages/max")), context
    assert "adv_estimator: maspo_span_grpo" in run.config_text, context
    assert "SpeechRewardManager" in run.config_text or "tiny.en" in run.config_text, context


@pytest.mark.slow
def test_a_codec_failing_on_every_batch_stops_the_run(speech_assets, local_run, monkeypatch):
    """A codec that loads and then raises on every batch (``tests/speech/failing_codecs.py``, plugged in
    as ``codec=module:function``): only a worker can know. The reward raises (more than max_failed_frac
    of its samples failed), verl's agent loop logs it and drops the samples, and the trainer stops at its
    next batch with the cause: no training step completes on zero rewards."""
    root = str(Path(__file__).resolve().parents[2])  # the Ray workers import the codec module
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    codec = "+reward.custom_reward_function.reward_kwargs.codec"
    assets = {**speech_assets, codec: "tests.speech.failing_codecs:raising_codec"}
    run = local_run(
        [f"{k}={v}" for k, v in assets.items()]
        + [
            "loss=maspo_tokenval",
            "trainer.total_training_steps=2",
            f"data.max_response_length={RESPONSE_LEN}",
            "actor_rollout_ref.rollout.ignore_eos=true",
        ]
    )
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode not in (0, None), f"the run did not stop by itself ({run.returncode}){context}"
    assert not run.steps, f"a step completed: {sorted(run.steps)}{context}"
    cause = re.search(
        r"the run stops: speech reward: (\d+) of the last \1 samples failed \(invalid_decode \1, error 0\)",
        run.full_log,
    )
    assert cause and int(cause.group(1)) >= 8, context
    assert "illegal memory access" in run.full_log, context
