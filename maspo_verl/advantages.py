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

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import numpy as np
import torch

SPAN_GRPO = "maspo_span_grpo"
TURN_GRPO = "maspo_turn_grpo"
# the estimators the plugin registers in verl, in this order
ESTIMATOR_NAMES = (SPAN_GRPO, TURN_GRPO)
# verl's agent loops' per-turn fields (non-tensor batch / extra_fields), in the order turn credit reads them
TURN_SCORE_KEYS = ("turn_scores", "tool_rewards")


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


def grpo_advantage(token_level_rewards, response_mask, index, epsilon, config) -> torch.Tensor:
    """verl's own ``grpo`` advantage with the algorithm config's ``norm_adv_by_std_in_grpo``."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    norm = bool(config.get("norm_adv_by_std_in_grpo", True)) if config is not None else True
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm
    )
    return advantages


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
    from maspo_verl.config import SpanCreditConfig

    span = SpanCreditConfig.from_algorithm(config)
    utterance = grpo_advantage(token_level_rewards, response_mask, index, epsilon, config)
    if span.lam == 0:
        return utterance, utterance
    with torch.no_grad():
        local = normalised_local(local_scores(token_level_rewards, response_mask), index)
        advantages = utterance + span.lam * local * response_mask
    return advantages, advantages


# ---------------------------------------------------------------------------------------------------- turn credit
# verl hands an advantage estimator tensors only; the plugin's hooks put the batch's per-turn scores (one list per
# sample, in batch order) in scope for the duration of verl's advantage step (maspo_verl.plugin.turn_credit).
_TURN_SCORES: contextvars.ContextVar[Sequence | None] = contextvars.ContextVar("maspo_turn_scores", default=None)


@contextlib.contextmanager
def turn_scores_scope(scores: Sequence | None) -> Iterator[None]:
    """``scores[i]``: sample i's per-turn scores (a list, possibly empty, or None) for the estimator below."""
    token = _TURN_SCORES.set(scores)
    try:
        yield
    finally:
        _TURN_SCORES.reset(token)


def current_turn_scores() -> Sequence | None:
    return _TURN_SCORES.get()


def turn_score_lists(fields: dict) -> list | None:
    """The per-turn scores of one sample's verl fields: ``turn_scores`` where not empty, else ``tool_rewards``
    where not empty, else None."""
    for key in TURN_SCORE_KEYS:
        value = fields.get(key) if hasattr(fields, "get") else None
        if value is not None and len(value):
            return [float(v) for v in value]
    return None


def turn_ids(response_mask: torch.Tensor) -> torch.Tensor:
    """Turn number of each valid token (the ``turns`` segment rule: a run of valid tokens is a turn)."""
    from maspo_verl.rollout_correction import rule_segment_ids, segmentation_config

    return rule_segment_ids(response_mask, segmentation_config("turns", {}))


def turn_terms(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, ids: torch.Tensor, scores: Sequence | None
) -> torch.Tensor:
    """e_ik per turn slot ([B, T], slot k = turn k; docs/algorithms.md "Turn credit"): a sample with per-turn
    scores s_i1..s_iM gets e_ik = s_ik - mean_{m<=M'} s_im on its first M' = min(M, K_i) turns (0 on the others);
    a sample without gets the turn sums of its per-token local scores (span credit's d_it). Each row sums to 0."""
    from maspo_verl.rollout_correction import segment_reduce, segment_slots_valid

    mask = response_mask.to(token_level_rewards.dtype)
    terms = segment_reduce(local_scores(token_level_rewards, mask), mask, ids, "sum")
    if scores is None:
        return terms
    B, T = mask.shape
    if len(scores) != B:
        raise ValueError(f"turn credit: {len(scores)} samples' turn scores for a batch of {B}")
    lists = [None if s is None or not len(s) else [float(v) for v in s][:T] for s in scores]
    if not any(lists):
        return terms
    given = torch.zeros(B, T, dtype=terms.dtype)
    has = torch.zeros(B, T, dtype=torch.bool)
    for i, values in enumerate(lists):  # host-side lists of the non-tensor batch: one row each
        if values:
            given[i, : len(values)] = torch.tensor(values, dtype=terms.dtype)
            has[i, : len(values)] = True
    given, has = given.to(terms.device), has.to(terms.device)
    has &= segment_slots_valid(response_mask, ids)
    count = has.sum(-1, keepdim=True)
    centred = torch.where(has, given - (given * has).sum(-1, keepdim=True) / count.clamp_min(1), 0.0)
    with_scores = torch.tensor([bool(v) for v in lists], device=terms.device).unsqueeze(-1)
    return torch.where(with_scores, centred, terms)


def compute_turn_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config=None,
    turn_scores: Sequence | None = None,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl advantage estimator ``maspo_turn_grpo`` (turn credit, docs/algorithms.md): GRPO's episode advantage
    plus lam * e_{i,k(t)} / max_{j in group(i), k} |e_jk|. ``turn_scores``: per sample, verl's per-turn scores
    (default: those the plugin's hook put in scope). No per-turn signal: verl's ``grpo`` exactly."""
    from maspo_verl.config import TurnCreditConfig

    credit = TurnCreditConfig.from_algorithm(config)
    episode = grpo_advantage(token_level_rewards, response_mask, index, epsilon, config)
    if credit.lam == 0:
        return episode, episode
    scores = current_turn_scores() if turn_scores is None else turn_scores
    with torch.no_grad():
        ids = turn_ids(response_mask)
        terms = turn_terms(token_level_rewards, response_mask, ids, scores)
        from maspo_verl.rollout_correction import to_tokens

        local = to_tokens(normalised_local(terms, index), response_mask.to(terms.dtype), ids)
        advantages = episode + credit.lam * local
    return advantages, advantages
