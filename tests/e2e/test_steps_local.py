"""End-to-end: segment_rule=delimiters (``loss=maspo_steps``) in verl's real trainer on CPU, on the
embedded byte-level model (each byte one token). The driver resolves the strings against the embedded
tokenizer at start-up (after the local mode has chosen the model), each actor worker against the tokenizer
verl gives it; the loss's segments per sequence are checked against the count a reward manager computes
from the decoded text of the same responses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import manager_overrides

pytestmark = pytest.mark.e2e


def hydra_list(strings: list[str]) -> str:
    return "[" + ",".join('"' + s + '"' for s in strings) + "]"


@pytest.mark.slow
def test_segments_per_sequence_are_the_delimiters_in_the_batch(local_run):
    """2 mini-batches of 8 full-length (32-token) responses: verl's mean over micro-batches is the batch
    mean, so the loss's segments per sequence equal the mean expected count the reward logged."""
    from tests.e2e.reward_managers import DELIMITERS, STEP_MARKERS

    manager = Path(__file__).with_name("reward_managers.py")
    pl = "actor_rollout_ref.actor.policy_loss"
    run = local_run(
        [
            "loss=maspo_steps",
            f"{pl}.delimiters={hydra_list(DELIMITERS)}",
            f"{pl}.step_markers={hydra_list(STEP_MARKERS)}",
            f"{pl}.min_segment_len=0",
            f"{pl}.max_segment_len=0",
            *manager_overrides(manager, "DelimiterCountRewardManager"),
        ]
    )
    context = f"\n--- trainer log tail ---\n{run.tail()}"
    assert run.returncode == 0, f"trainer exited with {run.returncode}{context}"
    # start-up resolved the strings against the embedded tokenizer (256 bytes + 3 specials)
    assert "segment_rule=delimiters on " in run.log and "'s tokenizer (259 ids):" in run.log, context
    assert "  delimiter '. ': 0 ids; across two tokens: 1 ending '.' x 1 starting ' '" in run.log, context
    metrics = run.steps[1]
    assert metrics["response_length/mean"] == 32, context
    assert metrics["critic/score/mean"] > 1.5, context  # delimiters and markers were found
    assert metrics["actor/ratio/segments_per_seq"] == pytest.approx(metrics["critic/score/mean"], abs=1e-6), context
