"""The dry run shows the ``policy_loss`` fields the chosen loss reads (``maspo_verl.main.unread_fields``)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from maspo_verl.config import SETTINGS
from maspo_verl.main import unread_fields
from maspo_verl.reference import compose_config


def policy_loss(*overrides: str) -> dict:
    return OmegaConf.to_container(compose_config(*overrides).actor_rollout_ref.actor.policy_loss, resolve=True)


def test_verls_losses_read_none_of_our_fields():
    for preset in ("grpo", "gspo"):
        pl = policy_loss(f"loss={preset}")
        assert set(unread_fields(pl)) == {s.name for s in SETTINGS} & set(pl)


def test_ctpo_reads_no_segmentation_and_no_length_exponent():
    unread = set(unread_fields(policy_loss("loss=ctpo")))
    assert {"segment_rule", "min_segment_len", "segment_window", "tokenval_threshold", "length_exponent"} <= unread
    assert not {"ctpo_mode", "clip_schedule", "log_clip_low", "clip_exponent", "surrogate"} & unread


@pytest.mark.parametrize(("schedule", "hidden"), [("ratio", True), ("log_adaptive", False)])
def test_the_log_adaptive_bounds_only_with_that_schedule(schedule, hidden):
    unread = set(
        unread_fields(policy_loss("loss=maspo_fixed", f"actor_rollout_ref.actor.policy_loss.clip_schedule={schedule}"))
    )
    assert ({"log_clip_low", "log_clip_high", "log_clip_dual", "clip_exponent"} <= unread) is hidden
    assert "clip_schedule" not in unread


def test_maspo_reads_its_rule_and_the_segmentation_only():
    unread = set(unread_fields(policy_loss("loss=maspo_fixed")))
    assert not {"segment_rule", "segment_window", "min_segment_len", "length_exponent"} & unread
    assert {"tokenval_threshold", "logprob_threshold", "ctpo_mode", "delimiters"} <= unread
