"""The segmentation written plainly, row by row: the configured rule's ``reference`` loop (``SegmentRule.reference``),
then ``min_segment_len`` and ``max_segment_len`` as loops over the row, then segment ids. The oracle of
``compute.compute_segment_ids`` (tests/core/test_rule_references.py holds them equal for every registered rule);
Python loops over rows and tokens, for tests and readers only."""

from __future__ import annotations

from typing import Any

import torch

from maspo_verl import vocab
from maspo_verl.core.segments.registry import configured_rule, rules_in_use
from maspo_verl.core.segments.rule import (
    FORCED,
    LOG_RATIO,
    OLD_LOG_PROB,
    RESPONSE_IDS,
    TOKENIZER,
    WORD_IDS,
    Row,
    RuleInputs,
)


def plain_boundaries(strengths: list[float | None], min_len: int, max_len: int) -> list[bool]:
    """Which of a row's tokens start a segment, from the rule's per-token strengths (None: no boundary)."""
    n = len(strengths)
    starts = [s is not None for s in strengths]
    forced = [s == FORCED for s in strengths]
    if n:
        starts[0] = True  # the first valid token starts a segment, and outranks every other
    key = [FORCED if p == 0 else s for p, s in enumerate(strengths)]
    if min_len > 1:
        # a boundary stays when it is stronger than every boundary up to min_len - 1 tokens before it and at least
        # as strong as every one up to min_len - 1 tokens after it (dropped ones included); forced ones always stay
        kept = []
        for p in range(n):
            near = [q for q in range(max(0, p - min_len + 1), min(n, p + min_len)) if q != p and starts[q]]
            strongest = starts[p] and all(key[p] > key[q] if q < p else key[p] >= key[q] for q in near)
            kept.append(strongest or forced[p])
        starts = kept
    if max_len > 0:  # a new segment after every max_len tokens without a boundary
        since = 0
        for p in range(n):
            since = 0 if starts[p] else since + 1
            if since == max_len:
                starts[p], since = True, 0
    return starts


def reference_segment_ids(
    mask: torch.Tensor,
    config: Any,
    *,
    old_log_prob: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    log_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """``compute_segment_ids``'s result (same arguments; ids, word ids and the tokenizer also from the micro-batch
    in scope), computed one row at a time with the rule's plain loop."""
    needs = set().union(*(rule.needs for rule in rules_in_use(config)))
    inputs = RuleInputs(mask, config.segment_rule, old_log_prob, token_ids, log_ratio)

    def rows_of(name: str, dtype=None) -> list | None:
        if name not in needs:
            return None
        value = inputs.get(name)
        return (value if dtype is None else value.to(dtype)).tolist()

    log_probs = rows_of(OLD_LOG_PROB, torch.float32)  # the rules read log-probs in float32
    ids, words = rows_of(RESPONSE_IDS), rows_of(WORD_IDS)
    deltas = rows_of(LOG_RATIO, torch.float64)  # the rules read log-ratios in float64
    texts = vocab.vocabulary_texts(inputs.get(TOKENIZER)) if TOKENIZER in needs else None
    rule = configured_rule(config)
    out = torch.zeros(mask.shape, dtype=torch.long)
    for b, valid in enumerate(mask.bool().tolist()):
        cols = [t for t, v in enumerate(valid) if v]
        if not cols:
            continue
        row = Row(
            cols,
            None if log_probs is None else [log_probs[b][t] for t in cols],
            None if ids is None else [ids[b][t] for t in cols],
            None if words is None else [words[b][t] for t in cols],
            texts,
            None if deltas is None else [deltas[b][t] for t in cols],
        )
        starts = plain_boundaries(rule.reference(config, row), config.min_segment_len, config.max_segment_len)
        segment = -1
        for t, start in zip(cols, starts, strict=True):
            segment += start
            out[b, t] = segment
    return out.to(mask.device)
