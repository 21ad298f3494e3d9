"""Which vocabulary ids hold which strings: the tables of ``segment_rule=delimiters`` (docs/algorithms.md
§3), resolved once per tokenizer (no verl, no torch).

A string *occurs at* token t when the decoded text of t contains it, or when it straddles the boundary
between t and the next token (t's text ends with its first k characters, the next token's text starts
with the rest). Byte-level BPE tokenizers keep punctuation and the following space in separate tokens
(``"3. Then"`` is ``"3" "." " Then"``), so a sentence end like ``". "`` is found only across the
boundary; merges like ``".\\n\\n"`` hold ``"\\n"`` inside one token. An occurrence spread over three or
more tokens is not seen. Per vocabulary id the tables hold: ``inside`` (bit 0: a delimiter, bit 1: a
step marker lies inside the token), and two bit masks with one bit per (string, k) split:
``ends`` (the token ends with the split's head) and ``starts`` (it starts with the split's tail).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from maspo_verl.validation import FieldError

# bits 0..62 of an int64: one per split point of a string (so the tables stay non-negative)
MAX_SPLITS = 63
DELIMITER, STEP_MARKER = 1, 2  # bits of ``inside``


def split_count(strings: Sequence[str]) -> int:
    """Table bits the strings use: one per split point, len(s) - 1 for each string."""
    return sum(max(len(s) - 1, 0) for s in strings)


def vocabulary_texts(vocabulary) -> list[str]:
    """The decoded text of every id of a vocabulary: an HF tokenizer (``token_texts``), or already a
    sequence of texts, one per id."""
    if isinstance(vocabulary, Sequence) and not isinstance(vocabulary, str | bytes):
        return list(vocabulary)
    return token_texts(vocabulary)


def token_texts(tokenizer) -> list[str]:
    """The decoded text of every id of an HF tokenizer ("" for the special tokens decoding skips, which
    never match).

    Each id is decoded after a fixed anchor token and the anchor's text is cut off, so a leading space
    that a SentencePiece-style decoder drops from a sequence's first token is kept.
    """
    n = len(tokenizer)
    anchor = list(tokenizer.encode("a", add_special_tokens=False))
    kwargs = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
    prefix = tokenizer.decode(anchor, **kwargs) if anchor else ""
    texts = tokenizer.batch_decode([[*anchor, i] for i in range(n)], **kwargs)
    # the anchor's text cut off; if the decoder merged the anchor with the token, the token decoded alone
    return [t[len(prefix) :] if t.startswith(prefix) else tokenizer.decode([i], **kwargs) for i, t in enumerate(texts)]


@dataclass
class TextTables:
    """Per-id tables (lists of ints, one entry per vocabulary id) and what each string matched."""

    inside: list[int]
    ends: list[int]
    starts: list[int]
    delimiter_splits: int  # mask of the bits of ``ends``/``starts`` that belong to delimiters
    marker_splits: int
    # string -> (ids holding it, [(ids ending with head, ids starting with tail) per split])
    matches: dict[tuple[str, str], tuple[int, list[tuple[int, int]]]] = field(default_factory=dict)

    def summary(self) -> str:
        """One line per string: how many ids hold it, and how many can carry it across two tokens."""
        lines = []
        for (field_name, s), (inside, splits) in self.matches.items():
            across = [f"{a} ending {s[: k + 1]!r} x {b} starting {s[k + 1 :]!r}" for k, (a, b) in enumerate(splits)]
            kind = "delimiter" if field_name == "delimiters" else "step marker"
            both = f"; across two tokens: {', '.join(across)}" if across else ""
            lines.append(f"  {kind} {s!r}: {inside} ids{both}")
        return "\n".join(lines)


def resolve(texts: Sequence[str], delimiters: Sequence[str], step_markers: Sequence[str]) -> TextTables:
    """The tables of ``delimiters`` and ``step_markers`` over the vocabulary ``texts`` (id -> decoded text).

    Raises ``FieldError`` naming ``policy_loss.delimiters`` / ``policy_loss.step_markers`` for a string
    that occurs nowhere: inside no token, and across no pair of tokens.
    """
    n = len(texts)
    inside, ends, starts = [0] * n, [0] * n, [0] * n
    masks = {"delimiters": 0, "step_markers": 0}
    matches: dict[tuple[str, str], tuple[int, list[tuple[int, int]]]] = {}
    bit = 0
    fields = (("delimiters", delimiters, DELIMITER), ("step_markers", step_markers, STEP_MARKER))
    for field_name, strings, flag in fields:
        for s in strings:
            holding = [i for i, text in enumerate(texts) if s in text]
            for i in holding:
                inside[i] |= flag
            splits = []
            for k in range(1, len(s)):
                head, tail = s[:k], s[k:]
                ending = [i for i, text in enumerate(texts) if text.endswith(head)]
                starting = [i for i, text in enumerate(texts) if text.startswith(tail)]
                for i in ending:
                    ends[i] |= 1 << bit
                for i in starting:
                    starts[i] |= 1 << bit
                masks[field_name] |= 1 << bit
                splits.append((len(ending), len(starting)))
                bit += 1
            if not holding and not any(a and b for a, b in splits):
                path = f"policy_loss.{field_name}"
                raise FieldError(
                    path,
                    f"{path} has {s!r}, which occurs in no token of the tokenizer ({n} ids) and across no two "
                    "neighbouring tokens: remove it, or write it as the tokenizer splits text",
                )
            matches[(field_name, s)] = (len(holding), splits)
    if bit > MAX_SPLITS:
        raise FieldError(
            "policy_loss.step_markers",
            f"policy_loss.delimiters and step_markers have {bit} split points in all (len - 1 per string): "
            f"allowed at most {MAX_SPLITS}",
        )
    return TextTables(inside, ends, starts, masks["delimiters"], masks["step_markers"], matches)
