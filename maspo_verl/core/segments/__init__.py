"""Who shares a ratio in MASPO: contiguous segments of a response (docs/algorithms.md, "Segmentation rules").

A rule (``policy_loss.segment_rule``) turns [B, T] inputs into a boolean *boundary* tensor (True where a new
segment starts), a boundary *score* used by ``min_segment_len`` suppression, and the boundaries that must stay;
the boundaries' running count gives the segment ids. Everything is vectorised over [B, T]: no Python loop over
tokens or samples, no host sync. Masks may be right- or left-padded and may have holes (multi-turn tool
outputs): rules work on packed rows, where "previous token" is the previous *valid* token.

| module | what it holds |
|---|---|
| ``rule`` | what a rule declares (settings, inputs, limits, worked examples) and reads (``Packed`` rows, inputs) |
| ``rules/`` | the rules, one module each, discovered on import (``registry``) |
| ``registry`` | the registered rules, and which of them a config runs (with its fallback) and what they read |
| ``compute`` | one segmentation: rule, min/max length, ids (``compute_segment_ids``, the public entry point) |
| ``text_tables`` | the tokenizer's text tables for rules that find strings (``delimiters``) |
"""

from maspo_verl.core.segments.compute import compute_boundaries, compute_segment_ids, token_level
from maspo_verl.core.segments.registry import (
    SEGMENT_RULES,
    configured_rule,
    discover,
    fallback_rules,
    register_segment_rule,
    rules_in_use,
    setting,
)
from maspo_verl.core.segments.rule import (
    FROM_MICRO_BATCH,
    LOG_RATIO,
    OLD_LOG_PROB,
    RESPONSE_IDS,
    TOKENIZER,
    WORD_IDS,
    Candidates,
    Example,
    Packed,
    RuleInputs,
    SegmentRule,
    previous,
)
from maspo_verl.core.tensors import float_mask

discover()

__all__ = [
    "FROM_MICRO_BATCH",
    "LOG_RATIO",
    "OLD_LOG_PROB",
    "RESPONSE_IDS",
    "SEGMENT_RULES",
    "TOKENIZER",
    "WORD_IDS",
    "Candidates",
    "Example",
    "Packed",
    "RuleInputs",
    "SegmentRule",
    "compute_boundaries",
    "compute_segment_ids",
    "configured_rule",
    "fallback_rules",
    "float_mask",
    "previous",
    "register_segment_rule",
    "rules_in_use",
    "setting",
    "token_level",
]
