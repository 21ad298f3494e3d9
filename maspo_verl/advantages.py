"""Span credit: GRPO's utterance advantage plus a local per-token term, so that a mispronounced
segment and a well-pronounced one get different advantages, while GRPO gives every token of an
utterance the same one (docs/algorithms.md, "Span credit").

The plugin registers ``compute_span_grpo_advantage`` in verl as ``maspo_span_grpo``
(``algorithm.adv_estimator=maspo_span_grpo``; preset ``credit=span``). Input: verl's
``token_level_rewards`` [B, T]. Each row splits uniquely into

    R_i   = sum_t s_it                     the utterance score (what verl's GRPO uses)
    d_it  = s_it - R_i [t = last valid t]  the local part; sum_t d_it = 0 by construction

so a plain outcome reward (score on the last token) has d = 0, and a per-token reward such as the
speech reward's (``maspo_verl.speech.spans.token_scores``: centred span penalties + score on the last
token) has d = its centred penalties. Then

    A_it = GRPO_i + lam * d_it / max_{j in group(i), u} |d_ju|

GRPO_i is verl's own ``compute_grpo_outcome_advantage`` (same epsilon and
``algorithm.norm_adv_by_std_in_grpo``), so lam = 0 is verl's ``grpo`` exactly. The local term is in
[-lam, lam], zero for a group with no local signal (identical rewards, no spans: no NaN), and sums to
zero over each response, so span credit only moves credit between the tokens of an utterance.
"""

from __future__ import annotations

import numpy as np
import torch

SPAN_GRPO = "maspo_span_grpo"


def last_token(response_mask: torch.Tensor) -> torch.Tensor:
    """Bool [B, T]: True at each row's last valid token."""
    mask = response_mask.bool()
    count = mask.long().cumsum(-1)
    return mask & (count == count[:, -1:])


def local_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """d_it: the rewards with each row's total taken off its last valid token (zero-sum per row)."""
    total = token_level_rewards.sum(-1, keepdim=True)
    return (token_level_rewards - total * last_token(response_mask)) * response_mask


def group_ids(index: np.ndarray, device: torch.device) -> tuple[torch.Tensor, int]:
    """Group number of each sample, grouping ``index`` by value (equality and hash) as verl's grpo does."""
    groups: dict = {}
    ids = [groups.setdefault(key, len(groups)) for key in np.asarray(index, dtype=object).reshape(-1).tolist()]
    return torch.as_tensor(ids, dtype=torch.long, device=device), len(groups)


def normalised_local(local: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """``local`` divided by its largest magnitude in the row's group; 0 where a group has none."""
    ids, n_groups = group_ids(index, local.device)
    row_max = local.abs().amax(-1)
    scale = torch.zeros(n_groups, dtype=local.dtype, device=local.device)
    scale = scale.scatter_reduce(0, ids, row_max, reduce="amax")[ids].unsqueeze(-1)
    return torch.where(scale > 0, local / scale.clamp_min(torch.finfo(local.dtype).tiny), 0.0)


def compute_span_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config=None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl advantage estimator ``maspo_span_grpo`` (see the module docstring); returns (A, A)."""
    # imported here: ``import verl`` loads the plugin, which imports this module
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from maspo_verl.config import SpanCreditConfig

    span = SpanCreditConfig.from_algorithm(config)
    norm = bool(config.get("norm_adv_by_std_in_grpo", True)) if config is not None else True
    utterance, _ = compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm
    )
    if span.lam == 0:
        return utterance, utterance
    with torch.no_grad():
        local = normalised_local(local_scores(token_level_rewards, response_mask), index)
        advantages = utterance + span.lam * local * response_mask
    return advantages, advantages
