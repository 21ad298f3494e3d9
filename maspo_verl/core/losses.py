"""One policy loss body for every token set: token set x normalisation x clip schedule x surrogate
(docs/algorithms.md); the metrics it reports are built in ``maspo_verl.core.metrics``.

``verl_loss_fn(name)`` is the loss of the token set ``name`` (``maspo_verl.core.token_sets``) with
verl's ``PolicyLossFn`` signature, called per micro-batch by verl's ``ppo_loss``; the plugin
registers it. Any token set takes either clip schedule (``clip_schedule``: ratio | log_adaptive) and any
surrogate (``surrogate``: ``maspo_verl.core.surrogates``).

verl and ``maspo_verl.config`` (which imports verl) are imported inside the functions: ``import verl``
loads the plugin, which imports this module, so importing this module must not import verl.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, partial
from typing import TYPE_CHECKING, Any

import torch

from maspo_verl import inspection
from maspo_verl.core.metrics import correlation_sums, metric_sums, metrics_from_sums
from maspo_verl.core.surrogates import SURROGATES, TokenLosses
from maspo_verl.core.tensors import float_mask
from maspo_verl.core.token_sets import TOKEN_SETS
from maspo_verl.util import warn_once

if TYPE_CHECKING:
    from maspo_verl.config import GranularLossConfig

# verl clamps token log-ratios to this range (core_algos.compute_policy_loss_vanilla); the same bound is applied to
# each token's delta and to the shared log-ratio, so exp() never overflows.
LOG_RATIO_CLAMP = 20.0


def granular_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    loss_mode: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of ``loss_mode``'s token set with the configured surrogate (``maspo_verl.core.surrogates``) on
    its shared ratio, in verl's ``PolicyLossFn`` signature (verl's ``ppo_loss`` calls it per
    micro-batch). Returns (the aggregated loss, 0-d; the metrics as floats, after one device-to-host transfer).

    Args:
        old_log_prob: [B, T] log-probs of the sampled tokens under the old (or the inference engine's) policy.
        log_prob: [B, T] log-probs under the current policy; the loss is differentiable in it.
        advantages: [B, T] per-token advantages.
        response_mask: [B, T] the valid response tokens (bool or 0/1).
        loss_agg_mode: verl's aggregation (``agg_mode=seg-mean-token-mean`` overrides it).
        config: verl's actor config (``ActorConfig``), named ``actor`` in the steps below; its ``policy_loss`` must be
            our ``GranularLossConfig``.
        rollout_is_weights: [B, T] or None, rollout-correction weights multiplying each token's loss.
        loss_mode: the token set (``maspo``, ``ctpo``, ``pgspo``), bound by ``verl_loss_fn``.

    Whatever padded positions hold has no effect on the loss or the gradient. A valid token whose
    log-prob or old log-prob is not finite is dropped from the loss (as if padded, so it shares no
    ratio either), counted in ``actor/ratio/nonfinite_tokens`` and warned about.
    """
    from maspo_verl.config import TARGET, GranularLossConfig

    policy_loss = config.policy_loss if config is not None else None
    if not isinstance(policy_loss, GranularLossConfig):
        raise TypeError(
            f"policy_loss.loss_mode={loss_mode!r} needs actor_rollout_ref.actor.policy_loss._target_="
            f"{TARGET} (got {type(policy_loss).__name__}); hydra_configs/maspo_trainer.yaml sets it"
        )
    body = compiled_loss_body(loss_mode) if policy_loss.compile else partial(loss_body, loss_mode=loss_mode)
    step = body(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, policy_loss, rollout_is_weights
    )
    inspected = inspection.due(policy_loss) if policy_loss.inspect_dir is not None else None
    if inspected is not None:  # the one extra transfer of an inspected step
        rows = inspection.record(
            inspection.ROWS, step.mask, old_log_prob, log_prob, advantages, step.ratio, step.token_losses,
            step.segment_ids,
        )  # fmt: skip
        inspection.write(inspected, rows, policy_loss, config, loss_mode)
    metrics = metrics_from_sums(step.metric_sums.tolist(), step.layout)  # the one device-to-host transfer
    if metrics["actor/ratio/nonfinite_tokens"]:
        warn_once(
            "maspo_verl: non-finite log-probs at valid response tokens (corrupted inference-engine log-probs "
            "in bypass mode?); such tokens are dropped from the loss and counted in actor/ratio/nonfinite_tokens",
            RuntimeWarning,
        )
    return step.loss, metrics


def token_log_ratios(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(delta [B, T], kept [B, T] bool) from ``log_prob``, ``old_log_prob`` and ``mask`` [B, T]: delta_t =
    clamp(log pi - log pi_old, +-20), detached, at least float32, zero outside ``kept``, the tokens of ``mask`` whose
    difference is finite. What ``loss_body`` computes inline, for verl's own losses'
    correlation metrics (``maspo_verl.plugin.hooks``) and the lab."""
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    delta = log_prob.detach().to(dtype) - old_log_prob.detach().to(dtype)
    kept = mask.bool() & torch.isfinite(delta)
    return torch.where(kept, delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0), kept


@dataclass
class LossStep:
    """What ``loss_body`` computes on the device: verl's aggregated loss, the metric sums with their layout
    (``metric_sums``), and the per-token tensors an inspected step records."""

    loss: torch.Tensor
    metric_sums: torch.Tensor
    layout: tuple[tuple[str, int], ...]
    mask: torch.Tensor  # the tokens in the loss
    ratio: torch.Tensor  # each token's shared ratio (a value)
    token_losses: TokenLosses
    segment_ids: torch.Tensor | None  # the token set's segment ids (None: not segments, or no inspect_dir)


def loss_body(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    actor: Any,
    policy_loss: GranularLossConfig,
    rollout_is_weights: torch.Tensor | None,
    *,
    loss_mode: str,
) -> LossStep:
    """Steps 1 to 10 of the call (docs/contributing.md), everything of ``granular_policy_loss`` that runs on the
    device: the tokens in the loss, delta, the surrogate's per-token step, the token set's sums, the shared log-ratio,
    the stop-gradient ratio, the clip schedule, the surrogate, verl's aggregation and the metric sums
    (``maspo_verl.core.reference_loss`` is steps 1 to 9 written plainly). Arguments as ``granular_policy_loss``'s, in
    its order, with ``actor`` (verl's actor config: its ``config``) and ``policy_loss`` (``actor.policy_loss``);
    tensors [B, T]. Whatever padded positions hold has no effect on the loss or the gradient.
    """
    response = response_mask.bool()
    dtype = torch.promote_types(log_prob.dtype, torch.float32)  # sums run in float32 or wider
    surrogate = SURROGATES[policy_loss.surrogate]
    with torch.no_grad():  # everything but the surrogate is a value: r's gradient is r * grad log pi
        # 1. the tokens in the loss (``mask``): the response without the tokens whose log-prob or old log-prob is
        # not finite. 2. delta_t = clamp(log pi - log pi_old, +-20), zero outside them (log-probs are <= 0, so no
        # finite pair overflows). One new tensor, then in place (a narrower old_log_prob is widened exactly).
        new, old = log_prob.detach(), old_log_prob.detach()
        if torch.promote_types(old.dtype, dtype) != dtype:
            old = old.to(dtype)
        delta = torch.sub(new, old) if new.dtype == dtype else new.to(dtype).sub_(old)
        mask = torch.isfinite(delta).logical_and_(response)
        delta.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        delta.mul_(float_mask(mask, dtype))  # a product of finite values: a cheaper kernel than a select
        adv = torch.where(mask, advantages.to(dtype), 0.0)
        # 3. the surrogate's step before sharing: the log-ratios the set sums, and which tokens keep their gradient
        # (all but gmpo pass delta on unchanged). The metrics report the token log-ratios as they came.
        delta_sum, correlation_input = delta.sum(), delta
        token_clip = surrogate.clip_tokens(policy_loss, actor, delta, adv)
        # 4. who shares a ratio: the sums of the log-ratios over each token's set S(t) and the set sizes
        sets = TOKEN_SETS[loss_mode].sums(policy_loss, old_log_prob, mask, token_clip.delta)
        keeps_grad, clipped_below, clipped_above = token_clip.keeps_grad, token_clip.below, token_clip.above
        del token_clip  # its log-ratios are summed: freed with delta below (peak memory)
        ids = sets.segment_ids
        num_segments = None if ids is None else ids.amax(dim=-1, keepdim=True) + 1  # K_i [B, 1]
        correlation = correlation_sums(correlation_input, mask, ids)
        del delta, correlation_input  # only their sums are reported (peak memory)
        # 5. l_t = clamp(sum / |S(t)|^alpha, +-20) (alpha 1: a mean, 0: the full product), per set, then per token;
        # where the surrogate reads it, log p_S = sum log pi_old / |S(t)|^alpha, per token (``set_log_prob``)
        set_log_prob = None
        if surrogate.reads_set_probability:
            old_sums = TOKEN_SETS[loss_mode].sum_sets(sets, torch.where(mask, old.to(dtype), 0.0))
            if sets.alpha != 0.0:
                old_sums.div_(sets.sizes.clamp(min=1.0).pow_(sets.alpha))
            set_log_prob = sets.at_tokens(old_sums)
            del old_sums
        if sets.alpha == 0.0:
            log_ratio = sets.totals.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        else:
            n = sets.sizes.clamp(min=1.0)
            if sets.alpha != 1.0:
                n.pow_(sets.alpha)
            log_ratio = torch.div(sets.totals, n, out=n).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            del n
        log_ratio = sets.at_tokens(log_ratio)
        ratio = log_ratio.exp()
        # per-token set sizes n_t, where the clip schedule or the aggregation reads them
        set_sizes = None
        if policy_loss.clip_schedule != "ratio" or policy_loss.agg_mode != "actor":
            set_sizes = sets.at_tokens(sets.sizes)
        rule_metrics = sets.metrics
        del sets
        if policy_loss.inspect_dir is None:  # only an inspected step reads the ids again (int64: peak memory)
            ids = None
    # 6. the ratio in stop-gradient form r_t = exp(sg[l_t] + log pi_t - sg[log pi_t]) (GSPO-token, "Group Sequence
    # Policy Optimization", Zheng et al. 2025): value exp(l_t), gradient r_t grad log pi_t (none at the tokens the
    # surrogate's step 3 clipped)
    log_pi = torch.where(mask, log_prob.to(dtype), 0.0)
    score = log_pi - log_pi.detach()  # value 0, gradient grad log pi
    if keeps_grad is not None:
        score = score * float_mask(keeps_grad, dtype)
    # 7. the clip schedule's bounds (or the surrogate's own parameters), values
    params = surrogate.params(policy_loss, actor, set_sizes, set_log_prob)
    del set_log_prob
    if policy_loss.agg_mode != "seg-mean-token-mean":  # read by the aggregation only there
        set_sizes = None
    # 8. the surrogate's formula; autograd gives its gradient. Times the rollout weights; zero outside the mask.
    # ratio * (1 + score) is ratio * exp(score) at score = 0 exactly, value and gradient, without exp's saved output
    r, log_r = ratio * (1.0 + score), log_ratio + score
    del log_ratio, score
    token_losses = surrogate.loss(r, log_r, adv, log_pi, params)
    del r, log_r, log_pi, adv
    if clipped_below is not None:  # the tokens step 3 clipped count as clipped too
        token_losses.clipped_low = token_losses.clipped_low | clipped_below
        token_losses.clipped_high = token_losses.clipped_high | clipped_above
    loss_mat = token_losses.loss
    if rollout_is_weights is not None:
        loss_mat = loss_mat * torch.where(mask, rollout_is_weights.to(dtype), 0.0)
    token_losses.loss = loss_mat = torch.where(mask, loss_mat, 0.0)
    del params, keeps_grad, clipped_below, clipped_above
    # 9. verl's agg_loss. seg-mean-token-mean weights token t by 1 / (|seg(t)| K_i), K_i the row's number of
    # segments: each row then sums to the mean over its segments of the token-mean inside each, and verl's
    # seq-mean-token-sum averages rows over the global batch (invariant to data parallelism like verl's own modes)
    if policy_loss.agg_mode == "seg-mean-token-mean":
        loss_mat = loss_mat / (set_sizes.clamp(min=1.0) * num_segments.to(loss_mat.dtype))
        loss_agg_mode = "seq-mean-token-sum"
    info = dict(actor.global_batch_info)
    if info.get("dp_size", 1) <= 1 and (info.get("batch_num_tokens") is None or info.get("global_batch_size") is None):
        # verl divides by the micro-batch's own counts when no global ones are given: 0/0 on an
        # all-padding micro-batch. At least one keeps that loss 0 instead of NaN.
        lengths = response.sum(-1)
        if info.get("batch_num_tokens") is None:
            info["batch_num_tokens"] = lengths.sum().clamp(min=1)
        if info.get("global_batch_size") is None:
            info["global_batch_size"] = (lengths > 0).sum().clamp(min=1)
    from verl.trainer.ppo.core_algos import agg_loss

    # a float32 0/1 mask gives verl's values exactly (counts below 2**24) without bool-to-float copies
    loss = agg_loss(loss_mat=loss_mat, loss_mask=float_mask(response), loss_agg_mode=loss_agg_mode, **info)
    # 10. the metrics: raw sums on the device, one vector (moved to the host once by granular_policy_loss)
    sums, layout = metric_sums(
        mask, delta_sum, ratio, token_losses, num_segments, policy_loss.position_buckets, response, rule_metrics,
        correlation,
    )  # fmt: skip
    return LossStep(loss, sums, layout, mask, ratio, token_losses, ids)


# verl's losses that one of our token sets computes exactly (docs/algorithms.md §5): inspected through it
VERL_EQUIVALENTS = {
    "vanilla": {"loss_mode": "maspo", "segment_rule": "fixed", "segment_window": 1},
    "gspo": {"loss_mode": "pgspo", "length_exponent": 1.0},
    "cispo": {"loss_mode": "maspo", "segment_rule": "fixed", "segment_window": 1, "surrogate": "cispo"},
    "sapo": {"loss_mode": "maspo", "segment_rule": "fixed", "segment_window": 1, "surrogate": "sapo"},
    "geo_mean": {"loss_mode": "pgspo", "length_exponent": 1.0, "surrogate": "gmpo"},
    "dppo_tv": {"loss_mode": "maspo", "segment_rule": "fixed", "segment_window": 1, "surrogate": "dppo_tv"},
    "dppo_kl": {"loss_mode": "maspo", "segment_rule": "fixed", "segment_window": 1, "surrogate": "dppo_kl"},
    "dro": {"loss_mode": "maspo", "segment_rule": "fixed", "segment_window": 1, "surrogate": "dro"},
}


def inspect_verl_loss(
    name: str, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
) -> str | None:
    """On an inspected step (``inspection.due``), write what verl's loss ``name`` did: for those of
    ``VERL_EQUIVALENTS`` the ratios and clips of the token set and surrogate that equal
    them (one token / the whole response, verl's ratio-space clip; ``gspo`` has no dual clip in verl), for
    verl's other losses the inputs only.
    Returns the file written, or None."""
    import dataclasses

    pl = config.policy_loss
    step = inspection.due(pl)
    if step is None:
        return None
    response = response_mask.bool()
    same = VERL_EQUIVALENTS.get(name)
    with torch.no_grad():
        if same is None:
            rows = inspection.record(inspection.ROWS, response, old_log_prob, log_prob, advantages)
        else:
            fields = dict(same, clip_schedule="ratio", agg_mode="actor", min_segment_len=0, max_segment_len=0)
            twin = dataclasses.replace(pl, compile=False, **fields)
            out = loss_body(
                old_log_prob, log_prob.detach(), advantages, response_mask, loss_agg_mode, config, twin,
                rollout_is_weights, loss_mode=twin.loss_mode,
            )  # fmt: skip
            ids = TOKEN_SETS[twin.loss_mode].segment_ids(twin, old_log_prob, out.mask)
            rows = inspection.record(
                inspection.ROWS, out.mask, old_log_prob, log_prob, advantages, out.ratio, out.token_losses, ids
            )
    return inspection.write(step, rows, pl, config, name)


@cache
def compiled_loss_body(loss_mode: str):
    """``loss_body`` of one token set through ``torch.compile`` (built on first use). Shapes are
    dynamic, so micro-batches of other lengths reuse the compiled kernels."""
    return torch.compile(partial(loss_body, loss_mode=loss_mode), dynamic=True)


def verl_loss_fn(loss_mode: str):
    """verl ``PolicyLossFn`` of the token set ``loss_mode``."""
    if loss_mode not in TOKEN_SETS:
        raise ValueError(f"loss_mode={loss_mode!r} is not a maspo_verl token set: allowed {', '.join(TOKEN_SETS)}")
    return partial(granular_policy_loss, loss_mode=loss_mode)
