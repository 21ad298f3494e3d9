"""What the objective does with the shared ratio (``policy_loss.surrogate``; docs/algorithms.md §2).

Who shares a ratio (``maspo_verl.token_sets``) and what the objective does with it are separate
choices: each class of ``SURROGATES`` applies to whatever ratio the token set gives. r_t is the shared
ratio's value exp(l_t); in the stop-gradient form its gradient is r_t grad log pi_t (``ratios``).

| name    | loss_t                                                     | clip masks (low / high / dual)        |
|---------|------------------------------------------------------------|---------------------------------------|
| `ppo`   | max(-A r, -A clip(r, lo, hi)); A < 0: min(., -A c)         | the clips that are active             |
| `cispo` | -sg[clip(r, lo, hi)] A log pi_t                            | weight clipped below / above; none    |
| `sapo`  | -A (4 / tau) sigmoid(tau (r - 1)), tau_pos (A > 0) else tau_neg | gate saturated below / above; none |

``ppo`` and ``cispo`` take their bounds from the clip schedule (``maspo_verl.clipping``); ``sapo`` reads
the actor's ``tau_pos``/``tau_neg`` (verl's fields). Each returns its loss values, the masks and
d loss_t / d log pi_t in closed form; ``apply`` turns that into one autograd node that saves one tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from maspo_verl import clipping
from maspo_verl.util import registrar
from maspo_verl.validation import Choice, Setting, check_choice, check_float, fail

DEFAULT = "ppo"
# SAPO's gate is "saturated" where it passes less than half of the unclipped gradient:
# 4 s (1 - s) < 1/2 with s = sigmoid(z), i.e. |z| > 2 ln(1 + sqrt 2) ~= 1.763, z = tau (r - 1)
SAPO_SATURATION = 2.0 * math.log(1.0 + math.sqrt(2.0))


@dataclass
class TokenLosses:
    """Per-token loss and the boolean masks reported as clip fractions (``low``, ``high``, ``dual``)."""

    loss: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    clipped_dual: torch.Tensor


class Surrogate:
    """One objective on the shared ratio. ``values`` gets the advantages zeroed outside the kept tokens."""

    name: ClassVar[str]
    # the clip schedules it accepts (None: any)
    clip_schedules: ClassVar[tuple[str, ...] | None] = None

    def check(self, policy_loss: Any) -> None:
        """Refuse settings that make no sense with this surrogate (``FieldError``)."""
        schedules = self.clip_schedules
        if schedules is not None and policy_loss.clip_schedule not in schedules:
            fail(
                "clip_schedule",
                policy_loss.clip_schedule,
                f"{', '.join(schedules)} with surrogate={self.name!r} ({self.why_schedule})",
            )

    why_schedule: ClassVar[str] = ""

    def check_actor(self, actor: Any) -> None:
        """Check the actor fields this surrogate reads (start-up, on the driver)."""

    def params(self, pl: Any, actor: Any, sizes: torch.Tensor | None) -> Any:
        return clipping.clip_bounds(pl, actor, sizes)

    def values(self, log_prob, ratio, log_ratio, adv, params, keep):
        """(loss, clipped_low, clipped_high, clipped_dual, d loss / d log pi), all [B, T]."""
        raise NotImplementedError


SURROGATES: dict[str, Surrogate] = {}
register_surrogate = registrar(SURROGATES)
# the policy-loss field that selects one (``maspo_verl.config`` builds the field from it)
SETTINGS = (
    Setting(
        "surrogate",
        DEFAULT,
        Choice(lambda: tuple(SURROGATES)),
        "what the objective does with the shared ratio: PPO's clip, CISPO's clipped weight, SAPO's soft gate",
    ),
)


@register_surrogate
class PPOClip(Surrogate):
    """PPO's pessimistic clip with dual clip, on the schedule's bounds (``clipping.pessimistic_values``)."""

    name = "ppo"

    def values(self, log_prob, ratio, log_ratio, adv, params, keep):
        return clipping.pessimistic_values(ratio, log_ratio, adv, params)


@register_surrogate
class CISPO(Surrogate):
    """CISPO ("MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention"): the clipped
    ratio is a stop-gradient weight on A log pi, so a clipped token keeps its gradient, bounded. The
    bounds are the schedule's (``ratio``: the actor's ``clip_ratio_low/high``, as verl's ``cispo``; no
    dual clip, ``clip_ratio_c`` and ``log_clip_dual`` are unused)."""

    name = "cispo"

    def values(self, log_prob, ratio, log_ratio, adv, params, keep):
        weight, clipped_low, clipped_high = clipping.clipped_weights(ratio, log_ratio, params)
        coef = weight.mul_(adv).neg_()  # -sg[clip(r)] A
        log_pi = clipping.zero_outside(log_prob.detach(), keep, ratio.dtype)
        return coef * log_pi, clipped_low, clipped_high, torch.zeros_like(clipped_low), coef


@register_surrogate
class SAPO(Surrogate):
    """SAPO ("Soft Adaptive Policy Optimization"): a sigmoid gate f(r) = (4 / tau) sigmoid(tau (r - 1))
    instead of a hard clip: f'(1) = 1, so near on-policy the gradient is PPO's, and it fades smoothly
    off-policy. Temperatures from the actor's ``tau_pos`` (A > 0) and
    ``tau_neg`` (A <= 0), as verl's ``sapo``."""

    name = "sapo"
    clip_schedules = ("ratio",)
    why_schedule = "SAPO's gate has no clip bounds; it reads the actor's tau_pos/tau_neg"

    def check_actor(self, actor: Any) -> None:
        for name in ("tau_pos", "tau_neg"):
            value = actor.get(name, None)
            if value is None:
                fail(f"actor_rollout_ref.actor.{name}", value, "a number > 0 (surrogate=sapo needs verl's SAPO fields)")
            check_float(f"actor_rollout_ref.actor.{name}", value, 0.0, lo_open=True)

    def params(self, pl, actor, sizes):
        return float(actor.tau_pos), float(actor.tau_neg)

    def values(self, log_prob, ratio, log_ratio, adv, params, keep):
        tau_pos, tau_neg = params
        tau = torch.full_like(ratio, tau_neg).masked_fill_(adv > 0, tau_pos)
        z = (ratio - 1.0).mul_(tau)
        saturated_low, saturated_high = z < -SAPO_SATURATION, z > SAPO_SATURATION
        s = z.sigmoid_()
        # d f(r) / d log pi = f'(r) r = 4 s (1 - s) r
        coef = torch.rsub(s, 1.0).mul_(s).mul_(ratio).mul_(adv).mul_(-4.0)
        loss = s.mul_(adv).div_(tau).mul_(-4.0)
        return loss, saturated_low, saturated_high, torch.zeros_like(saturated_low), coef


def check_config(policy_loss: Any) -> None:
    """``policy_loss.surrogate``: one of ``SURROGATES``, only with our token sets (verl's own losses ignore
    it), and what the surrogate refuses (``Surrogate.check``)."""
    from maspo_verl.token_sets import TOKEN_SETS

    check_choice("surrogate", policy_loss.surrogate, tuple(SURROGATES))
    if policy_loss.surrogate != DEFAULT and policy_loss.loss_mode not in TOKEN_SETS:
        fail(
            "surrogate",
            policy_loss.surrogate,
            f"{DEFAULT!r} with loss_mode={policy_loss.loss_mode!r} (verl's own losses ignore it; ours: "
            f"{', '.join(TOKEN_SETS)}; verl's token-level cispo and sapo are loss modes of their own)",
        )
    SURROGATES[policy_loss.surrogate].check(policy_loss)


class _ClosedForm(torch.autograd.Function):
    """A surrogate's loss values with d loss_t / d log pi_t from its closed form: forward runs without
    autograd and saves that one tensor."""

    @staticmethod
    def forward(ctx, log_prob, ratio, log_ratio, advantages, surrogate, params, weights, keep):
        loss, low, high, dual, coef = _values(surrogate, log_prob, ratio, log_ratio, advantages, params, weights, keep)
        ctx.save_for_backward(coef)
        ctx.grad_dtype = log_prob.dtype
        ctx.mark_non_differentiable(low, high, dual)
        return loss, low, high, dual

    @staticmethod
    def backward(ctx, grad_loss, *_):
        (coef,) = ctx.saved_tensors
        grad = torch.empty(coef.shape, dtype=ctx.grad_dtype, device=coef.device)
        return torch.mul(grad_loss, coef, out=grad), None, None, None, None, None, None, None


def _values(surrogate, log_prob, ratio, log_ratio, advantages, params, weights, keep):
    """``surrogate.values`` with the advantages and the weights zero outside ``keep``; the weights (rollout
    correction) multiply loss and gradient."""
    adv = clipping.zero_outside(advantages, keep, ratio.dtype)
    weights = None if weights is None else clipping.zero_outside(weights, keep, ratio.dtype)
    loss, low, high, dual, coef = surrogate.values(log_prob, ratio, log_ratio, adv, params, keep)
    if weights is not None:
        loss.mul_(weights)
        coef.mul_(weights)
    return loss, low, high, dual, coef


def apply(
    surrogate: Surrogate,
    log_prob: torch.Tensor,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    params: Any,
    weights: torch.Tensor | None = None,
    log_ratio: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> TokenLosses:
    """Per-token loss of ``surrogate`` with the shared ratio ``ratio`` (a value; no graph needed),
    differentiable in ``log_prob``; ``weights`` (rollout correction) multiply loss and gradient.
    Log-space bounds (``params.scale`` set) need ``log_ratio`` = log(ratio). Outside ``keep`` (the tokens
    in the loss) loss and gradient are zero, whatever advantages, weights and log-probs hold there."""
    if keep is None:
        keep = torch.ones(ratio.shape, dtype=torch.bool, device=ratio.device)
    if getattr(params, "scale", None) is not None and log_ratio is None:
        raise ValueError("log-space clip bounds need log_ratio")
    ratio = ratio.detach()
    log_ratio = None if log_ratio is None else log_ratio.detach()
    if torch.compiler.is_compiling():
        # The same values and gradient in stop-gradient form: torch.compile's tracer (seen with torch
        # 2.11) loses the gradient of the Function below, whose forward never reads log_prob's graph.
        with torch.no_grad():
            loss, low, high, dual, coef = _values(
                surrogate, log_prob, ratio, log_ratio, advantages, params, weights, keep
            )
        zero = torch.where(keep, log_prob - log_prob.detach(), 0.0)  # 0, with gradient 1 at kept tokens
        return TokenLosses(loss + coef * zero, low, high, dual)
    loss, low, high, dual = _ClosedForm.apply(log_prob, ratio, log_ratio, advantages, surrogate, params, weights, keep)
    return TokenLosses(loss, low, high, dual)
