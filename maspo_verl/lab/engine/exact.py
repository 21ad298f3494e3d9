"""Exact expectations over an enumerated sequence space (no Monte Carlo).

A *bigram policy* over tokens {0..V-1} is a logit table ``theta[V+1, V]``: row ``v`` gives the logits
after token ``v``, row ``V`` those after the start of the response (BOS). Optionally token ``eos``
ends the response: it is a valid token itself, every position after it is padding (mask False).

For a set of sequences ``tokens[N, L]`` with ``mask[N, L]`` everything is closed form:

- token log-probs ``log pi(y_t | y_<t) = log_softmax(theta[y_{t-1}])[y_t]``;
- the score of token t w.r.t. the table, ``grad log pi(y_t | y_<t)``, is ``onehot(y_t) - softmax(theta[y_{t-1}])``
  in row ``y_{t-1}`` and zero elsewhere;
- so a per-sample gradient estimate ``g(y) = sum_t c_t(y) grad log pi(y_t | y_<t)`` is one scatter-add into
  ``[N, V+1, V]`` (:func:`per_sample_gradients`), and its exact mean and total variance under any
  distribution over the N sequences are weighted sums (:func:`moments`).
"""

from __future__ import annotations

import torch

DTYPE = torch.float64


def enumerate_sequences(vocab: int, length: int, eos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All distinct responses: ``vocab**length`` of them, or with ``eos`` every content prefix + EOS.

    With ``eos`` the content tokens are the other ``vocab - 1`` ids; a response is k content tokens
    (k = 0..length) followed by EOS when k < length, then padding (token ``eos``, mask False).
    """
    if eos is None:
        n = vocab**length
        powers = vocab ** torch.arange(length - 1, -1, -1)
        tokens = (torch.arange(n)[:, None] // powers) % vocab
        return tokens, torch.ones_like(tokens, dtype=torch.bool)
    content = [v for v in range(vocab) if v != eos]
    c = len(content)
    lut = torch.tensor(content)
    toks, masks = [], []
    for k in range(length + 1):
        n = c**k
        if k:
            powers = c ** torch.arange(k - 1, -1, -1)
            body = lut[(torch.arange(n)[:, None] // powers) % c]
        else:
            body = torch.zeros(1, 0, dtype=torch.long)
        tail = torch.full((n, length - k), eos, dtype=torch.long)
        toks.append(torch.cat([body, tail], dim=1))
        valid = min(k + 1, length)  # content tokens + the EOS token (none when k == length)
        masks.append((torch.arange(length) < valid).expand(n, length))
    return torch.cat(toks), torch.cat(masks)


def previous_tokens(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Row of the logit table used at each position: the previous token, or BOS (= vocab) at t = 0."""
    bos = torch.full_like(tokens[:, :1], vocab)
    return torch.cat([bos, tokens[:, :-1]], dim=1)


def token_log_probs(theta: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi(y_t | y_<t) per position, 0 on padding. ``theta``: [V+1, V]."""
    vocab = theta.shape[-1]
    table = torch.log_softmax(theta.to(DTYPE), dim=-1)
    lp = table[previous_tokens(tokens, vocab), tokens]
    return torch.where(mask, lp, torch.zeros_like(lp))


def per_sample_gradients(
    theta: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, coef: torch.Tensor
) -> torch.Tensor:
    """g(y) = sum_t coef_t(y) grad_theta log pi_theta(y_t | y_<t), flattened to [N, (V+1)*V]."""
    vocab = theta.shape[-1]
    probs = torch.softmax(theta.to(DTYPE), dim=-1)
    prev = previous_tokens(tokens, vocab)
    score = torch.nn.functional.one_hot(tokens, vocab).to(DTYPE) - probs[prev]  # [N, L, V]
    contrib = (coef.to(DTYPE) * mask.to(DTYPE))[..., None] * score
    grads = torch.zeros(tokens.shape[0], vocab + 1, vocab, dtype=DTYPE)
    grads.scatter_add_(1, prev[..., None].expand_as(contrib), contrib)
    return grads.flatten(1)


def moments(grads: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Exact mean and total variance (trace of the covariance) of g(y) when y has probability ``weights``."""
    w = weights.to(DTYPE)
    mean = w @ grads
    var = float((w * ((grads - mean) ** 2).sum(-1)).sum())
    return mean, var
