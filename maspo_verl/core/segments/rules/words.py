"""words: one segment per word the speech reward's ASR recognised."""

from __future__ import annotations

import torch

from maspo_verl.batch import NO_WORD
from maspo_verl.core.segments.registry import SEGMENT_RULES, fallback_rules
from maspo_verl.core.segments.rule import WORD_IDS, Candidates, Example, SegmentRule, previous
from maspo_verl.core.tensors import float_mask
from maspo_verl.validation import Choice, Setting

# share of the rows with valid tokens and no word that took the fallback rule
WORDS_FALLBACK_METRIC = "actor/ratio/words_fallback_frac"


class WordsRule(SegmentRule):
    """One segment per recognised word (gaps between words are segments of their own); a sample without word times
    takes `words_fallback_rule`.

    A new segment starts wherever the word id (``maspo_verl.batch``: the index of the ASR word a token belongs
    to, -1 between words) differs from the previous valid token's. Gaps between words (silence, breaths, tokens
    outside the codec) are segments of their own; a word start outranks a gap start, so with
    ``min_segment_len`` a gap shorter than that joins the word before it. A row with no word among its valid
    tokens (no word times: ASR returned none, non-speech, decode failure, ids absent) takes
    ``words_fallback_rule`` instead, counted in ``actor/ratio/words_fallback_frac``. The fallback's candidates
    are computed for the whole batch and selected per row (no host sync).
    """

    name = "words"
    needs = frozenset({WORD_IDS})
    settings = (
        Setting(
            "words_fallback_rule",
            "tokenval",
            Choice(fallback_rules),
            "the rule of a sample without word times (`words`)",
        ),
    )
    # rows without word ids take the fallback: its limits, through it
    limits = {
        "token": {"words_fallback_rule": "fixed", "segment_window": 1},
        "sequence": {"words_fallback_rule": "fixed", "segment_window": 1 << 30},
    }
    fallback_field = "words_fallback_rule"
    fallback_metric = WORDS_FALLBACK_METRIC
    examples = (
        Example(
            "word ids 0 0 1 1 1 - - 2: words and the gap are segments; a row without words takes the fallback",
            ((1,) * 8, (1,) * 5 + (0,) * 3),
            ((2, 3, 2, 1), (3, 2)),
            {"words_fallback_rule": "fixed", "segment_window": 3},
            {WORD_IDS: ((0, 0, 1, 1, 1, NO_WORD, NO_WORD, 2), (NO_WORD,) * 8)},
        ),
        Example(
            "at the edges: a one-token word between gaps, and a row that starts in a gap: - 0 - - 1 1 is 1, 1, 2, 2",
            ((1,) * 6,),
            ((1, 1, 2, 2),),
            {"words_fallback_rule": "fixed", "segment_window": 3},
            {WORD_IDS: ((NO_WORD, 0, NO_WORD, NO_WORD, 1, 1),)},
        ),
    )

    def token_level(self, config):
        return False  # rows with word ids are never token level

    def reference(self, config, row):
        words = row.word_ids
        if all(w == NO_WORD for w in words):
            return SEGMENT_RULES[config.words_fallback_rule].reference(config, row)
        # a word start outranks a gap start
        return [None] + [
            (2.0 if words[p] != NO_WORD else 1.0) if words[p] != words[p - 1] else None for p in range(1, len(words))
        ]

    def candidates(self, config, packed, inputs):
        # the fallback first, so that its temporaries are freed before ours exist (peak memory)
        rule = SEGMENT_RULES[config.words_fallback_rule]
        fallback = rule.candidates(config, packed, inputs.for_rule(rule))
        words = packed.pack(inputs.get(WORD_IDS).to(torch.int32), NO_WORD)
        starts = packed.has_previous & (words != previous(words))
        is_word = words != NO_WORD
        del words
        has_words = (packed.valid & is_word).any(-1, keepdim=True)
        # per row: the words' candidates (score 2 on a word start, 1 on a gap start) or the fallback's,
        # selected by 0/1 products (exact, faster than selects)
        use = float_mask(has_words)
        scores = float_mask(is_word).add_(1.0).mul_(use).add_(fallback.scores.float().mul_(1.0 - use))
        del is_word
        boundaries = (starts & has_words) | (fallback.boundaries & ~has_words)
        forced = None if fallback.forced is None else fallback.forced & ~has_words
        rows = packed.lengths > 0
        fell_back = (rows & ~has_words).sum().to(torch.float64) / rows.sum().clamp(min=1).to(torch.float64)
        return Candidates(boundaries, scores, forced, {**fallback.metrics, WORDS_FALLBACK_METRIC: fell_back})
