"""Who shares a ratio: contiguous segments of a response (docs/algorithms.md, "Segmentation rules").

A rule (a ``SegmentRule`` in ``SEGMENT_RULES``, selected by ``policy_loss.segment_rule``) turns
[B, T] inputs into a boolean *boundary* tensor (True where a new segment starts), a boundary
*score* used by ``min_segment_len`` suppression and the boundaries that must stay; ``segment_ids``
turns boundaries into ids. Rules read their settings from the policy-loss config
(``maspo_verl.config.GranularLossConfig``), the one source of defaults. All functions are vectorised
over [B, T]: no Python loop over tokens or samples, no host sync.

Masks may be right- or left-padded and may contain holes (multi-turn tool outputs); "previous
token" always means the previous *valid* token, and positions count valid tokens only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from maspo_verl.batch import NO_WORD, current_response_ids, current_word_ids
from maspo_verl.ratios import float_mask
from maspo_verl.util import registrar

TOKENVAL_DISTANCES = ("id", "fsq_l1", "fsq_hamming")
# Per-sample logprob rule: sigma floor (nats) so a sample whose drops are all equal gets no boundaries.
STD_FLOOR = 1e-3
# Words rule: share of the rows with valid tokens and no word that took the fallback rule.
WORDS_FALLBACK_METRIC = "actor/ratio/words_fallback_frac"
# Drops of non-finite log-probs (-inf old log-prob) are clamped to this magnitude.
MAX_DROP = 1e4


def valid_positions(mask: torch.Tensor) -> torch.Tensor:
    """Index of each token among the valid tokens of its row (0-based; padding gets garbage >= -1)."""
    return torch.cumsum(mask.long(), dim=-1) - 1


def _valid_count(mask: torch.Tensor) -> torch.Tensor:
    """Number of valid tokens up to and including each position, int32 (cheaper than int64 on CPU;
    rows are far shorter than 2**31)."""
    return torch.cumsum(mask, dim=-1, dtype=torch.int32)


def first_valid(mask: torch.Tensor) -> torch.Tensor:
    """True on the first valid token of each row."""
    mask = mask.bool()
    return mask & (_valid_count(mask) == 1)


def previous_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """For each position, the index of the previous valid token in its row (-1 when there is none)."""
    mask = mask.bool()
    # (index + 1) on valid tokens, 0 elsewhere; its running max, shifted by one, is the previous valid index + 1
    idx = torch.arange(1, mask.shape[-1] + 1, device=mask.device, dtype=torch.int32).mul(mask)
    last = torch.cummax(idx, dim=-1).values
    prev = torch.empty(mask.shape, dtype=torch.long, device=mask.device)
    prev[..., 0] = -1
    torch.sub(last[..., :-1], 1, out=prev[..., 1:])
    return prev


def _gather_previous(x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    return torch.gather(x, -1, prev.clamp(min=0))


def fixed_boundaries(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Boundary where (index among valid tokens) mod W == 0 (``arange(T) // W`` on valid tokens)."""
    mask = mask.bool()
    if window == 1:
        return mask
    pos = _valid_count(mask).sub_(1).float()  # exact below 2**24
    return mask & (pos.div(window).floor_().mul_(window) == pos)


def logprob_drops(old_log_prob: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d_t = lp_prev - lp_t over valid neighbours; returns (drops, has_previous)."""
    mask = mask.bool()
    lp = torch.nan_to_num(old_log_prob.float(), nan=0.0, neginf=-MAX_DROP, posinf=MAX_DROP)
    prev = previous_valid_index(mask)
    has_prev = mask & (prev >= 0)
    drop = _gather_previous(lp, prev).sub_(lp).clamp_(-MAX_DROP, MAX_DROP)
    # zero where there is no previous valid token (a product: finite drops, cheaper than a select)
    return drop.mul_(float_mask(has_prev)), has_prev


def logprob_scores(old_log_prob: torch.Tensor, mask: torch.Tensor, per_sample: bool) -> torch.Tensor:
    """Boundary score of the logprob rule: the drop, or its per-sample z-score."""
    drop, has_prev = logprob_drops(old_log_prob, mask)
    if not per_sample:
        return drop
    w = float_mask(has_prev, drop.dtype)
    n = w.sum(-1, keepdim=True).clamp(min=1.0)
    mu = drop.sum(-1, keepdim=True) / n  # drop is zero where w is
    centred = drop.sub_(mu)
    var = centred.square().mul_(w).sum(-1, keepdim=True) / n
    return centred.div_(var.sqrt().clamp(min=STD_FLOOR))


def _digits_slice(x: torch.Tensor, radix: int, size: int, out: torch.Tensor) -> torch.Tensor:
    """(x // radix) % size into ``out``: a shift and a mask when both are powers of two."""
    if radix & (radix - 1) == 0 and size & (size - 1) == 0:
        return torch.bitwise_right_shift(x, radix.bit_length() - 1, out=out).bitwise_and_(size - 1)
    return torch.div(x, radix, rounding_mode="floor", out=out).remainder_(size)


def _digit_loop(a: torch.Tensor, b: torch.Tensor, levels: Sequence[int], kind: str, radix: int = 1) -> torch.Tensor:
    """The distance digit by digit (the definition; also fills the lookup tables)."""
    dist = torch.zeros_like(a)
    da, db = torch.empty_like(a), torch.empty_like(b)
    for level in levels:
        _digits_slice(a, radix, level, da)
        _digits_slice(b, radix, level, db)
        dist.add_(da.sub_(db).abs_() if kind == "fsq_l1" else da.ne_(db))
        radix *= level
    return dist


# Digits are looked up in groups whose codes fit one byte: a table of all 256 x 256 pairs per group.
_GROUP_CODES = 256


@functools.lru_cache(maxsize=16)
def _pair_table(levels: tuple[int, ...], kind: str, device: str) -> torch.Tensor:
    """table[i * P + j] = distance between the codes i, j < P = prod(levels) (uint8: at most P - 1)."""
    size = math.prod(levels)
    i = torch.arange(size, dtype=torch.int32).repeat_interleave(size)
    j = torch.arange(size, dtype=torch.int32).repeat(size)
    return _digit_loop(i, j, levels, kind).to(torch.uint8).to(device)


def _digit_groups(levels: Sequence[int]) -> list[tuple[int, ...]]:
    """Consecutive digits grouped while their codes fit a byte (a larger level stays alone)."""
    groups, current = [], []
    for level in levels:
        if current and math.prod(current) * level > _GROUP_CODES:
            groups.append(tuple(current))
            current = []
        current.append(level)
    return groups + [tuple(current)]


def fsq_digits_distance(a: torch.Tensor, b: torch.Tensor, levels: Sequence[int], kind: str) -> torch.Tensor:
    """Distance between FSQ codes a, b in [0, prod(levels)) split into mixed-radix digits (digit 0
    least significant).

    ``fsq_l1``: sum_k |a_k - b_k|; ``fsq_hamming``: sum_k [a_k != b_k]. For XCodec2's [4]*8,
    digit k is (c >> 2k) & 3. Digits are taken a byte's worth at a time (four 2-bit digits) and
    their distance read from a table of all pairs, so [4]*8 costs two lookups; never loops over tokens.
    """
    levels = list(levels)
    # int32 when the codes fit: several times faster than int64 on CPU
    dtype = torch.int32 if math.prod(levels) < 2**31 else torch.long
    a, b = a.to(dtype), b.to(dtype)
    dist = None
    ga, gb = torch.empty_like(a), torch.empty_like(b)
    radix = 1
    for group in _digit_groups(levels):
        size = math.prod(group)
        if size > _GROUP_CODES:  # one large digit: compute it directly
            part = _digit_loop(a, b, group, kind, radix)
        else:
            _digits_slice(a, radix, size, ga)
            _digits_slice(b, radix, size, gb)
            pair = ga.mul_(size).add_(gb)
            table = _pair_table(group, kind, str(a.device))
            part = table.index_select(0, pair.reshape(-1)).view(a.shape)
        dist = part.to(dtype) if dist is None else dist.add_(part)
        radix *= size
    return dist.long()


def tokenval_scores(
    token_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    codec_offset: int,
    codec_size: int,
    distance: str,
    fsq_levels: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distance between neighbouring codec codes; returns (distance, outside_codec_boundary).

    A token outside [codec_offset, codec_offset + codec_size) (text, special tokens), and the
    token after it, start segments of their own: the second tensor marks them.
    """
    mask = mask.bool()
    ids = token_ids.long()
    in_codec = (ids >= codec_offset) & (ids < codec_offset + codec_size)
    # code + 1 inside the codec, 0 outside: one gather brings the previous token's code and membership
    dtype = torch.int32 if codec_size < 2**31 else torch.long
    code1 = (ids - (codec_offset - 1)).to(dtype).mul_(in_codec)
    prev = previous_valid_index(mask)
    has_prev = mask & (prev >= 0)
    prev_code1 = _gather_previous(code1, prev)
    both = mask & in_codec & has_prev & (prev_code1 > 0)
    if distance == "id":
        dist = (code1 - prev_code1).abs_().long()
    else:
        dist = fsq_digits_distance(code1.sub_(1).clamp_(min=0), prev_code1.sub_(1).clamp_(min=0), fsq_levels, distance)
    return dist.mul_(both), has_prev & ~both


def suppress_close(boundaries: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor, min_len: int) -> torch.Tensor:
    """Non-maximum suppression: drop a boundary within ``min_len - 1`` tokens of a stronger one.

    Distances count valid tokens. Boundaries are ordered by score, ties going to the earlier one
    (a strict total order); boundaries that must stay (the first valid token, tokens outside the
    codec) carry score +inf. A boundary survives when it is the strongest of all boundaries within
    ``min_len - 1`` valid tokens on either side, *suppressed ones included*, so no two survivors
    are closer than ``min_len``. Two consequences: a boundary can be dropped by a stronger neighbour
    that is itself dropped (in 9 . 8 . 9 with min_len 3 the 9s survive, the 8 goes, but in 7 . 8 . 9
    only the 9 survives: the 7 is dropped by the 8, which the 9 drops), and the row's last segment may
    be shorter than ``min_len``.

    Linear in T: the strongest earlier and later neighbours come from one sliding-window max over
    each row compacted to its valid tokens (strictly stronger than every earlier neighbour, at least
    as strong as every later one).
    """
    if min_len <= 1:
        return boundaries
    mask = mask.bool()
    B, T = boundaries.shape
    key = torch.where(boundaries, scores.float(), -math.inf)
    # compact each row to its valid tokens: slot = index among valid tokens (padding shares a valid
    # token's slot and carries -inf, so the max keeps the valid key)
    slot = _valid_count(mask).sub_(1).clamp_(min=0).long()
    pad = min_len - 1
    compact = torch.full((B, T + 2 * pad), -math.inf, device=key.device)
    compact[:, pad : pad + T].scatter_reduce_(-1, slot, key, "amax")
    # window max over the pad slots before each slot; slot p's later neighbours are the window at p + min_len
    before = torch.nn.functional.max_pool1d(compact.unsqueeze(1), pad, stride=1).squeeze(1)
    own = compact[:, pad : pad + T]
    keep = (own > before[:, :T]) & (own >= before[:, min_len : min_len + T])
    return boundaries & torch.gather(keep, -1, slot)


def split_long(boundaries: torch.Tensor, mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """Add a boundary every ``max_len`` valid tokens inside each segment."""
    if max_len <= 0:
        return boundaries
    mask = mask.bool()
    count = _valid_count(mask)  # valid position + 1
    # distance to the last boundary, in valid tokens (counts below 2**24 are exact in float32)
    since = count.sub(torch.cummax(count.mul(boundaries), dim=-1).values).float()
    # since % max_len == 0, without integer division
    on_grid = since.div(max_len).floor_().mul_(max_len) == since
    return boundaries | (mask & on_grid)


def segment_ids(boundaries: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Segment id of each token: 0 on the first valid token, +1 at each boundary; 0 on padding."""
    mask = mask.bool()
    b = (boundaries | first_valid(mask)) & mask
    return torch.cumsum(b, dim=-1, dtype=torch.int32).sub_(1).mul_(mask).long()


def fixed_window_ids(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Segment ids of the fixed rule without min/max length effects: (valid position) // W."""
    mask = mask.bool()
    # floor((count - 1) / W) in float32: exact for counts below 2**24; 0 on padding
    pos = _valid_count(mask).sub_(1).mul_(mask).float()
    return pos.div_(window).floor_().long()


@dataclass
class Candidates:
    """What a rule proposes: boundaries, their strength for min-length suppression, the boundaries
    that must stay whatever their neighbours (None: only the first valid token), and metrics of the
    rule (name -> 0-d tensor, moved to the host with the loss's other metrics)."""

    boundaries: torch.Tensor
    scores: torch.Tensor
    forced: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class SegmentRule:
    """A segmentation rule: ``candidates`` from the [B, T] inputs and the policy-loss config."""

    name: ClassVar[str]

    def candidates(self, config: Any, mask: torch.Tensor, old_log_prob, token_ids) -> Candidates:
        raise NotImplementedError

    def direct_ids(self, config: Any, mask: torch.Tensor) -> torch.Tensor | None:
        """Segment ids by a closed formula when there is one (None: go through the boundaries)."""
        return None


SEGMENT_RULES: dict[str, SegmentRule] = {}
# class decorator: the rule becomes selectable as ``policy_loss.segment_rule=<cls.name>``
register_segment_rule = registrar(SEGMENT_RULES)


@register_segment_rule
class FixedRule(SegmentRule):
    """A new segment every ``segment_window`` valid tokens."""

    name = "fixed"

    def candidates(self, config, mask, old_log_prob, token_ids):
        return Candidates(fixed_boundaries(mask, config.segment_window), torch.ones(mask.shape, device=mask.device))

    def direct_ids(self, config, mask):
        # min/max lengths cannot move boundaries that are W apart when min <= W and (max 0 or >= W)
        window, min_len, max_len = config.segment_window, config.min_segment_len, config.max_segment_len
        if min_len <= window and (max_len == 0 or max_len >= window):
            return fixed_window_ids(mask, window)
        return None


@register_segment_rule
class LogprobRule(SegmentRule):
    """A new segment where the old policy's log-prob drops by more than ``logprob_threshold``
    (``logprob_per_sample``: in units of the sample's own drop mean and standard deviation)."""

    name = "logprob"

    def candidates(self, config, mask, old_log_prob, token_ids):
        if old_log_prob is None:
            raise ValueError("segment_rule='logprob' needs old_log_prob")
        scores = logprob_scores(old_log_prob, mask, config.logprob_per_sample)
        return Candidates(mask & (scores > config.logprob_threshold), scores)


@register_segment_rule
class TokenvalRule(SegmentRule):
    """A new segment where neighbouring codec codes differ by more than ``tokenval_threshold``;
    tokens outside the codec range are segments of their own. Needs the response token ids (given,
    or those of the verl micro-batch in scope)."""

    name = "tokenval"

    def candidates(self, config, mask, old_log_prob, token_ids):
        if token_ids is None:
            token_ids = current_response_ids(mask)
        dist, outside = tokenval_scores(
            token_ids,
            mask,
            codec_offset=config.codec_offset,
            codec_size=config.codec_size,
            distance=config.tokenval_distance,
            fsq_levels=config.fsq_levels,
        )
        scores = dist.float()
        return Candidates(mask & (scores > config.tokenval_threshold), scores, outside)


@register_segment_rule
class WordsRule(SegmentRule):
    """One segment per recognised word: a new segment wherever the word id (``maspo_verl.batch``:
    the index of the ASR word a token belongs to, -1 between words) differs from the previous valid
    token's. Gaps between words (silence, breaths, tokens outside the codec) are segments of their
    own; a word start outranks a gap start, so with ``min_segment_len`` a gap shorter than that joins
    the word before it. A row with no word among its valid tokens (no word times: ASR returned
    none, non-speech, decode failure, ids absent) takes ``words_fallback_rule`` instead, counted in
    ``actor/ratio/words_fallback_frac``. The fallback's candidates are computed for the whole batch
    and selected per row (no host sync)."""

    name = "words"

    def candidates(self, config, mask, old_log_prob, token_ids):
        # the fallback first, so that its temporaries are freed before ours exist (peak memory)
        fallback = SEGMENT_RULES[config.words_fallback_rule].candidates(config, mask, old_log_prob, token_ids)
        words = current_word_ids(mask)
        prev = previous_valid_index(mask)
        starts = mask & (prev >= 0)
        starts &= words != torch.gather(words, -1, prev.clamp_(min=0))
        del prev
        is_word = words != NO_WORD
        del words
        has_words = (mask & is_word).any(-1, keepdim=True)
        scores = torch.where(has_words, torch.where(is_word, 2.0, 1.0), fallback.scores.float())
        del is_word
        fallback_forced = torch.zeros_like(mask) if fallback.forced is None else fallback.forced
        rows = mask.any(-1, keepdim=True)
        fell_back = (rows & ~has_words).sum().to(torch.float64) / rows.sum().clamp(min=1).to(torch.float64)
        return Candidates(
            torch.where(has_words, starts, fallback.boundaries),
            scores,
            has_words.logical_not() & fallback_forced,
            {**fallback.metrics, WORDS_FALLBACK_METRIC: fell_back},
        )


def compute_boundaries(
    mask: torch.Tensor,
    config: Any,
    *,
    old_log_prob: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    metrics: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Boundaries of ``config.segment_rule``, then ``min_segment_len`` / ``max_segment_len``; the
    rule's metrics go into ``metrics`` when given."""
    mask = mask.bool()
    rule = SEGMENT_RULES.get(config.segment_rule)
    if rule is None:
        raise ValueError(f"segment_rule={config.segment_rule!r} is invalid: allowed {', '.join(SEGMENT_RULES)}")
    found = rule.candidates(config, mask, old_log_prob, token_ids)
    if metrics is not None:
        metrics.update(found.metrics)
    forced = first_valid(mask) if found.forced is None else first_valid(mask) | found.forced
    scores = torch.where(forced, math.inf, found.scores)
    b = suppress_close(found.boundaries | forced, scores, mask, config.min_segment_len) | forced
    return split_long(b, mask, config.max_segment_len) & mask


def compute_segment_ids(
    mask: torch.Tensor,
    config: Any,
    *,
    old_log_prob: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    metrics: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Segment ids of ``compute_boundaries``, by the rule's closed formula where it has one."""
    rule = SEGMENT_RULES.get(config.segment_rule)
    direct = rule.direct_ids(config, mask) if rule is not None else None
    if direct is not None:
        return direct
    boundaries = compute_boundaries(mask, config, old_log_prob=old_log_prob, token_ids=token_ids, metrics=metrics)
    return segment_ids(boundaries, mask)
