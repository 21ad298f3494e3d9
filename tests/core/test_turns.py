"""segment_rule=turns: one segment per contiguous run of valid tokens (an assistant turn between masked environment
tokens), optionally cut into ``turn_window`` windows; against a loop over tokens, for any padding."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from maspo_verl.core.segments import compute_segment_ids
from tests.helpers import actor_config


def expected_ids(mask: torch.Tensor, window: int, min_len: int = 0) -> torch.Tensor:
    """By hand: walk each row; a new segment at the start of each run of valid tokens and every ``window``
    tokens inside it (min_len never joins two turns and cannot merge windows that are >= min_len apart)."""
    out = torch.zeros(mask.shape, dtype=torch.long)
    for b in range(mask.shape[0]):
        seg, since, previous_valid = -1, 0, False
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                previous_valid = False
                continue
            starts_turn = not previous_valid
            if starts_turn or (window and since == window):
                seg, since = seg + 1, 0
            out[b, t], previous_valid = seg, True
            since += 1
    return out


def holes_mask(B, T, seed, left_pad=False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    if left_pad:
        pad = pad.flip(-1)
    return mask & ~pad


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    window=st.sampled_from([0, 1, 2, 3, 7]),
    left_pad=st.booleans(),
)
def test_turns_are_the_runs_of_valid_tokens(seed, window, left_pad):
    mask = holes_mask(5, 31, seed, left_pad)
    config = actor_config(segment_rule="turns", turn_window=window).policy_loss
    got = compute_segment_ids(mask, config)
    assert torch.equal(got * mask, expected_ids(mask, window))


@pytest.mark.parametrize("min_len", [2, 5, 40])
def test_min_segment_len_never_joins_two_turns(min_len):
    mask = holes_mask(6, 40, seed=3)
    config = actor_config(segment_rule="turns", min_segment_len=min_len).policy_loss
    assert torch.equal(compute_segment_ids(mask, config) * mask, expected_ids(mask, 0))


def test_one_turn_is_one_segment_and_a_window_of_one_is_every_token():
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)  # right, left padding
    one = compute_segment_ids(mask, actor_config(segment_rule="turns").policy_loss)
    assert (one * mask).max() == 0
    every = compute_segment_ids(mask, actor_config(segment_rule="turns", turn_window=1).policy_loss)
    assert torch.equal(every[mask], torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]))
