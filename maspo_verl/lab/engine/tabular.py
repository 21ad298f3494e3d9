"""The lab's tabular policy: a logit table per position and previous symbol, the toy model of the race, credit
and regimes studies (no network: every probability is one softmax row, so a study runs thousands of seeds)."""

from __future__ import annotations

import torch


def initial_table(length: int, vocab: int, persistence: float, noise: float, seed: int) -> torch.Tensor:
    """[length, vocab + 1, vocab] logits (row ``vocab``: the first token's context): Gaussian noise of scale
    ``noise`` from ``seed``, plus ``persistence`` on repeating the previous symbol (runs, as speech codes have)."""
    g = torch.Generator().manual_seed(seed)
    theta = noise * torch.randn(length, vocab + 1, vocab, generator=g)
    theta[:, :vocab, :] += persistence * torch.eye(vocab)
    return theta
