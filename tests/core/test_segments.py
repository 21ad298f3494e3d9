"""Segmentation properties over generated inputs (docs/algorithms.md, "Segmentation rules")."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from maspo_verl import fsq
from maspo_verl.config import GranularLossConfig
from maspo_verl.core import segments
from maspo_verl.core.segments import compute
from maspo_verl.core.segments.rules import logprob

settings.register_profile("ci", deadline=None, max_examples=60)
settings.load_profile("ci")


@st.composite
def masks(draw, max_b=5, max_t=24):
    """Right-, left-padded, holed, empty and length-1 rows."""
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))
    rows = []
    for _ in range(B):
        n = draw(st.integers(0, T))
        kind = draw(st.sampled_from(["right", "left", "holes"]))
        if kind == "right":
            row = [1] * n + [0] * (T - n)
        elif kind == "left":
            row = [0] * (T - n) + [1] * n
        else:
            row = draw(st.lists(st.integers(0, 1), min_size=T, max_size=T))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


def rule_kwargs(draw, mask):
    B, T = mask.shape
    rule = draw(st.sampled_from(["fixed", "logprob", "tokenval"]))
    seed = draw(st.integers(0, 10_000))
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 4
    if draw(st.booleans()):
        lp[torch.rand(B, T, generator=g) < 0.1] = float("-inf")
    ids = 128264 + torch.randint(0, 65536, (B, T), generator=g)
    ids[torch.rand(B, T, generator=g) < 0.1] = 5  # text tokens
    min_len = draw(st.integers(0, 6))
    max_len = draw(st.sampled_from([0, max(min_len, 1), min_len + 3]))
    return dict(
        segment_rule=rule,
        old_log_prob=lp,
        token_ids=ids,
        segment_window=draw(st.integers(1, 8)),
        logprob_threshold=draw(st.floats(-1.0, 3.0)),
        logprob_per_sample=draw(st.booleans()),
        tokenval_threshold=draw(st.floats(0.0, 20.0)),
        tokenval_distance=draw(st.sampled_from(["id", "fsq_l1", "fsq_hamming"])),
        min_segment_len=min_len,
        max_segment_len=max_len,
    )


def boundaries_of(mask, segment_rule, old_log_prob=None, token_ids=None, **fields):
    config = GranularLossConfig(segment_rule=segment_rule, **fields)
    return segments.compute_boundaries(mask, config, old_log_prob=old_log_prob, token_ids=token_ids)


def ids_of(mask, segment_rule, old_log_prob=None, token_ids=None, **fields):
    config = GranularLossConfig(segment_rule=segment_rule, **fields)
    return segments.compute_segment_ids(mask, config, old_log_prob=old_log_prob, token_ids=token_ids)


def valid_ids(ids, mask, i):
    return ids[i][mask[i]].tolist()


@given(st.data())
def test_ids_contiguous_start_at_zero_and_ignore_padding(data):
    mask = data.draw(masks())
    kwargs = rule_kwargs(data.draw, mask)
    boundaries = boundaries_of(mask, **kwargs)
    ids = ids_of(mask, **kwargs)
    assert not (boundaries & ~mask).any(), "boundary on padding"
    assert (ids[~mask] == 0).all()
    for i in range(mask.shape[0]):
        seq = valid_ids(ids, mask, i)
        if not seq:
            continue
        assert seq[0] == 0
        steps = [b - a for a, b in zip(seq, seq[1:], strict=False)]
        assert set(steps) <= {0, 1}, f"ids not contiguous: {seq}"
        # an id changes exactly at a boundary
        bounds = boundaries[i][mask[i]].tolist()
        assert [s == 1 for s in steps] == bounds[1:]


@given(st.data())
def test_max_len_always_and_min_len_between_rule_boundaries(data):
    mask = data.draw(masks())
    kwargs = rule_kwargs(data.draw, mask)
    kwargs["segment_rule"] = data.draw(st.sampled_from(["fixed", "logprob"]))  # tokenval forces extra boundaries
    ids = ids_of(mask, **kwargs)
    for i in range(mask.shape[0]):
        seq = valid_ids(ids, mask, i)
        sizes = torch.bincount(torch.tensor(seq, dtype=torch.long)).tolist() if seq else []
        if kwargs["max_segment_len"]:
            assert max(sizes, default=0) <= kwargs["max_segment_len"]
        elif kwargs["min_segment_len"] > 1:
            # every segment but the row's last is at least min_len long
            assert all(s >= kwargs["min_segment_len"] for s in sizes[:-1]), (sizes, kwargs["min_segment_len"])


@given(st.data())
def test_packing_moves_each_rows_valid_tokens_to_its_front_in_order(data):
    mask = data.draw(masks())
    B, T = mask.shape
    x = torch.arange(B * T, dtype=torch.float32).view(B, T)
    packed = segments.Packed(mask)
    p = packed.pack(x, -1.0)
    for i in range(B):
        n = int(mask[i].sum())
        assert p[i, :n].tolist() == x[i][mask[i]].tolist()
        assert (p[i, n:] == -1.0).all()
        assert packed.valid[i].tolist() == [c < n for c in range(T)]
        assert packed.has_previous[i].tolist() == [0 < c < n for c in range(T)]
    assert torch.equal(packed.unpack(p, -2.0), torch.where(mask, x, -2.0))


@given(st.data())
def test_window_extremes(data):
    mask = data.draw(masks())
    T = mask.shape[1]
    one = ids_of(mask, "fixed", segment_window=1)
    whole = ids_of(mask, "fixed", segment_window=T + data.draw(st.integers(0, 5)))
    positions = mask.long().cumsum(-1) - 1
    assert torch.equal(one[mask], positions[mask])
    assert (whole == 0).all()


@given(st.data())
def test_logprob_threshold_extremes(data):
    mask = data.draw(masks())
    lp = -torch.rand(mask.shape) * 4
    huge = boundaries_of(mask, "logprob", old_log_prob=lp, logprob_threshold=1e9)
    tiny = boundaries_of(mask, "logprob", old_log_prob=lp, logprob_threshold=-1e9)
    assert torch.equal(huge, mask & (mask.long().cumsum(-1) == 1))  # GSPO-like: one segment
    assert torch.equal(tiny, mask)  # GRPO-like: every token


def test_logprob_rule_cuts_at_drops_and_per_sample_normalises():
    lp = torch.tensor([[-0.1, -0.1, -3.0, -3.1, -0.2, -5.0]])
    mask = torch.ones_like(lp, dtype=torch.bool)
    b = boundaries_of(mask, "logprob", old_log_prob=lp, logprob_threshold=1.0)
    assert b.tolist() == [[True, False, True, False, False, True]]
    # the same drops scaled by 10 give the same per-sample z-score boundaries
    b10 = boundaries_of(mask, "logprob", old_log_prob=lp * 10, logprob_threshold=1.0, logprob_per_sample=True)
    b1 = boundaries_of(mask, "logprob", old_log_prob=lp, logprob_threshold=1.0, logprob_per_sample=True)
    assert torch.equal(b1, b10)


def test_fsq_digit_distances_on_known_pairs():
    a = torch.tensor([16383, 0, 0, 65535, 5])
    b = torch.tensor([16384, 3, 1 << 14, 0, 5])
    levels = [4] * 8
    # 16383 = digits 3,3,3,3,3,3,3,0 ; 16384 = 0,0,0,0,0,0,0,1
    assert fsq.digits_distance(a, b, levels, "fsq_hamming").tolist() == [8, 1, 1, 8, 0]
    assert fsq.digits_distance(a, b, levels, "fsq_l1").tolist() == [22, 3, 1, 24, 0]
    # digit k is (c >> 2k) & 3
    c = torch.randint(0, 65536, (200,))
    d = torch.randint(0, 65536, (200,))
    l1 = sum(((c >> (2 * k)) & 3).sub((d >> (2 * k)) & 3).abs() for k in range(8))
    assert torch.equal(fsq.digits_distance(c, d, levels, "fsq_l1"), l1)
    # mixed radix levels
    assert fsq.digits_distance(torch.tensor([7]), torch.tensor([0]), [2, 3, 5], "fsq_l1").tolist() == [1 + 0 + 1]


def test_tokenval_text_tokens_are_their_own_segments():
    off = 128264
    ids = torch.tensor([[off + 10, off + 11, 500, off + 12, off + 4000, off + 4001, 128261]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    b = boundaries_of(mask, "tokenval", token_ids=ids, tokenval_threshold=2, tokenval_distance="id")
    assert b.tolist() == [[True, False, True, True, True, False, True]]


def test_min_len_keeps_the_stronger_boundary():
    lp = torch.tensor([[0.0, -1.5, 0.0, -4.0, 0.0, 0.0, 0.0, -2.0]])
    mask = torch.ones_like(lp, dtype=torch.bool)
    drops = logprob.logprob_drops(lp, segments.Packed(mask))[0]  # no padding: packed is token order
    assert drops.tolist()[0][1] == 1.5
    b = boundaries_of(mask, "logprob", old_log_prob=lp, logprob_threshold=1.0, min_segment_len=3)
    # drop 1.5 at t=1 is within 3 of the forced start; 4.0 at t=3 survives; 2.0 at t=7 is 4 away: kept
    assert b.tolist() == [[True, False, False, True, False, False, False, True]]


@given(st.data())
def test_fixed_ids_are_valid_position_over_window(data):
    """With min_segment_len <= W and max_segment_len 0 or >= W nothing moves the fixed rule's boundaries: the
    ids are (valid position) // W."""
    mask = data.draw(masks())
    window = data.draw(st.integers(1, 8))
    min_len = data.draw(st.integers(0, window))
    max_len = data.draw(st.sampled_from([0, window, window + 3]))
    config = GranularLossConfig(segment_window=window, min_segment_len=min_len, max_segment_len=max_len)
    position = (mask.long().cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(segments.compute_segment_ids(mask, config), position.div(window, rounding_mode="floor") * mask)
    # and the running count of the boundaries (the first valid token is one)
    general = (segments.compute_boundaries(mask, config).long().cumsum(-1) - 1).clamp(min=0) * mask
    assert torch.equal(segments.compute_segment_ids(mask, config), general)


def suppress(boundaries, scores, mask, min_len):
    """``compute.suppress_close`` in token order: the +inf scores of boundaries given as ``forced``."""
    packed = segments.Packed(mask)
    forced = boundaries & scores.isinf()
    kept = compute.suppress_close(
        packed.pack(boundaries & mask, False),
        packed.pack(scores.masked_fill(scores.isinf(), 0.0)),
        min_len,
        packed.pack(forced, False),
    )
    return packed.unpack(kept, False)


def reference_suppress(boundaries, scores, mask, min_len):
    """Loop reference: a boundary stays when it beats every boundary within min_len - 1 valid tokens
    (higher score, or an equal score and earlier), suppressed neighbours included."""
    out = torch.zeros_like(boundaries)
    for i in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[i, t]]
        cands = [(k, t) for k, t in enumerate(valid) if boundaries[i, t]]
        for k, t in cands:
            rivals = [(k2, t2) for k2, t2 in cands if t2 != t and abs(k2 - k) < min_len]
            s = float(scores[i, t])
            if all(s > float(scores[i, t2]) or (s == float(scores[i, t2]) and k < k2) for k2, t2 in rivals):
                out[i, t] = True
    return out


@given(st.data())
def test_suppress_close_matches_loop_reference(data):
    mask = data.draw(masks(max_t=30))
    B, T = mask.shape
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 10_000)))
    boundaries = mask & (torch.rand(B, T, generator=g) < data.draw(st.floats(0.1, 0.9)))
    scores = torch.randint(0, 4, (B, T), generator=g).float()  # many ties
    scores[torch.rand(B, T, generator=g) < 0.1] = float("inf")  # forced boundaries
    min_len = data.draw(st.integers(1, 7))
    got = suppress(boundaries, scores, mask, min_len)
    assert torch.equal(got, reference_suppress(boundaries, scores, mask, min_len) if min_len > 1 else boundaries)


def test_suppress_close_drops_a_boundary_whose_suppressor_is_dropped():
    """Documented behaviour: 7 . 8 . 9 with min_len 3 keeps only the 9; 9 . 8 . 9 keeps both 9s."""
    mask = torch.ones(2, 5, dtype=torch.bool)
    boundaries = torch.tensor([[1, 0, 1, 0, 1]] * 2, dtype=torch.bool)
    scores = torch.tensor([[7.0, 0, 8, 0, 9], [9.0, 0, 8, 0, 9]])
    got = suppress(boundaries, scores, mask, 3)
    assert got.tolist() == [[False, False, False, False, True], [True, False, False, False, True]]


@pytest.mark.parametrize("levels", [[4] * 8, [8, 5, 5, 5], [2, 3, 5], [300, 7], [2] * 10, [1000], [16] * 4])
@pytest.mark.parametrize("kind", ["fsq_l1", "fsq_hamming"])
def test_fsq_distance_matches_digit_definition(levels, kind):
    """Byte-sized digit groups read from tables equal the digit-by-digit definition."""
    size = math.prod(levels)
    g = torch.Generator().manual_seed(len(levels))
    a, b = torch.randint(0, size, (2, 4, 200), generator=g)
    expected, radix = torch.zeros_like(a), 1
    for level in levels:
        da, db = (a // radix) % level, (b // radix) % level
        expected += (da - db).abs() if kind == "fsq_l1" else (da != db).long()
        radix *= level
    got = fsq.digits_distance(a, b, levels, kind)
    assert got.dtype == torch.long and torch.equal(got, expected)
