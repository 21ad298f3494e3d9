"""A segment rule declares what it reads and how it falls back; everything else asks it.

A throw-away rule that needs the response ids is one class: it is selectable, validated, reaches the
ids of verl's micro-batch, can
serve as the words rule's fallback, and the start-up checks refuse it when the hook that brings the ids
is missing, all with no edit anywhere else.
"""

import pytest
import torch

from maspo_verl.batch import micro_batch_scope
from maspo_verl.config import GranularLossConfig
from maspo_verl.core import segments
from maspo_verl.core.segments import RESPONSE_IDS, SEGMENT_RULES, Candidates, SegmentRule, register_segment_rule
from maspo_verl.core.token_sets import inputs_needed, segment_rules
from maspo_verl.plugin import checks, hooks
from tests.helpers import actor_config, compose_config

NAME = "test_even_ids"


@pytest.fixture
def even_ids_rule():
    @register_segment_rule
    class EvenIds(SegmentRule):
        """A new segment at every even token id."""

        name = NAME
        needs = frozenset({RESPONSE_IDS})

        def candidates(self, config, packed, inputs):
            ids = packed.pack(inputs.get(RESPONSE_IDS))
            boundaries = packed.valid & (ids % 2 == 0)
            return Candidates(boundaries, torch.ones(boundaries.shape))

    yield SEGMENT_RULES[NAME]
    del SEGMENT_RULES[NAME]


def expected_ids(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Segment ids by hand: walk each row's valid tokens, a new segment at an even id (not the first)."""
    out = torch.zeros_like(ids)
    for b in range(ids.shape[0]):
        seg, seen = 0, False
        for t in range(ids.shape[1]):
            if not mask[b, t]:
                continue
            if seen and int(ids[b, t]) % 2 == 0:
                seg += 1
            out[b, t], seen = seg, True
    return out


def test_the_rule_reads_the_micro_batch_ids(even_ids_rule):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (5, 23), generator=g)
    mask = torch.rand(5, 23, generator=g) < 0.8
    config = actor_config(segment_rule=NAME).policy_loss
    assert inputs_needed(config) == {RESPONSE_IDS} and segment_rules(config) == (even_ids_rule,)
    with micro_batch_scope({"responses": ids}):
        got = segments.compute_segment_ids(mask, config)
    assert torch.equal(got * mask, expected_ids(ids, mask))


def test_the_rule_can_be_the_words_fallback_and_is_validated(even_ids_rule):
    config = GranularLossConfig(loss_mode="maspo", segment_rule="words", words_fallback_rule=NAME)
    assert [r.name for r in segment_rules(config)] == ["words", NAME]
    with pytest.raises(ValueError, match=rf"words_fallback_rule='words' is invalid: allowed .*{NAME}"):
        GranularLossConfig(loss_mode="maspo", segment_rule="words", words_fallback_rule="words")


def test_start_up_refuses_the_rule_without_the_ids_hook(even_ids_rule, monkeypatch):
    config = compose_config("loss=maspo_fixed", f"actor_rollout_ref.actor.policy_loss.segment_rule={NAME}")
    assert checks.run_startup_checks(config) == []
    monkeypatch.setitem(hooks.PATCHES, "ppo_loss", "ppo_loss has another signature")
    with pytest.raises(RuntimeError, match=rf"segment_rule='{NAME}' is unavailable: ppo_loss has another signature"):
        checks.run_startup_checks(config)


@pytest.mark.parametrize(
    ("example", "problem"),
    [
        (
            segments.Example("ragged", ((1, 1), (1,)), ((2,), (1,))),
            r"mask rows must all have one length, got lengths \[2, 1\]",
        ),
        (segments.Example("lengths off", ((1, 1, 0),), ((1, 2),)), r"row 0: segment lengths \(1, 2\) must be >= 1 and"),
        (
            segments.Example("short input", ((1, 1),), ((2,),), inputs={segments.OLD_LOG_PROB: ((-1.0,),)}),
            r"inputs\['old_log_prob'\] has rows of lengths \[1\]; the mask has 1 rows of 2",
        ),
    ],
)
def test_a_malformed_example_is_refused_at_registration_naming_it(example, problem):
    """A worked example whose shapes do not fit fails when the rule registers, naming the rule and the example,
    not later with a raw torch error."""

    class Malformed(SegmentRule):
        """A new segment nowhere."""

        name = "test_malformed"
        examples = (segments.Example("fine", ((1,),), ((1,),)), example)

    message = rf"segment rule 'test_malformed', example 1 \('{example.why}'\): " + problem
    with pytest.raises(ValueError, match=message):
        register_segment_rule(Malformed)
    assert "test_malformed" not in SEGMENT_RULES
