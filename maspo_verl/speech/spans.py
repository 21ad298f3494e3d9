"""Where in the codec tokens a TTS sample went wrong: ASR word timings, aligned against the reference
text, become token spans and a per-token score, so that a mispronounced segment gets different
treatment from a well-pronounced one (docs/algorithms.md §6): a word at [start, end) seconds is
codec tokens [floor(50 start), ceil(50 end)) at XCodec2's 50 Hz.

- ``normalised_words``: the ASR's words, each normalised like the WER's text (``text.normalize_text``);
  a word that normalises to several ("25" -> "twenty five") gives several with the same times.
- ``error_spans``: jiwer's word alignment of reference vs hypothesis (the alignment behind the WER)
  -> one ``ErrorSpan`` per substituted, inserted or deleted word. A substituted or inserted word
  spans its own tokens. A deleted word has no time of its own, so it attaches to the neighbouring
  span: the previous recognised word plus the gap up to the next one; at the start, everything up to
  the end of the first recognised word; at the end, the last recognised word to the end; with no
  recognised word, the whole utterance.
- ``token_penalties``: each error costs ``penalty`` in total, spread evenly over its span's tokens
  (overlapping spans add up).
- ``token_scores``: the per-token scores handed to verl (``rm_scores``): the penalties centred over the
  response's valid tokens, plus the utterance score on the last token, so they sum to the utterance
  score (verl's GRPO, which sums them, sees exactly the utterance score).
- ``word_token_ids``: the index of the recognised word each token belongs to (-1 between words), the
  segments of MASPO's ``segment_rule=words`` (docs/algorithms.md §3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from maspo_verl.speech.asr import TimedWord
from maspo_verl.speech.codec import FRAMES_PER_SECOND
from maspo_verl.speech.text import normalize_text


@dataclass(frozen=True)
class ErrorSpan:
    kind: str  # substitute, insert or delete
    start: int  # first token
    end: int  # one past the last token
    ref: str  # the reference word ("" for an insertion)
    hyp: str  # the recognised word ("" for a deletion)


def token_range(start_s: float, end_s: float, n_tokens: int, rate: float = FRAMES_PER_SECOND) -> tuple[int, int]:
    """[floor(rate start), ceil(rate end)) clipped to the utterance, at least one token long."""
    if n_tokens <= 0:
        return 0, 0
    a = min(max(math.floor(rate * start_s), 0), n_tokens - 1)
    b = min(max(math.ceil(rate * end_s), a + 1), n_tokens)
    return a, b


def normalised_words(words: Sequence[TimedWord]) -> list[TimedWord]:
    return [TimedWord(w, t.start, t.end) for t in words for w in normalize_text(t.word).split()]


def error_spans(
    reference: str, words: Sequence[TimedWord], n_tokens: int, rate: float = FRAMES_PER_SECOND
) -> list[ErrorSpan]:
    """Token spans of the word errors of ``words`` (the ASR output) against ``reference``."""
    import jiwer

    ref = normalize_text(reference).split()
    hyp = normalised_words(words)
    spans = [token_range(w.start, w.end, n_tokens, rate) for w in hyp]
    if not ref and not hyp:
        return []
    if not ref:
        return [ErrorSpan("insert", *s, "", w.word) for w, s in zip(hyp, spans, strict=True)]
    chunks = jiwer.process_words(" ".join(ref), " ".join(w.word for w in hyp)).alignments[0]
    out: list[ErrorSpan] = []
    for c in chunks:
        if c.type == "substitute":
            for r, h in zip(range(c.ref_start_idx, c.ref_end_idx), range(c.hyp_start_idx, c.hyp_end_idx), strict=True):
                out.append(ErrorSpan("substitute", *spans[h], ref[r], hyp[h].word))
        elif c.type == "insert":
            out.extend(ErrorSpan("insert", *spans[h], "", hyp[h].word) for h in range(c.hyp_start_idx, c.hyp_end_idx))
        elif c.type == "delete":
            at = _deletion_range(c.hyp_start_idx, spans, n_tokens)
            out.extend(ErrorSpan("delete", *at, ref[r], "") for r in range(c.ref_start_idx, c.ref_end_idx))
    return out


def _deletion_range(h: int, spans: list[tuple[int, int]], n_tokens: int) -> tuple[int, int]:
    """Tokens a deletion before recognised word ``h`` attaches to (see the module docstring)."""
    if not spans:
        return 0, n_tokens
    if h == 0:
        return 0, spans[0][1]
    if h == len(spans):
        return spans[-1][0], n_tokens
    return spans[h - 1][0], max(spans[h][0], spans[h - 1][1])


def token_penalties(spans: Sequence[ErrorSpan], n_tokens: int, penalty: float = 1.0) -> list[float]:
    """Per-token penalty (<= 0): each span's ``penalty`` spread evenly over its tokens."""
    out = [0.0] * n_tokens
    for s in spans:
        share = penalty / (s.end - s.start)
        for t in range(s.start, s.end):
            out[t] -= share
    return out


def token_scores(score: float, penalties: Sequence[float]) -> list[float]:
    """Per-token scores over a response's valid tokens: centred penalties + ``score`` on the last one."""
    n = len(penalties)
    if n == 0:
        return []
    mean = sum(penalties) / n
    out = [p - mean for p in penalties]
    out[-1] += score
    return out


def word_token_ids(words: Sequence[TimedWord], n_tokens: int, rate: float = FRAMES_PER_SECOND) -> list[int]:
    """Per token, the index in ``words`` (the ASR output, in order) of the word it belongs to; -1 in gaps.

    Word k covers tokens [floor(rate start), ceil(rate end)) clipped to the utterance, at least one
    token (a word shorter than a token keeps the token it starts in). A word that starts at or after
    the end of the utterance, or ends before its start, has no token. Where words overlap (the
    rounding makes neighbours share a token), the token goes to the later word.
    """
    out = [-1] * max(n_tokens, 0)
    for k, w in enumerate(words):
        a = max(math.floor(rate * w.start), 0)
        if a >= n_tokens or math.ceil(rate * w.end) <= 0:
            continue
        b = min(max(math.ceil(rate * w.end), a + 1), n_tokens)
        out[a:b] = [k] * (b - a)
    return out
