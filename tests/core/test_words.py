"""segment_rule=words: word ids (hand-made, and from hand-made word times through the speech reward's
mapping) -> the expected segments; gaps, overlaps, short words, words past the end, padding on either
side, holes, min/max lengths, the fallback rule and its metric, and the micro-batch as verl hands it
over (jagged tensors, a synthetic padding sample)."""

from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from maspo_verl.batch import NO_WORD, WORD_IDS_KEY, current_word_ids, micro_batch_scope
from maspo_verl.core.segments import SEGMENT_RULES, compute_segment_ids
from maspo_verl.core.segments.rules.words import WORDS_FALLBACK_METRIC
from maspo_verl.speech.asr import TimedWord
from maspo_verl.speech.spans import word_token_ids
from tests.helpers import actor_config

_ = NO_WORD


def words_config(**fields):
    fields.setdefault("words_fallback_rule", "fixed")
    fields.setdefault("segment_window", 4)
    return actor_config(segment_rule="words", **fields).policy_loss


def segments(words, mask=None, config=None, **data):
    words = torch.as_tensor(words)
    mask = torch.ones(words.shape, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    metrics = {}
    with micro_batch_scope({WORD_IDS_KEY: words, **data}):
        ids = compute_segment_ids(mask, config or words_config(), metrics=metrics)
    return ids, {k: v.item() for k, v in metrics.items()}


def test_each_word_and_each_gap_is_a_segment():
    ids, metrics = segments([[_, _, 0, 0, 0, _, 1, 1, 2, 2, 2, _]])
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 3, 3, 4, 4, 4, 5]]
    assert metrics == {WORDS_FALLBACK_METRIC: 0.0}
    # adjacent words without a gap; a word of one token; the same id on both sides of another word
    ids, _m = segments([[0, 0, 1, 2, 2, 2, 3, 0, 0]])
    assert ids.tolist() == [[0, 0, 1, 2, 2, 2, 3, 4, 4]]


def test_word_times_to_segments():
    """Hand-made word times at 50 tokens/s over a 20-token response: gaps, a one-token overlap (the later
    word takes it), a word shorter than one token, a word past the end, a word before the start."""
    words = [
        TimedWord(" early", -0.5, -0.1),  # before the start: no token
        TimedWord(" the", 0.02, 0.09),  # tokens 1..4 (ceil(4.5) = 5)
        TimedWord(" cat", 0.085, 0.15),  # floor(4.25) = 4: shares token 4 with "the" and takes it
        TimedWord(" a", 0.201, 0.205),  # shorter than one token: token 10 only
        TimedWord(" sat", 0.25, 0.5),  # past the end (20 tokens = 0.4 s): tokens 12..19
        TimedWord(" late", 0.45, 0.6),  # starts after the end: no token
    ]
    ids = word_token_ids(words, 20)
    assert ids == [_, 1, 1, 1, 2, 2, 2, 2, _, _, 3, _, 4, 4, 4, 4, 4, 4, 4, 4]
    seg, _m = segments([ids])
    assert seg.tolist() == [[0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 4, 5, 6, 6, 6, 6, 6, 6, 6, 6]]
    assert word_token_ids(words, 0) == []
    assert word_token_ids([], 3) == [_, _, _]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_on_either_side(side):
    row = [_, 0, 0, 1, 1, 1, _]
    pad = [_, _, _]
    words = [row + pad] if side == "right" else [pad + row]
    mask = [[1] * 7 + [0] * 3] if side == "right" else [[0] * 3 + [1] * 7]
    ids, _m = segments(words, mask)
    expected = [0, 1, 1, 2, 2, 2, 3]
    assert ids.tolist() == ([expected + [0] * 3] if side == "right" else [[0] * 3 + expected])


def test_holes_continue_the_word_across_the_hole():
    """Masked tokens (tool outputs) do not split a word; 'previous token' is the previous valid one."""
    words = [[0, 0, 7, 7, 0, 1, 1, _, 1]]
    mask = [[1, 1, 0, 0, 1, 1, 1, 0, 1]]
    ids, _m = segments(words, mask)
    assert ids.tolist() == [[0, 0, 0, 0, 0, 1, 1, 0, 1]]


def test_min_len_joins_short_gaps_to_the_word_before_and_max_len_splits_long_words():
    words = [[0, 0, 0, _, 1, 1, 1, 1, 1, 1, 1, _, _, _]]
    ids, _m = segments(words, config=words_config(min_segment_len=2))
    assert ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2]]
    ids, _m = segments(words, config=words_config(max_segment_len=3))
    assert ids.tolist() == [[0, 0, 0, 1, 2, 2, 2, 3, 3, 3, 4, 5, 5, 5]]


def test_rows_without_words_take_the_fallback_rule_and_are_counted():
    words = [[0, 0, 1, 1, 1, 1, 1, 1], [_] * 8, [_] * 8, [0] * 8]
    mask = [[1] * 8, [1] * 8, [0] * 8, [0, 0, 0, 0, 0, 0, 0, 1]]  # row 2: all padding, not counted
    ids, metrics = segments(words, mask, config=words_config(words_fallback_rule="fixed", segment_window=3))
    assert ids[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert ids[1].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert ids[3].tolist()[-1] == 0
    assert metrics[WORDS_FALLBACK_METRIC] == pytest.approx(1 / 3)
    # a word id on padding only does not count as a word
    ids, metrics = segments([[_, _, 5, 5]], [[1, 1, 0, 0]])
    assert metrics[WORDS_FALLBACK_METRIC] == 1.0


def test_tokenval_fallback_reads_the_response_ids():
    config = actor_config(
        segment_rule="words",
        words_fallback_rule="tokenval",
        tokenval_distance="id",
        tokenval_threshold=5.0,
        codec_offset=100,
        codec_size=1000,
    ).policy_loss
    responses = torch.tensor([[100, 101, 120, 121, 7, 122], [100, 101, 120, 121, 7, 122]])
    ids, metrics = segments([[0, 0, 0, 1, 1, 1], [_] * 6], config=config, responses=responses)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 3]]
    assert metrics[WORDS_FALLBACK_METRIC] == 0.5


def test_micro_batch_as_verl_hands_it_over():
    """Jagged rows (verl's TransferQueue fields), right-padded to the loss width; a row whose ids do not
    match its response length (verl's synthetic padding sample copies another sample's fields) and a
    micro-batch without the key have no words."""
    responses = torch.nested.nested_tensor([torch.arange(5), torch.arange(3), torch.arange(1)], layout=torch.jagged)
    words = torch.nested.nested_tensor(
        [torch.tensor([0, 0, _, 1, 1]), torch.tensor([2, 2, 2]), torch.tensor([0, 0, 1, 1, 1, 1])],
        layout=torch.jagged,
    )
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    with micro_batch_scope({"responses": responses, WORD_IDS_KEY: words}):
        got = current_word_ids(mask)
    assert got.tolist() == [[0, 0, _, 1, 1], [2, 2, 2, _, _], [_] * 5]
    with micro_batch_scope({"responses": responses}):
        assert (current_word_ids(mask) == NO_WORD).all()
    with pytest.raises(RuntimeError, match="micro-batch"):
        current_word_ids(mask)


def test_loss_reports_segments_and_fallback_in_its_metrics():
    old = torch.zeros(3, 6, dtype=torch.float64)
    new = (old + 0.01 * torch.arange(18, dtype=torch.float64).reshape(3, 6)).requires_grad_()
    adv = torch.ones(3, 6, dtype=torch.float64)
    mask = torch.ones(3, 6, dtype=torch.bool)
    config = actor_config(segment_rule="words", words_fallback_rule="fixed", segment_window=6)
    words = torch.tensor([[0, 0, _, 1, 1, 1], [_] * 6, [0, 1, 2, 3, 4, 5]])
    with micro_batch_scope({WORD_IDS_KEY: words}):
        loss, metrics = get_policy_loss_fn("maspo")(old, new, adv, mask, "token-mean", config)
    assert torch.isfinite(loss)
    assert metrics["actor/ratio/segments_per_seq"] == pytest.approx((3 + 1 + 6) / 3)
    assert metrics[WORDS_FALLBACK_METRIC] == pytest.approx(1 / 3)


def test_fallback_rule_is_validated():
    # every rule without a fallback of its own may be one, and only those
    allowed = [name for name, rule in SEGMENT_RULES.items() if rule.fallback_field is None]
    assert "words" not in allowed and {"fixed", "logprob", "tokenval"} <= set(allowed)
    expected = r"words_fallback_rule='words' is invalid: allowed one of " + ", ".join(allowed)
    with pytest.raises(ValueError, match=expected):
        actor_config(segment_rule="words", words_fallback_rule="words")
    with pytest.raises(ValueError, match="words_fallback_rule"):
        actor_config(segment_rule="words", words_fallback_rule="silence")
