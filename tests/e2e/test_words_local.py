"""End-to-end: segment_rule=words in verl's real trainer on CPU. The word ids travel from a reward manager
through verl's agent loop, TransferQueue, data-parallel split and micro-batching to the loss
(maspo_verl.batch documents the path); the segments the loss finds are checked against the count the
reward computed from the same response tokens."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.e2e.conftest import manager_overrides

pytestmark = pytest.mark.e2e


def test_word_ids_reach_the_loss_aligned_with_the_tokens(local_run):
    """Known word ids (depending on each response's tokens) and, as the score, the segment count they
    give: the loss's segments per sequence equal the mean score (2 mini-batches of 8 responses, so
    verl's mean over micro-batches is the batch mean). A shifted, truncated or misrouted row would
    change the count. One response in four has no ids and takes the fallback (fixed, W=8)."""
    from tests.e2e.word_reward_manager import WINDOW

    manager = Path(__file__).with_name("word_reward_manager.py")
    pl = "actor_rollout_ref.actor.policy_loss"
    run = local_run(
        [
            "loss=maspo_words",
            f"{pl}.words_fallback_rule=fixed",
            f"{pl}.segment_window={WINDOW}",
            f"{pl}.min_segment_len=0",
            f"{pl}.max_segment_len=0",
            *manager_overrides(manager, "KnownWordsRewardManager"),
        ]
    )
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    metrics = run.steps[1]
    assert metrics["response_length/mean"] == 32, context
    assert metrics["actor/ratio/segments_per_seq"] == pytest.approx(metrics["critic/score/mean"], abs=1e-6), context
    assert metrics["actor/ratio/words_fallback_frac"] == pytest.approx(0.25, abs=1e-9), context
    assert metrics["actor/ratio/segments_per_seq"] > math.ceil(32 / WINDOW), context  # words, not the window
    assert "word ids do not match" not in run.full_log, context
