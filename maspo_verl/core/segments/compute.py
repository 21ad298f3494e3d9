"""Running a segmentation: the configured rule's candidates on the packed rows, then ``min_segment_len`` /
``max_segment_len`` (the same for every rule), then segment ids. One torch implementation, the same on CPU and GPU:
vectorised over [B, T], no host sync.

The settings declared here are the segmentation's own, shared by every rule."""

from __future__ import annotations

import math
from typing import Any

import torch

from maspo_verl.core.segments.registry import SEGMENT_RULES, configured_rule
from maspo_verl.core.segments.rule import Packed, RuleInputs, previous
from maspo_verl.core.tensors import float_mask
from maspo_verl.validation import Choice, Int, Setting, fail

SETTINGS = (
    Setting("segment_rule", "fixed", Choice(lambda: tuple(SEGMENT_RULES)), "which tokens share a ratio (`maspo`)"),
    Setting("min_segment_len", 0, Int(0), "suppress boundaries closer than this to a stronger one (0 = off)"),
    Setting("max_segment_len", 0, Int(0), "force a boundary every this many tokens inside a segment (0 = off)"),
)
# the key of a token that is no boundary (``suppress_close``)
_FLOOR = torch.finfo(torch.float32).max


def validate(config: Any) -> None:
    """The segmentation's checks across fields, then those of every rule."""
    if config.max_segment_len and config.max_segment_len < config.min_segment_len:
        fail(
            "max_segment_len",
            config.max_segment_len,
            f"0 (none) or an integer >= min_segment_len={config.min_segment_len}",
        )
    for rule in SEGMENT_RULES.values():
        rule.validate(config)


def token_level(config: Any) -> bool:
    """True when the settings give every token its own segment."""
    return getattr(config, "max_segment_len", 0) == 1 or configured_rule(config).token_level(config)


def compute_segment_ids(
    mask: torch.Tensor,
    config: Any,
    *,
    old_log_prob: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    metrics: dict[str, torch.Tensor] | None = None,
    log_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """The segment ids [B, T] (int64) of the rule ``config.segment_rule`` (with ``min_segment_len`` /
    ``max_segment_len``): the public entry point of the segmentation, for the loss and anything else that
    needs a rule's segments (a segment-level importance weight, the lab).

    - ``mask`` [B, T]: the tokens to segment (bool or 0/1); right-, left-padded or with holes.
    - ``config``: any object with the policy-loss fields (``GranularLossConfig``, or one from
      ``maspo_verl.config.actor_config(...).policy_loss``).
    - ``old_log_prob`` [B, T]: needed by rules that read it (``SegmentRule.needs``: logprob, surprisal).
    - ``token_ids`` [B, T]: the response ids; without them rules that read ids take them from the verl
      micro-batch in scope (``maspo_verl.batch``), as do rules that read word ids or the tokenizer.
    - ``metrics``: a dict that receives the rule's metrics (name -> 0-d tensor), if given.
    - ``log_ratio`` [B, T]: the detached token log-ratios log pi - log pi_old, needed by rules that read them
      (``adaptive``); the loss gives them.

    Returns ids counted from 0 in each row in token order over the valid tokens (padding: 0), on
    ``mask``'s device. No host sync.
    """
    packed = Packed(mask)
    inputs = RuleInputs(mask, config.segment_rule, old_log_prob, token_ids, log_ratio)
    # 1. the rule's candidates on the packed rows (the configured rule: inputs name it in errors)
    rule = SEGMENT_RULES.get(config.segment_rule) or configured_rule(config)  # (which names the allowed ones)
    proposed = rule.candidates(config, packed, inputs)
    if metrics is not None:
        metrics.update(proposed.metrics)
    forced = proposed.forced
    boundaries = proposed.boundaries if forced is None else proposed.boundaries | forced
    boundaries[:, :1] = packed.valid[:, :1]  # the first valid token starts a segment
    # 2. min_segment_len: forced boundaries outrank every other (+inf) and stay even next to each other
    if config.min_segment_len > 1:
        scores = proposed.scores.float()
        scores[:, :1].masked_fill_(boundaries[:, :1], math.inf)
        boundaries = suppress_close(boundaries, scores, config.min_segment_len, forced)
        if forced is not None:
            boundaries |= forced
    # 3. max_segment_len (what it adds past a row's length is never read)
    if config.max_segment_len > 0:
        boundaries = split_long(boundaries, packed, config.max_segment_len)
    # 4. ids: the running count of boundaries, back in token order (padding 0)
    ids = packed.unpack(torch.cumsum(boundaries, dim=-1, dtype=torch.int32).sub_(1))
    del packed  # its int64 index before the int64 ids exist (peak memory)
    return ids.long()


def compute_boundaries(mask: torch.Tensor, config: Any, **inputs) -> torch.Tensor:
    """Where ``compute_segment_ids``'s segments start (same arguments): True at a valid token whose id differs
    from the previous valid token's, and at each row's first valid token."""
    packed = Packed(mask)
    ids = packed.pack(compute_segment_ids(mask, config, **inputs))
    return packed.unpack((ids != previous(ids)) | (packed.columns == 0), False)


def suppress_close(
    boundaries: torch.Tensor, scores: torch.Tensor, min_len: int, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """Non-maximum suppression on packed rows: drop a boundary within ``min_len - 1`` tokens of a
    stronger one.

    Boundaries are ordered by score, ties going to the earlier one (a strict total order);
    boundaries that must stay (the first valid token, tokens outside the codec: ``forced``, a subset
    of ``boundaries``) carry score +inf; ``scores`` are otherwise finite. A boundary survives when it
    is the strongest of all boundaries within ``min_len - 1`` valid tokens on either side,
    *suppressed ones included*, so no two survivors are closer than ``min_len``. Two consequences: a
    boundary can be dropped by a stronger neighbour that is itself dropped (in 9 . 8 . 9 with
    min_len 3 the 9s survive, the 8 goes, but in 7 . 8 . 9 only the 9 survives: the 7 is dropped by
    the 8, which the 9 drops), and the row's last segment may be shorter than ``min_len``. Forced
    boundaries next to each other suppress each other like equal scores (the caller keeps them).

    Linear in T: the strongest earlier and later neighbours come from one sliding-window max over
    the packed rows (strictly stronger than every earlier neighbour, at least as strong as every
    later one).
    """
    if min_len <= 1:
        return boundaries
    B, T = boundaries.shape
    pad = min_len - 1
    # the score on boundaries, the float32 floor elsewhere, as arithmetic (faster than a select)
    on = float_mask(boundaries)
    own = torch.addcmul(on.sub(1.0).mul_(_FLOOR), scores.float(), on)
    if forced is not None:  # + inf where forced (0 * inf is nan: made 0)
        own.add_(float_mask(forced).mul_(math.inf).nan_to_num_(nan=0.0, posinf=math.inf))
    # -inf pad columns on both sides (padded rather than written into a slice with out=, which torch.compile cannot
    # trace); window max over the pad columns before each column; column p's later neighbours are the window at
    # p + min_len
    keys = torch.nn.functional.pad(own, (pad, pad), value=-math.inf)
    window = torch.nn.functional.max_pool1d(keys.unsqueeze(1), pad, stride=1).squeeze(1)
    keep = (own > window[:, :T]).logical_and_(own >= window[:, min_len : min_len + T])
    return keep.logical_and_(boundaries)


def split_long(boundaries: torch.Tensor, packed: Packed, max_len: int) -> torch.Tensor:
    """Add a boundary every ``max_len`` valid tokens inside each segment (packed; the first valid
    token must be a boundary; what it adds past a row's length is never unpacked)."""
    if max_len <= 0:
        return boundaries
    columns = packed.columns
    # distance to the last boundary, in valid tokens (exact in float32 below 2**24); a multiple of
    # max_len when its quotient is a whole number
    last = torch.cummax(float_mask(boundaries, torch.int32).mul_(columns), dim=-1).values
    since = torch.sub(columns.float(), last).div_(max_len)
    return boundaries | (since.frac_() == 0)
