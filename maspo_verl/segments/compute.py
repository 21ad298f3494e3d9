"""Running a segmentation: the configured rule's candidates, then ``min_segment_len`` / ``max_segment_len``, as
segment ids; by the C library for CPU tensors when the rules have a C kernel (``maspo_verl.native``, the same ids),
else by the rule's closed formula where it has one, else by torch ops (the definition, and the GPU path).

The settings declared here are the segmentation's own, shared by every rule."""

from __future__ import annotations

import math
from typing import Any

import torch

from maspo_verl import native
from maspo_verl.segments.lengths import split_long, suppress_close
from maspo_verl.segments.packing import Packed
from maspo_verl.segments.registry import SEGMENT_RULES, configured_rule, rules_in_use
from maspo_verl.segments.rule import RuleInputs
from maspo_verl.util import warn_once
from maspo_verl.validation import Choice, Int, Setting, fail

SEGMENT_KERNELS = ("auto", "torch")
SETTINGS = (
    Setting("segment_rule", "fixed", Choice(lambda: tuple(SEGMENT_RULES)), "which tokens share a ratio (`maspo`)"),
    Setting("min_segment_len", 0, Int(0), "suppress boundaries closer than this to a stronger one (0 = off)"),
    Setting("max_segment_len", 0, Int(0), "force a boundary every this many tokens inside a segment (0 = off)"),
    Setting(
        "segment_kernel",
        "auto",
        Choice(SEGMENT_KERNELS),
        "auto: the C library for CPU tensors in eager mode, torch ops otherwise; torch: always torch ops (same ids)",
    ),
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
    rule = configured_rule(config)
    found = rule.candidates(config, packed, inputs.for_rule(rule))
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
    return split_long(b, packed, config.max_segment_len)


def compute_boundaries(
    mask: torch.Tensor, config: Any, *, old_log_prob=None, token_ids=None, metrics=None
) -> torch.Tensor:
    """``packed_boundaries`` in token order (``token_ids``: the response ids, else the micro-batch's)."""
    packed = Packed(mask)
    inputs = RuleInputs(mask, config.segment_rule, old_log_prob, token_ids)
    return packed.unpack(packed_boundaries(packed, config, inputs, metrics), False)


def compute_segments(
    mask: torch.Tensor,
    config: Any,
    *,
    old_log_prob: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    metrics: dict[str, torch.Tensor] | None = None,
    sizes_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Segment ids (token order; 0 on padding) of ``packed_boundaries`` (``token_ids``: the response ids,
    else the micro-batch's), and each segment's number of valid tokens at its id ([B, T] in
    ``sizes_dtype``) when the C library computed them along (None otherwise)."""
    inputs = RuleInputs(mask, config.segment_rule, old_log_prob, token_ids)
    if _native_wanted(config, mask):
        rules = rules_in_use(config)
        spec = native.config_for(config, rules)
        if spec is not None:
            return native.compute_segments(mask, spec, rules, inputs, metrics, sizes_dtype)
    direct = configured_rule(config).direct_ids(config, mask)
    if direct is not None:
        return direct, None
    packed = Packed(mask)
    ids = torch.cumsum(packed_boundaries(packed, config, inputs, metrics), dim=-1, dtype=torch.int32).sub_(1)
    ids = packed.unpack(ids)
    del packed  # its int64 index before the int64 ids exist (peak memory)
    return ids.long(), None


def compute_segment_ids(mask: torch.Tensor, config: Any, **inputs) -> torch.Tensor:
    """The segment ids of ``compute_segments`` (``inputs``: its keyword arguments)."""
    return compute_segments(mask, config, **inputs)[0]


def _native_wanted(config: Any, mask: torch.Tensor) -> bool:
    """The C path is wanted: ``segment_kernel=auto``, CPU tensors, eager mode, and the library builds
    (warned once when it does not)."""
    if getattr(config, "segment_kernel", "auto") != "auto" or mask.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():  # traced as torch ops
        return False
    reason = native.unavailable()
    if reason is not None:
        warn_once(f"segmentation runs on torch ops: the C path is unavailable ({reason})")
    return reason is None
