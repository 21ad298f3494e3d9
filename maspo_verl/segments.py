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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from maspo_verl.batch import NO_WORD, current_response_ids, current_word_ids
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


def first_valid(mask: torch.Tensor) -> torch.Tensor:
    """True on the first valid token of each row."""
    mask = mask.bool()
    return mask & (torch.cumsum(mask.long(), dim=-1) == 1)


def previous_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """For each position, the index of the previous valid token in its row (-1 when there is none)."""
    mask = mask.bool()
    idx = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.cummax(torch.where(mask, idx, torch.full_like(idx, -1)), dim=-1).values
    return torch.nn.functional.pad(last[..., :-1], (1, 0), value=-1)


def _gather_previous(x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    return torch.gather(x, -1, prev.clamp(min=0))


def fixed_boundaries(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Boundary where (index among valid tokens) mod W == 0 (``arange(T) // W`` on valid tokens)."""
    mask = mask.bool()
    return mask & (valid_positions(mask) % window == 0)


def logprob_drops(old_log_prob: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d_t = lp_prev - lp_t over valid neighbours; returns (drops, has_previous)."""
    mask = mask.bool()
    lp = torch.nan_to_num(old_log_prob.float(), nan=0.0, neginf=-MAX_DROP, posinf=MAX_DROP)
    prev = previous_valid_index(mask)
    has_prev = mask & (prev >= 0)
    drop = (_gather_previous(lp, prev) - lp).clamp(-MAX_DROP, MAX_DROP)
    return torch.where(has_prev, drop, torch.zeros_like(drop)), has_prev


def logprob_scores(old_log_prob: torch.Tensor, mask: torch.Tensor, per_sample: bool) -> torch.Tensor:
    """Boundary score of the logprob rule: the drop, or its per-sample z-score."""
    drop, has_prev = logprob_drops(old_log_prob, mask)
    if not per_sample:
        return drop
    w = has_prev.to(drop.dtype)
    n = w.sum(-1, keepdim=True).clamp(min=1.0)
    mu = (drop * w).sum(-1, keepdim=True) / n
    var = (((drop - mu) ** 2) * w).sum(-1, keepdim=True) / n
    return (drop - mu) / var.sqrt().clamp(min=STD_FLOOR)


def fsq_digits_distance(a: torch.Tensor, b: torch.Tensor, levels: Sequence[int], kind: str) -> torch.Tensor:
    """Distance between FSQ codes a, b split into mixed-radix digits (digit 0 least significant).

    ``fsq_l1``: sum_k |a_k - b_k|; ``fsq_hamming``: sum_k [a_k != b_k]. For XCodec2's [4]*8,
    digit k is (c >> 2k) & 3. Loops over the K digits, never over tokens.
    """
    dist = torch.zeros(a.shape, dtype=torch.long, device=a.device)
    radix = 1
    for level in levels:
        da = torch.div(a, radix, rounding_mode="floor") % level
        db = torch.div(b, radix, rounding_mode="floor") % level
        dist += (da - db).abs() if kind == "fsq_l1" else (da != db).long()
        radix *= level
    return dist


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
    code = ids - codec_offset
    in_codec = (code >= 0) & (code < codec_size)
    code = torch.where(in_codec, code, torch.zeros_like(code))
    prev = previous_valid_index(mask)
    prev_code = _gather_previous(code, prev)
    prev_in = _gather_previous(in_codec.long(), prev).bool() & (prev >= 0)
    if distance == "id":
        dist = (code - prev_code).abs()
    else:
        dist = fsq_digits_distance(code, prev_code, fsq_levels, distance)
    forced = mask & (prev >= 0) & ~(in_codec & prev_in)
    return torch.where(mask & in_codec & prev_in, dist, torch.zeros_like(dist)), forced


def suppress_close(boundaries: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor, min_len: int) -> torch.Tensor:
    """Non-maximum suppression: drop a boundary within ``min_len - 1`` tokens of a stronger one.

    Distances count valid tokens. Ties go to the earlier boundary; boundaries that must stay
    (the first valid token, tokens outside the codec) carry score +inf. Strength is turned into a
    unique per-row rank first, so no two surviving boundaries are closer than ``min_len``.
    """
    if min_len <= 1:
        return boundaries
    T = boundaries.shape[-1]
    key = torch.where(boundaries, scores.float(), torch.full_like(scores, -math.inf, dtype=torch.float))
    # stable ascending sort of the reversed row: among equal keys the earlier token ranks higher
    order = torch.argsort(key.flip(-1), dim=-1, stable=True)
    rank_rev = torch.empty_like(order).scatter_(-1, order, torch.arange(T, device=key.device).expand_as(order))
    rank = torch.where(boundaries, rank_rev.flip(-1), torch.full_like(order, -1)).float()
    # pool over positions among valid tokens: compact each row (padding goes to a spare last slot)
    slot = torch.where(mask.bool(), valid_positions(mask), torch.full_like(order, T))
    compact = torch.full((rank.shape[0], T + 1), -1.0, device=rank.device).scatter_(-1, slot, rank)
    pooled = torch.nn.functional.max_pool1d(compact.unsqueeze(1), 2 * min_len - 1, stride=1, padding=min_len - 1)
    return boundaries & (rank == torch.gather(pooled.squeeze(1), -1, slot))


def split_long(boundaries: torch.Tensor, mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """Add a boundary every ``max_len`` valid tokens inside each segment."""
    if max_len <= 0:
        return boundaries
    pos = valid_positions(mask)
    start = torch.cummax(torch.where(boundaries, pos, torch.full_like(pos, -1)), dim=-1).values
    return boundaries | (mask.bool() & ((pos - start) % max_len == 0))


def segment_ids(boundaries: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Segment id of each token: 0 on the first valid token, +1 at each boundary; 0 on padding."""
    mask = mask.bool()
    b = (boundaries | first_valid(mask)) & mask
    return torch.where(mask, torch.cumsum(b.long(), dim=-1) - 1, 0)


def fixed_window_ids(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Segment ids of the fixed rule without min/max length effects: (valid position) // W."""
    return torch.where(mask.bool(), torch.div(valid_positions(mask), window, rounding_mode="floor"), 0)


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
        words = current_word_ids(mask)
        prev = previous_valid_index(mask)
        starts = mask & (prev >= 0) & (words != _gather_previous(words, prev))
        scores = torch.where(words != NO_WORD, 2.0, 1.0)
        has_words = (mask & (words != NO_WORD)).any(-1, keepdim=True)
        fallback = SEGMENT_RULES[config.words_fallback_rule].candidates(config, mask, old_log_prob, token_ids)
        fallback_forced = torch.zeros_like(mask) if fallback.forced is None else fallback.forced
        rows = mask.any(-1, keepdim=True)
        fell_back = (rows & ~has_words).sum().to(torch.float64) / rows.sum().clamp(min=1).to(torch.float64)
        return Candidates(
            torch.where(has_words, starts, fallback.boundaries),
            torch.where(has_words, scores, fallback.scores.float()),
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
