"""End-to-end: the speech recipe's pieces in verl's real trainer on CPU, 2 steps per MASPO preset.

A tiny random Llama with Llasa-1B's vocabulary layout (128256 base ids + 8 specials + 65536
``<|s_N|>`` codec tokens), the Llasa TTS prompt, and the speech reward manager (stand-in codec +
bundled Whisper tiny.en). A random model's codes decode to noise, so rewards are 0: this checks the
plumbing (prompt, codec ids reaching the loss, reward workers), not learning.
"""

from __future__ import annotations

import math

import pytest

from maspo_verl.speech.local_assets import build

pytestmark = pytest.mark.e2e

RESPONSE_LEN = 30
# (maspo_fixed runs on the text model in test_local_cpu.py and in the Ray job tests)
PRESETS = {
    "maspo_logprob": [],
    "maspo_tokenval": [],
}


@pytest.fixture(scope="module")
def speech_assets(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("speech_local")))


def two_steps(speech_assets, local_run, *overrides):
    """Run the speech assets for 2 steps; checks the run finished both with a finite loss."""
    run = local_run(
        [f"{k}={v}" for k, v in speech_assets.items()]
        + [
            "trainer.total_training_steps=2",
            f"data.max_response_length={RESPONSE_LEN}",
            "actor_rollout_ref.rollout.ignore_eos=true",
            *overrides,
        ]
    )
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    assert sorted(run.steps) == [1, 2], context
    for metrics in run.steps.values():
        assert math.isfinite(metrics["actor/pg_loss"]), context
    return run, context


@pytest.mark.parametrize("preset", PRESETS)
def test_speech_preset_two_steps(preset, speech_assets, local_run):
    run, context = two_steps(speech_assets, local_run, f"loss={preset}", *PRESETS[preset])
    for metrics in run.steps.values():
        assert metrics["response_length/mean"] == pytest.approx(RESPONSE_LEN), context
        seg_len, per_seq = metrics["actor/ratio/segment_len_mean"], metrics["actor/ratio/segments_per_seq"]
        # verl averages both over micro-batches; with per-batch counts p_k, mean(30 / p_k) * mean(p_k)
        # is at least 30 (AM-HM) and equals it when every micro-batch has the same count
        assert 1.0 <= per_seq <= RESPONSE_LEN, context
        assert RESPONSE_LEN * (1 - 1e-6) <= seg_len * per_seq <= 1.5 * RESPONSE_LEN, context
    assert "SpeechRewardManager" in run.config_text or "tiny.en" in run.config_text, context


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
    # a sample Whisper transcribed scores 1 - tanh(3 WER) > 0 and has word times; one it did not
    # (non-speech, invalid) scores 0 and has none: every sample fell back exactly when all scored 0
    fallback = metrics["actor/ratio/words_fallback_frac"]
    assert 0.0 <= fallback <= 1.0, context
    assert (fallback == 1.0) == (metrics["critic/score/max"] == 0.0), context
    per_seq, seg_len = metrics["actor/ratio/segments_per_seq"], metrics["actor/ratio/segment_len_mean"]
    assert 1.0 <= per_seq <= RESPONSE_LEN, context
    assert RESPONSE_LEN * (1 - 1e-6) <= seg_len * per_seq <= 1.5 * RESPONSE_LEN, context
    assert "do not match the response length" not in run.full_log, context
    assert all(math.isfinite(metrics[k]) for k in ("critic/advantages/mean", "critic/advantages/max")), context
    assert "adv_estimator: maspo_span_grpo" in run.config_text, context
