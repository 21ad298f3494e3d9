"""Running a segmentation: the configured rule's candidates, then ``min_segment_len`` / ``max_segment_len``, then
segment ids. One torch implementation, the same on CPU and GPU: vectorised over [B, T], no host sync.

The settings declared here are the segmentation's own, shared by every rule."""

from __future__ import annotations

import math
from typing import Any

import torch

from maspo_verl.core.segments.lengths import split_long, suppress_close
from maspo_verl.core.segments.packing import Packed
from maspo_verl.core.segments.registry import SEGMENT_RULES, configured_rule
from maspo_verl.core.segments.rule import RuleInputs
from maspo_verl.validation import Choice, Int, Setting, fail

SETTINGS = (
    Setting("segment_rule", "fixed", Choice(lambda: tuple(SEGMENT_RULES)), "which tokens share a ratio (`maspo`)"),
    Setting("min_segment_len", 0, Int(0), "suppress boundaries closer than this to a stronger one (0 = off)"),
    Setting("max_segment_len", 0, Int(0), "force a boundary every this many tokens inside a segment (0 = off)"),
)


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


def packed_boundaries(packed: Packed, config: Any, inputs: RuleInputs, metrics: dict | None = None) -> torch.Tensor:
    """Boundaries (packed) of ``config.segment_rule``, then ``min_segment_len`` / ``max_segment_len``;
    the rule's metrics go into ``metrics`` when given. Boundaries past a row's length are left as they
    fall (never unpacked)."""
    rule = SEGMENT_RULES.get(config.segment_rule) or configured_rule(config)  # (which names the allowed ones)
    found = rule.candidates(config, packed, inputs)  # the configured rule: inputs name it in errors
    if metrics is not None:
        metrics.update(found.metrics)
    forced = found.forced
    b = found.boundaries if forced is None else found.boundaries | forced
    b[:, :1] = packed.valid[:, :1]  # the first valid token starts a segment
    if config.min_segment_len > 1:
        # forced boundaries outrank every other (+inf) and stay even next to each other
        scores = found.scores.float()
        scores[:, :1].masked_fill_(b[:, :1], math.inf)
        b = suppress_close(b, scores, config.min_segment_len, forced)
        if forced is not None:
            b |= forced
    if config.max_segment_len > 0:
        b = split_long(b, packed, config.max_segment_len)
    return b


def compute_boundaries(
    mask: torch.Tensor, config: Any, *, old_log_prob=None, token_ids=None, metrics=None, log_ratio=None
) -> torch.Tensor:
    """``packed_boundaries`` in token order (``token_ids``: the response ids, else the micro-batch's)."""
    packed = Packed(mask)
    inputs = RuleInputs(mask, config.segment_rule, old_log_prob, token_ids, log_ratio)
    return packed.unpack(packed_boundaries(packed, config, inputs, metrics), False)


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
    ids = torch.cumsum(packed_boundaries(packed, config, inputs, metrics), dim=-1, dtype=torch.int32).sub_(1)
    ids = packed.unpack(ids)
    del packed  # its int64 index before the int64 ids exist (peak memory)
    return ids.long()
