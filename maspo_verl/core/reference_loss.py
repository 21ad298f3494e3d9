"""The granular policy loss written plainly, top to bottom: the tests' oracle for ``maspo_verl.core.losses``
(docs/algorithms.md has the maths).

    1. which tokens are in the loss      valid tokens whose log-probs are finite
    2. token log-ratios                  delta_t = clamp(log pi_t - log pi_old_t, +-20), a value
    3. the surrogate's per-token step    delta_t as it is (gmpo: clipped by the sign of A_t, gradient mask g_t)
    4. who shares a ratio                S(t): t's segment (maspo), the prefix {1..t} (ctpo), the response (pgspo)
    5. the shared log-ratio              l_t = clamp(sum_{u in S(t)} delta_u / |S(t)|^alpha, +-20); the set's
                                         old log-probability log p_S = sum_{u in S(t)} log pi_old_u / |S(t)|^alpha
    6. the ratio, stop-gradient form     r_t = exp(sg[l_t]) exp(g_t (log pi_t - sg[log pi_t])): value exp(l_t),
                                         gradient r_t g_t grad log pi_t (g_t = 1 but at gmpo's clipped tokens)
    7. the clip schedule                 ratio: 1 - eps_low, 1 + eps_high, c; log_adaptive: exp(-+eps n_t^p)
                                         (DPPO: divergence bounds eps or eps n_t^(k p), truncation c)
    8. the surrogate                     its formula (``maspo_verl.core.surrogates``), times the rollout weights
    9. verl's aggregation                ``agg_loss``; seg-mean-token-mean weights token t by 1 / (|S(t)| K_i)

No fast paths: [B, T, T] membership matrices instead of scatters and cumulative sums, clip bounds as per-token
tensors, no in-place ops. The surrogate's formula is the one the loss runs (each is one formula, pinned by its worked
examples); the steps around it are written again here. Slow and memory-hungry; for tests and readers.
The segments come from the rule's plain per-row loop (``SegmentRule.reference``), then ``min_segment_len`` /
``max_segment_len`` as loops over the row (``maspo_verl.core.segments.reference``), not from the production
segmentation; what each rule does is pinned by its worked examples (``SegmentRule.examples``).
"""

from __future__ import annotations

from typing import Any

import torch

from maspo_verl.core.segments.reference import reference_segment_ids
from maspo_verl.core.surrogates import SURROGATES, ClipBounds, DivergenceBounds

LOG_RATIO_CLAMP = 20.0  # verl's bound on a token's log-ratio (compute_policy_loss_vanilla)


def reference_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    actor: Any,
    rollout_is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss of ``actor.policy_loss`` (our ``GranularLossConfig``) on one micro-batch, a 0-d tensor differentiable
    in ``log_prob``; the arguments are verl's ``PolicyLossFn``'s (``old_log_prob``, ``log_prob``, ``advantages``,
    ``response_mask``, ``rollout_is_weights``: [B, T]; ``actor``: verl's actor config, its ``config``)."""
    from verl.trainer.ppo.core_algos import agg_loss

    policy_loss = actor.policy_loss
    B, T = log_prob.shape

    # 1. the tokens in the loss
    response = response_mask.bool()
    kept = response & torch.isfinite(log_prob) & torch.isfinite(old_log_prob)

    # 2. token log-ratios (values; zero outside the kept tokens)
    delta = torch.where(kept, (log_prob.detach() - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)

    # 3. the surrogate's per-token step (its formula, as the loss runs it)
    surrogate = SURROGATES[policy_loss.surrogate]
    adv = torch.where(kept, advantages, 0.0)
    token_clip = surrogate.clip_tokens(policy_loss, actor, delta, adv)
    delta = token_clip.delta
    keeps_grad = torch.ones_like(kept) if token_clip.keeps_grad is None else token_clip.keeps_grad

    # 4. who shares a ratio: member[b, t, u] is True when token u is in S(t)
    both_kept = kept[:, :, None] & kept[:, None, :]
    position = torch.arange(T, device=log_prob.device)
    if policy_loss.loss_mode == "maspo":
        ids = reference_segment_ids(kept, policy_loss, old_log_prob=old_log_prob, log_ratio=delta)
        member = both_kept & (ids[:, :, None] == ids[:, None, :])
        alpha = policy_loss.length_exponent
    elif policy_loss.loss_mode == "pgspo":
        member = both_kept
        alpha = policy_loss.length_exponent
    elif policy_loss.loss_mode == "ctpo":
        member = both_kept & (position[None, None, :] <= position[None, :, None])
        alpha = 0.0 if policy_loss.ctpo_mode == "cumprod" else 1.0
    else:
        raise ValueError(f"reference_loss: no token set {policy_loss.loss_mode!r}")
    set_size = member.sum(-1).to(delta.dtype)  # n_t = |S(t)|

    # 5. the shared log-ratio, and the set's old log-probability log p_S, whose new / old ratio it is
    total = (member * delta[:, None, :]).sum(-1)
    shared_log_ratio = (total / set_size.clamp(min=1.0) ** alpha).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    old_kept = torch.where(kept, old_log_prob, 0.0)
    set_log_prob = (member * old_kept[:, None, :]).sum(-1) / set_size.clamp(min=1.0) ** alpha

    # 6. the ratio: value exp(l_t), gradient r_t g_t grad log pi_t
    log_pi = torch.where(kept, log_prob, 0.0)
    score = torch.where(keeps_grad, log_pi - log_pi.detach(), 0.0)
    ratio = torch.exp(shared_log_ratio) * torch.exp(score)

    # 7. the clip bounds: lower, upper, dual; DPPO's divergence bounds and truncation (k: the divergence's order)
    eps_low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
    eps_high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
    if policy_loss.clip_schedule == "ratio":
        bounds = (1.0 - eps_low, 1.0 + eps_high, actor.get("clip_ratio_c", 3.0))
        low, high, dual = (torch.full_like(ratio, float(bound)) for bound in bounds)
        divergence = (eps_low, eps_high, actor.get("clip_ratio_c", 20.0))
        div_low, div_high, cap = (torch.full_like(ratio, float(bound)) for bound in divergence)
    else:  # log_adaptive
        scale = set_size.clamp(min=1.0) ** policy_loss.clip_exponent
        low = torch.exp(-policy_loss.log_clip_low * scale)
        high = torch.exp(policy_loss.log_clip_high * scale)
        dual = cap = torch.exp(policy_loss.log_clip_dual * scale)
        k = getattr(surrogate, "order", 1)
        div_low, div_high = policy_loss.log_clip_low * scale**k, policy_loss.log_clip_high * scale**k

    # 8. the surrogate's formula on r (its gradient is autograd's), zero outside the kept tokens
    params = surrogate.params(policy_loss, actor, set_size, set_log_prob)
    if isinstance(params, ClipBounds):  # the bounds of step 7, whatever the schedule
        params = ClipBounds(low, high, dual)
    elif isinstance(params, DivergenceBounds):
        params = DivergenceBounds(div_low, div_high, cap, set_log_prob)
    log_r = shared_log_ratio + score
    token_loss = surrogate.loss(ratio, log_r, adv, log_pi, params).loss
    if rollout_is_weights is not None:
        token_loss = token_loss * torch.where(kept, rollout_is_weights, 0.0)
    token_loss = torch.where(kept, token_loss, 0.0)

    # 9. verl's aggregation
    if policy_loss.agg_mode == "seg-mean-token-mean":
        earlier = position[None, None, :] < position[None, :, None]
        first_of_set = kept & ~(member & earlier).any(-1)
        num_sets = first_of_set.sum(-1, keepdim=True).clamp(min=1).to(token_loss.dtype)  # K_i
        token_loss = token_loss / (set_size.clamp(min=1.0) * num_sets)
        loss_agg_mode = "seq-mean-token-sum"
    info = dict(actor.global_batch_info)
    if info.get("dp_size", 1) <= 1:  # verl's own counts of the micro-batch, at least one
        if info.get("batch_num_tokens") is None:
            info["batch_num_tokens"] = response.sum().clamp(min=1)
        if info.get("global_batch_size") is None:
            info["global_batch_size"] = response.any(-1).sum().clamp(min=1)
    # the mask as verl's actor passes it: float32 0/1 (its denominators, + 1e-8, are then float32 too)
    return agg_loss(loss_mat=token_loss, loss_mask=response.float(), loss_agg_mode=loss_agg_mode, **info)
