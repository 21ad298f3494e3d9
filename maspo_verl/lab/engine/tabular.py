"""The lab's tabular policy: a logit table per position and previous symbol, the toy model of the race, credit
and regimes studies (no network: every probability is one softmax row, so a study runs thousands of seeds), and
the toy tasks' tokens: speech-like symbols as codec ids, text-like ones as words."""

from __future__ import annotations

import torch


def initial_table(length: int, vocab: int, persistence: float, noise: float, seed: int) -> torch.Tensor:
    """[length, vocab + 1, vocab] logits (row ``vocab``: the first token's context): Gaussian noise of scale
    ``noise`` from ``seed``, plus ``persistence`` on repeating the previous symbol (runs, as speech codes have)."""
    g = torch.Generator().manual_seed(seed)
    theta = noise * torch.randn(length, vocab + 1, vocab, generator=g)
    theta[:, :vocab, :] += persistence * torch.eye(vocab)
    return theta


CODEC_OFFSET = 128264  # Llasa-1B's first speech id, the shipped codec presets' codec_offset
CODEC_SIZE = 65536
# 8 symbols -> FSQ codes (8 base-4 digits); the digits are 3 x the bits of a Hadamard code (pairwise Hamming
# distance >= 4), so two symbols' codes are >= 12 apart in digit L1 distance, one symbol's code 0 from itself
HADAMARD = ("00000000", "11110000", "00001111", "11111111", "11001100", "00110011", "10101010", "01010101")
CODES = tuple(sum(3 * int(b) * 4**k for k, b in enumerate(word)) for word in HADAMARD)
VOCAB = len(CODES)
TEXT = (" ka", " lo", " mi", " nu", " pe", " ro", " su", ".")  # text-task ids 0..7
TEXT_END = TEXT.index(".")
# the rest of the toy tokenizer's text (never sampled): what the shipped delimiters look for
TEXT_OTHER = ("\n\n", "\n", "?", "!", " ")


_VOCABULARY: list[str] | None = None


def vocabulary() -> list[str]:
    """The text of every id (the tokenizer's part ``delimiters`` reads): the text task's words, codes empty."""
    global _VOCABULARY
    if _VOCABULARY is None:
        _VOCABULARY = list(TEXT + TEXT_OTHER) + [""] * (CODEC_OFFSET + CODEC_SIZE - len(TEXT + TEXT_OTHER))
    return _VOCABULARY
