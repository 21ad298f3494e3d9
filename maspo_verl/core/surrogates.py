"""What the objective does with the shared ratio (``policy_loss.surrogate``; docs/algorithms.md §2).

Who shares a ratio (``maspo_verl.core.token_sets``) and what the objective does with it are separate
choices: each class of ``SURROGATES`` applies to whatever ratio the token set gives. A surrogate is one
formula: its per-token loss as a function of the ratio r_t = exp(sg[l_t] + log pi_t - sg[log pi_t]) (value
exp(l_t), gradient r_t grad log pi_t), the advantage A_t and log pi_t; autograd gives its gradient.

| name    | loss_t                                                          | clip masks (low / high / dual)        |
|---------|-----------------------------------------------------------------|---------------------------------------|
| `ppo`   | max(-A r, -A clip(r, lo, hi)); A < 0: min(., -A c)              | the clips that are active             |
| `cispo` | -sg[clip(r, lo, hi)] A log pi_t                                 | weight clipped below / above; none    |
| `sapo`  | -A (4 / tau) sigmoid(tau (r - 1)), tau_pos (A > 0) else tau_neg | gate saturated below / above; none    |
| `tis`   | -sg[min(r, c)] A log pi_t                                       | none / weight truncated at c; none    |
| `gmpo`  | ppo's on r, the geometric mean of per-token clipped ratios      | token clipped below / above; dual     |
| `dppo_tv` | -sg[m min(r, c)] A log pi_t, m = 0 where p_S left the TV bound | masked (A <= 0 / A > 0); truncated   |
| `dppo_kl` | the same with the binary KL                                   | masked (A <= 0 / A > 0); truncated   |
| `dro`   | -A log pi_t + (beta / 2) (log r)^2                              | none                                  |

``dppo_tv`` and ``dppo_kl`` (DPPO-Binary) bound the divergence between the old and new probability of the token's
set, p_S = exp(sum_{S(t)} log pi_old / |S(t)|^alpha) (``Surrogate.reads_set_probability``) and p_S r, by the actor's
``clip_ratio_low/high`` (ratio schedule) or ``log_clip_low/high`` n^(k p) (log_adaptive), and truncate the weight at
c. ``dro`` reads verl's ``policy_loss.dro_beta`` (``Surrogate.requires``).

Every surrogate also sees each token's log-ratio before the token set shares it (``Surrogate.clip_tokens``, step 3
of the call): all but ``gmpo`` pass it on unchanged. ``gmpo`` (GMPO, "Geometric-Mean Policy Optimization", Zhao et
al. 2025; verl's ``geo_mean``) clips delta_t in log space by the sign of A_t there and stops the gradient of the
clipped tokens, so the shared ratio is the geometric mean of the clipped token ratios over each set.

``ppo``, ``cispo`` and ``tis`` take their bounds from the clip schedule (``policy_loss.clip_schedule``: ``ClipBounds``):

- ratio-space (verl-compatible): lo = 1 - eps_low, hi = 1 + eps_high, c = clip_ratio_c;
- log-space, length-adaptive (CTPO-LA of "Rethinking Importance Sampling in LLM Policy Optimization: A Cumulative
  Token Perspective", generalised to any token set): lo_t = exp(-eps_low n_t^p), hi_t = exp(eps_high n_t^p),
  c_t = exp(eps_c n_t^p), n_t = |S(t)| (segment size, prefix length or response length).

``gmpo`` clips each token on its own (n = 1, ``TokenBand``): lo = -eps_low, hi = eps_high in log space, verl's
``clip_ratio_low/high`` (ratio schedule, as verl's ``geo_mean``) or ``log_clip_low/high`` (log_adaptive).
``sapo`` reads the actor's ``tau_pos``/``tau_neg`` (verl's fields) into ``SapoTemperatures``. Each declares worked
examples (``Example``), which the discovered tests run. A new surrogate: docs/surrogates.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

import torch

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


@dataclass
class TokenClip:
    """A surrogate's step before sharing (``Surrogate.clip_tokens``): the token log-ratios [B, T] the token set
    sums, and, where it clips tokens, which keep their gradient and which were clipped below / above (bool [B, T];
    None: every token keeps its gradient, none clipped)."""

    delta: torch.Tensor
    keeps_grad: torch.Tensor | None = None
    below: torch.Tensor | None = None
    above: torch.Tensor | None = None


def unclipped(loss: torch.Tensor) -> TokenLosses:
    """A loss with no clip masks (a surrogate that clips nothing)."""
    none = torch.zeros(loss.shape, dtype=torch.bool, device=loss.device)
    return TokenLosses(loss, none, none, none)


class Clipped(NamedTuple):
    """What ``ClipBounds.clip`` gives for a ratio r: clip(r, lo, hi) (r, with its gradient, inside the band), where
    r < lo, where r > hi; the dual clip's constant c as a value and where max(r, lo) > c."""

    ratio: torch.Tensor
    below: torch.Tensor
    above: torch.Tensor
    cap: torch.Tensor | float
    over_cap: torch.Tensor


@dataclass
class ClipBounds:
    """Bounds lo < 1 < hi and dual-clip constant c of the ratio r, scalars or per token.

    With ``scale`` set they are log-space: the bounds of the log-ratio l = log r are ``low * scale``,
    ``high * scale``, ``dual * scale``, and r is compared through l (no bound is exponentiated to decide a clip).
    """

    low: torch.Tensor | float
    high: torch.Tensor | float
    dual: torch.Tensor | float
    scale: torch.Tensor | None = None

    def clip(self, r: torch.Tensor, log_r: torch.Tensor) -> Clipped:
        """The bounds applied to r (``log_r``: log r, through which log-space bounds compare): ``Clipped``."""
        if self.scale is None:
            low, high, dual = self.low, self.high, self.dual
            return Clipped(torch.clamp(r, low, high), r < low, r > high, dual, r.clamp(min=low) > dual)
        low, high, dual = self.scale * self.low, self.scale * self.high, self.scale * self.dual
        below, above = log_r < low, log_r > high
        clipped = torch.where(below, low.exp(), torch.where(above, high.exp(), r))
        return Clipped(clipped, below, above, dual.exp(), torch.maximum(log_r, low) > dual)


@dataclass(frozen=True)
class SapoTemperatures:
    """SAPO's gate temperatures: ``positive`` where A > 0, ``negative`` elsewhere."""

    positive: float
    negative: float


@dataclass(frozen=True)
class Example:
    """A worked example of a surrogate: with the shared ratios ``ratio``, advantages ``advantage`` and log-probs
    ``log_prob`` (-1 each when empty) of one row of tokens, the per-token ``loss`` and ``grad`` (d loss_t /
    d log pi_t), worked out by hand from the surrogate's formula (the test checks autograd's gradient against
    it). ``settings``: policy-loss fields; ``actor``: ``maspo_verl.config.actor_config``'s clip arguments
    (``clip_low``, ``clip_high``, ``clip_c``); ``sizes``: the set sizes n_t a log-space schedule reads.
    ``token_log_ratio``: where given, the row is one token set of these token log-ratios delta_t, and ``ratio``
    is the shared ratio the test expects after ``Surrogate.clip_tokens`` (the same value at every token).
    ``old_log_prob``: each token's set log-probability under the old policy, log p_S (the surrogates that read it,
    ``Surrogate.reads_set_probability``); by default log_prob - log ratio, each token a set of its own."""

    why: str
    ratio: tuple[float, ...]
    advantage: tuple[float, ...]
    loss: tuple[float, ...]
    grad: tuple[float, ...]
    log_prob: tuple[float, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    actor: dict[str, Any] = field(default_factory=dict)
    sizes: tuple[float, ...] | None = None
    token_log_ratio: tuple[float, ...] | None = None
    old_log_prob: tuple[float, ...] | None = None


# a surrogate's parameters: ``ClipBounds`` for the clipped ones, ``SapoTemperatures`` for SAPO
Params = TypeVar("Params")


class Surrogate(Generic[Params]):
    """One objective on the shared ratio: its parameters (``params``), its formula (``loss``) and its worked
    examples (``examples``, required)."""

    name: ClassVar[str]
    # its own policy-loss fields (``Setting``), like a segment rule's
    settings: ClassVar[tuple[Setting, ...]] = ()
    # the clip schedules it accepts (None: any), and why
    clip_schedules: ClassVar[tuple[str, ...] | None] = None
    why_schedule: ClassVar[str] = ""
    examples: ClassVar[tuple[Example, ...]] = ()
    # reads each token's set log-probability under the old policy, log p_S = sum_{u in S(t)} log pi_old_u /
    # |S(t)|^alpha, the quantity whose new / old ratio is the shared ratio (``params``' ``set_log_prob``)
    reads_set_probability: ClassVar[bool] = False
    # verl's policy-loss fields without a default that it needs, and the values tools and tests give them where a
    # config sets none (``switch_fields``; ``dro``: ``dro_beta``)
    requires: ClassVar[dict[str, Any]] = {}

    def check(self, policy_loss: Any) -> None:
        """Refuse settings that make no sense with this surrogate (``FieldError``)."""
        schedules = self.clip_schedules
        if schedules is not None and policy_loss.clip_schedule not in schedules:
            fail(
                "clip_schedule",
                policy_loss.clip_schedule,
                f"{', '.join(schedules)} with surrogate={self.name!r} ({self.why_schedule})",
            )

    def check_actor(self, actor: Any) -> None:
        """Check the actor fields this surrogate reads (start-up, on the driver)."""

    def clip_tokens(self, policy_loss: Any, actor: Any, delta: torch.Tensor, adv: torch.Tensor) -> TokenClip:
        """Step 3 of the call, before the token set shares anything: ``delta`` [B, T] (each token's log-ratio, a
        value, zero outside the loss) and ``adv`` [B, T] (zero outside the loss) to the log-ratios the set sums
        (``TokenClip``). By default they pass unchanged and every token keeps its gradient."""
        return TokenClip(delta)

    def params(
        self, policy_loss: Any, actor: Any, sizes: torch.Tensor | None, set_log_prob: torch.Tensor | None = None
    ) -> Params:
        """Its parameters from the configs: by default the bounds of ``policy_loss.clip_schedule`` (log_adaptive reads
        ``sizes``, the per-token set sizes n_t; ratio-space bounds are verl's actor scalars ``clip_ratio_low/high``,
        else ``clip_ratio``, and ``clip_ratio_c``). ``set_log_prob`` [B, T]: log p_S per token, given to the
        surrogates that read it (``reads_set_probability``), else None."""
        pl = policy_loss
        if pl.clip_schedule == "log_adaptive":
            scale = sizes.clamp(min=1.0)
            if pl.clip_exponent != 1.0:
                scale.pow_(pl.clip_exponent)
            return ClipBounds(-pl.log_clip_low, pl.log_clip_high, pl.log_clip_dual, scale=scale)
        low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
        high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
        return ClipBounds(1.0 - low, 1.0 + high, actor.get("clip_ratio_c", 3.0))

    def loss(self, r: torch.Tensor, log_r: torch.Tensor, adv: torch.Tensor, log_pi: torch.Tensor, params: Params):
        """The per-token loss and its clip masks (``TokenLosses``), [B, T], differentiable in ``r``, ``log_r``
        (log r, value l_t) and ``log_pi``; ``adv`` and ``log_pi`` are zero outside the tokens in the loss."""
        raise NotImplementedError


SURROGATES: dict[str, Surrogate] = {}
register_surrogate = registrar(SURROGATES)
# the policy-loss field that selects one, shared by all (``maspo_verl.config`` builds the fields from it and from
# each surrogate's ``settings``)
SETTINGS = (
    Setting(
        "surrogate",
        DEFAULT,
        Choice(lambda: tuple(SURROGATES)),
        "what the objective does with the shared ratio: PPO's clip, CISPO's clipped weight, SAPO's soft gate, "
        "truncated IS, GMPO's geometric mean of per-token clipped ratios, DPPO-Binary's TV or KL trust region on "
        "the probability, DRO's log-ratio penalty",
    ),
)


@register_surrogate
class PPOClip(Surrogate[ClipBounds]):
    """PPO's pessimistic clip with dual clip, on the schedule's bounds: max(-A r, -A clip(r, lo, hi)), at most -A c
    where A < 0."""

    name = "ppo"
    # verl's default ratio-space bounds: lo 0.8, hi 1.2, dual clip c 3
    examples = (
        Example(
            "A > 0: -A r up to hi (gradient -A r), -A hi above it (no gradient); A < 0: -A max(r, lo), at most "
            "-A c (dual clip); A = 0: nothing",
            ratio=(1.1, 1.5, 0.5, 0.5, 1.5, 5.0, 2.0),
            advantage=(1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.0),
            loss=(-1.1, -1.2, -0.5, 0.8, 1.5, 3.0, 0.0),
            grad=(-1.1, 0.0, -0.5, 0.0, 1.5, 0.0, 0.0),
            actor={"clip_low": 0.2, "clip_high": 0.2, "clip_c": 3.0},
        ),
        Example(
            "log_adaptive: n = 4, p = -0.5, eps 0.2: hi = exp(0.2 / 2) = 1.1051709180756477",
            ratio=(1.2, 1.05),
            advantage=(1.0, 2.0),
            loss=(-1.1051709180756477, -2.1),
            grad=(0.0, -2.1),
            settings={
                "clip_schedule": "log_adaptive",
                "log_clip_low": 0.2,
                "log_clip_high": 0.2,
                "log_clip_dual": 1.0,
                "clip_exponent": -0.5,
            },
            sizes=(4.0, 4.0),
        ),
    )

    def loss(self, r, log_r, adv, log_pi, params):
        clipped, below, above, c, over_c = params.clip(r, log_r)
        minus_adv = -adv  # one tensor, which autograd saves once for both products (peak memory)
        pessimistic = torch.maximum(minus_adv * r, minus_adv * clipped)
        del clipped
        negative, cap = adv < 0, minus_adv * c
        del c
        loss = torch.where(negative, torch.minimum(pessimistic, cap), pessimistic)  # dual clip
        return TokenLosses(loss, negative & below, (adv > 0) & above, negative & over_c)


@register_surrogate
class CISPO(Surrogate[ClipBounds]):
    """CISPO ("MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention"): the clipped
    ratio is a stop-gradient weight on A log pi, so a clipped token keeps its gradient, bounded. The
    bounds are the schedule's (``ratio``: the actor's ``clip_ratio_low/high``, as verl's ``cispo``; no
    dual clip, ``clip_ratio_c`` and ``log_clip_dual`` are unused)."""

    name = "cispo"
    examples = (
        Example(
            "loss -w A log pi, gradient -w A, with the weight w = clip(r, 0.8, 1.2): bounded where r is clipped",
            ratio=(1.1, 1.5, 0.5),
            advantage=(1.0, 1.0, -2.0),
            log_prob=(-0.5, -0.5, -0.5),
            loss=(0.55, 0.6, -0.8),
            grad=(-1.1, -1.2, 1.6),
            actor={"clip_low": 0.2, "clip_high": 0.2},
        ),
    )

    def loss(self, r, log_r, adv, log_pi, params):
        weight = params.clip(r.detach(), log_r.detach())
        return TokenLosses(-(weight.ratio * adv) * log_pi, weight.below, weight.above, torch.zeros_like(weight.below))


@register_surrogate
class SAPO(Surrogate[SapoTemperatures]):
    """SAPO ("Soft Adaptive Policy Optimization"): a sigmoid gate f(r) = (4 / tau) sigmoid(tau (r - 1))
    instead of a hard clip: f'(1) = 1, so near on-policy the gradient is PPO's, and it fades smoothly
    off-policy. Temperatures from the actor's ``tau_pos`` (A > 0) and
    ``tau_neg`` (A <= 0), as verl's ``sapo``."""

    name = "sapo"
    clip_schedules = ("ratio",)
    why_schedule = "SAPO's gate has no clip bounds; it reads the actor's tau_pos/tau_neg"
    # verl's default temperatures: tau_pos 1 (A > 0), tau_neg 1.05
    examples = (
        Example(
            "at r = 1 the gate passes PPO's gradient -A; s = sigmoid(tau (r - 1)): loss -A (4 / tau) s, "
            "gradient -4 A s (1 - s) r (r = 1.5, A = 1: s = sigmoid(0.5); r = 0.5, A = -1: s = sigmoid(-0.525))",
            ratio=(1.0, 1.5, 0.5),
            advantage=(1.0, 1.0, -1.0),
            loss=(-2.0, -2.4898373248074184, 1.4159383303033666),
            grad=(-1.0, -1.410022273209567, 0.4670699116426963),
        ),
    )

    def check_actor(self, actor: Any) -> None:
        for name in ("tau_pos", "tau_neg"):
            value = actor.get(name, None)
            if value is None:
                fail(f"actor_rollout_ref.actor.{name}", value, "a number > 0 (surrogate=sapo needs verl's SAPO fields)")
            check_float(f"actor_rollout_ref.actor.{name}", value, 0.0, lo_open=True)

    def params(self, policy_loss, actor, sizes, set_log_prob=None) -> SapoTemperatures:
        return SapoTemperatures(float(actor.tau_pos), float(actor.tau_neg))

    def loss(self, r, log_r, adv, log_pi, params):
        tau = torch.full_like(adv, params.negative).masked_fill_(adv > 0, params.positive)
        z = tau * (r - 1.0)
        loss = torch.sigmoid(z) * adv / tau * -4.0
        return TokenLosses(loss, z < -SAPO_SATURATION, z > SAPO_SATURATION, torch.zeros_like(adv, dtype=torch.bool))


@register_surrogate
class TruncatedIS(Surrogate[ClipBounds]):
    """Truncated importance sampling (REINFORCE with the ratio as a stop-gradient weight, truncated at c, as
    IMPALA's rho-bar): every token keeps a gradient, at most c A. The cap is the clip schedule's dual constant
    c (``clip_ratio_c``, or exp(log_clip_dual n^p)); lo and hi are unused."""

    name = "tis"
    examples = (
        Example(
            "loss -w A log pi, gradient -w A, with the weight w = min(r, 3): r = 5 is truncated to 3, r = 0.5 is not",
            ratio=(1.5, 5.0, 0.5),
            advantage=(1.0, 1.0, -2.0),
            log_prob=(-0.5, -0.5, -0.5),
            loss=(0.75, 1.5, -0.5),
            grad=(-1.5, -3.0, 1.0),
            actor={"clip_c": 3.0},
        ),
    )

    def loss(self, r, log_r, adv, log_pi, params):
        c = params.clip(r, log_r).cap
        truncated = r.detach() > c
        weight = torch.where(truncated, c, r.detach())
        none = torch.zeros_like(truncated)
        return TokenLosses(-(weight * adv) * log_pi, none, truncated, none)


@dataclass(frozen=True)
class TokenBand:
    """GMPO's band, at n = 1 whatever the schedule: log-space ``low`` (eps_low) and ``high`` (eps_high), and the dual
    clip's constant ``dual`` (a ratio). ``ratio``: verl's ``clip_ratio_low/high`` (else ``clip_ratio``) as log bounds,
    as verl's ``geo_mean`` reads them, and ``clip_ratio_c``; ``log_adaptive``: ``log_clip_low/high`` and
    exp(``log_clip_dual``)."""

    low: float
    high: float
    dual: float


@register_surrogate
class GMPO(Surrogate[TokenBand]):
    """GMPO ("Geometric-Mean Policy Optimization", Zhao et al. 2025; verl's ``geo_mean``): before sharing, each
    token's log-ratio is clipped by the sign of its advantage, delta'_t = min(delta_t, eps_high) where A_t > 0,
    max(delta_t, -eps_low) where A_t < 0, 0 where A_t = 0 (verl's sign(A) gives 0), and a clipped token's log pi
    gets no gradient. The token set then shares the mean (alpha = 1: the geometric mean of the clipped token
    ratios), and the loss is PPO's on that ratio with the same band and the dual clip: where a set's advantages
    share one sign the band cannot bind after the token clip, so the loss is -A r_t up to the dual clip at c
    (A < 0), which also bounds sets of mixed signs and the product (alpha = 0). The band is at n = 1
    (``TokenBand``): each token is clipped on its own, so ``clip_exponent`` is unused."""

    name = "gmpo"
    examples = (
        Example(
            "one set of 4 tokens, A = 1, band +-0.2: delta (0.5, 0.1, -0.3, 0) -> (0.2, 0.1, -0.3, 0) (only the "
            "high side binds where A > 0), r = exp(0 / 4) = 1; loss_t -A r, gradient -A r at the kept tokens, 0 at "
            "the clipped first",
            token_log_ratio=(0.5, 0.1, -0.3, 0.0),
            ratio=(1.0, 1.0, 1.0, 1.0),
            advantage=(1.0, 1.0, 1.0, 1.0),
            loss=(-1.0, -1.0, -1.0, -1.0),
            grad=(0.0, -1.0, -1.0, -1.0),
            actor={"clip_low": 0.2, "clip_high": 0.2},
        ),
        Example(
            "A = -2, band (-0.1, +0.3) in log space: delta (-0.5, 0.4, 0.0) -> (-0.1, 0.4, 0.0) (only the low side "
            "binds where A < 0), r = exp(0.3 / 3) = exp(0.1); loss 2 r, gradient 2 r at the kept tokens",
            token_log_ratio=(-0.5, 0.4, 0.0),
            ratio=(math.exp(0.1),) * 3,
            advantage=(-2.0, -2.0, -2.0),
            loss=(2.0 * math.exp(0.1),) * 3,
            grad=(0.0, 2.0 * math.exp(0.1), 2.0 * math.exp(0.1)),
            settings={"clip_schedule": "log_adaptive", "log_clip_low": 0.1, "log_clip_high": 0.3, "log_clip_dual": 1.0},
        ),
        Example(
            "at the cutoff: delta = eps_high exactly with A > 0 is not clipped (keeps its gradient); A = 0 "
            "shares log-ratio 0 (verl's sign(A) = 0); r = exp((0.2 + 0) / 2) = exp(0.1)",
            token_log_ratio=(0.2, 0.7),
            ratio=(math.exp(0.1),) * 2,
            advantage=(1.0, 0.0),
            loss=(-math.exp(0.1), 0.0),
            grad=(-math.exp(0.1), 0.0),
            settings={"clip_schedule": "log_adaptive", "log_clip_low": 0.2, "log_clip_high": 0.2},
        ),
        Example(
            "A < 0 and the shared ratio above the dual constant: delta (2.5, 2.5) -> r = exp(2.5) > c = 3: loss "
            "-A c, no gradient (as PPO's dual clip)",
            token_log_ratio=(2.5, 2.5),
            ratio=(math.exp(2.5),) * 2,
            advantage=(-1.0, -1.0),
            loss=(3.0, 3.0),
            grad=(0.0, 0.0),
            actor={"clip_low": 0.2, "clip_high": 0.2, "clip_c": 3.0},
        ),
    )

    def params(self, policy_loss, actor, sizes, set_log_prob=None) -> TokenBand:
        if policy_loss.clip_schedule == "log_adaptive":
            pl = policy_loss
            return TokenBand(float(pl.log_clip_low), float(pl.log_clip_high), math.exp(pl.log_clip_dual))
        low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
        high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
        return TokenBand(float(low), float(high), float(actor.get("clip_ratio_c", 3.0)))

    def clip_tokens(self, policy_loss, actor, delta, adv):
        band = self.params(policy_loss, actor, None)
        below = (adv < 0) & (delta < -band.low)
        above = (adv > 0) & (delta > band.high)
        clipped = torch.where(below, -band.low, torch.where(above, band.high, delta)).masked_fill_(adv == 0, 0.0)
        return TokenClip(clipped, ~(below | above), below, above)

    def loss(self, r, log_r, adv, log_pi, params):
        bounds = ClipBounds(math.exp(-params.low), math.exp(params.high), params.dual)
        return SURROGATES["ppo"].loss(r, log_r, adv, log_pi, bounds)


@dataclass
class DivergenceBounds:
    """DPPO's trust region on each token's set probability p_S (old: exp(``set_log_prob``), new: p_S r): ``high``
    bounds the divergence where it rose (checked where A > 0), ``low`` where it fell (A <= 0), and ``cap`` truncates
    the ratio as a weight (c); scalars or per token [B, T]."""

    low: torch.Tensor | float
    high: torch.Tensor | float
    cap: torch.Tensor | float
    set_log_prob: torch.Tensor


# verl's guard inside the binary KL's log((1 - p_old + g) / (1 - p_new + g)) (core_algos.compute_policy_loss_dppo_kl)
BINARY_KL_GUARD = 1e-8


class DPPO(Surrogate[DivergenceBounds]):
    """DPPO-Binary ("Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879; verl's ``dppo_tv``,
    ``dppo_kl``): the trust region bounds the binary divergence between the old and new probability of the
    sampled outcome instead of the ratio. Here that outcome is the token's set: p_S = exp(sum_{S(t)} log pi_old /
    |S(t)|^alpha) (the token's own probability at one token per set), whose new / old ratio is the shared ratio,
    so p_S' = p_S r. A token is masked (no loss, no gradient) where A > 0 and p_S rose by more than ``high``, or
    A <= 0 and it fell by more than ``low``; the rest is truncated IS: loss -sg[min(r, c)] A log pi. Bounds:
    ``ratio``: the actor's ``clip_ratio_low/high`` (else ``clip_ratio``) as divergences and ``clip_ratio_c`` as c,
    as verl's; ``log_adaptive``: ``log_clip_low/high`` n^(k p), k the divergence's order in the log-ratio near
    r = 1 (``order``), and c = exp(``log_clip_dual`` n^p)."""

    reads_set_probability = True
    # the divergence's order in log r near r = 1 (TV: p |l|, KL: p l^2 / (2 (1 - p))): log_adaptive scales its
    # bounds by n^(order p), so the log-ratio they allow scales as n^p, as the schedule's ratio bounds do
    order: ClassVar[int] = 1

    def check_actor(self, actor: Any) -> None:
        if actor.policy_loss.get("clip_schedule", "ratio") == "ratio":
            for name in ("clip_ratio_low", "clip_ratio_high"):
                value = actor.get(name, None)
                value, name = (value, name) if value is not None else (actor.get("clip_ratio", None), "clip_ratio")
                check_float(f"actor_rollout_ref.actor.{name}", value, 0.0, lo_open=True)
        check_float("actor_rollout_ref.actor.clip_ratio_c", actor.get("clip_ratio_c", 20.0), 0.0, lo_open=True)

    def params(self, policy_loss, actor, sizes, set_log_prob=None) -> DivergenceBounds:
        pl = policy_loss
        if pl.clip_schedule == "log_adaptive":
            n = sizes.clamp(min=1.0)
            bound_scale, cap = n.pow(pl.clip_exponent * self.order), n.pow(pl.clip_exponent).mul_(pl.log_clip_dual)
            return DivergenceBounds(
                pl.log_clip_low * bound_scale, pl.log_clip_high * bound_scale, cap.exp_(), set_log_prob
            )
        low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
        high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
        return DivergenceBounds(float(low), float(high), float(actor.get("clip_ratio_c", 20.0)), set_log_prob)

    def within(self, p_old, p_new, log_r, bounds: DivergenceBounds) -> tuple[torch.Tensor, torch.Tensor]:
        """(within the high bound, within the low bound), bool [B, T], of the move p_old -> p_new (log_r: its log)."""
        raise NotImplementedError

    def loss(self, r, log_r, adv, log_pi, params):
        ratio, log_ratio = r.detach(), log_r.detach()
        p_old = params.set_log_prob.exp()
        within_high, within_low = self.within(p_old, p_old * ratio, log_ratio, params)
        positive = adv > 0
        above, below = positive & ~within_high, ~positive & ~within_low
        kept = ~(above | below)
        truncated = kept & (ratio > params.cap)
        weight = torch.where(truncated, params.cap, ratio) * kept
        return TokenLosses(-(weight * adv) * log_pi, below, above, truncated)


@register_surrogate
class DPPOTV(DPPO):
    """DPPO-Binary-TV: the binary total variation |p_S' - p_S| = p_S |r - 1|."""

    name = "dppo_tv"
    examples = (
        Example(
            "p_S = 0.5, bounds 0.2, c = 3: r = 1.2, A > 0: p rose by 0.1, kept (loss -w A log pi, gradient -w A); "
            "r = 1.5, A > 0: rose by 0.25 > 0.2, masked (high); r = 1.5, A < 0: only a fall is bounded, kept; r = 0.5, "
            "A < 0: fell by 0.25, masked (low); p_S = 0.1, r = 5, A < 0: kept, weight truncated to 3 (dual); r = 0.5, "
            "A > 0: kept; r = 0.8, A < 0: fell by 0.1 <= 0.2, kept; A = 0 is bounded as A < 0 (as verl's), masked",
            ratio=(1.2, 1.5, 1.5, 0.5, 5.0, 0.5, 0.8, 0.5),
            advantage=(1.0, 1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 0.0),
            log_prob=(-0.5,) * 8,
            old_log_prob=(math.log(0.5),) * 4 + (math.log(0.1),) + (math.log(0.5),) * 3,
            loss=(0.6, 0.0, -0.75, 0.0, -1.5, 0.25, -0.4, 0.0),
            grad=(-1.2, 0.0, 1.5, 0.0, 3.0, -0.5, 0.8, 0.0),
            actor={"clip_low": 0.2, "clip_high": 0.2, "clip_c": 3.0},
        ),
        Example(
            "the set's probability, not the token's: p_S = 0.25 (a set whose mean log pi_old is log 0.25), r = 1.5: "
            "p_S rose by 0.125 <= 0.2, kept (at p = 0.5 the token alone would rise by 0.25, masked); p_S = 0.9, "
            "r = 0.7: fell by 0.27 > 0.2 with A < 0, masked",
            ratio=(1.5, 0.7),
            advantage=(2.0, -1.0),
            log_prob=(-0.5, -0.5),
            old_log_prob=(math.log(0.25), math.log(0.9)),
            loss=(1.5, 0.0),
            grad=(-3.0, 0.0),
            actor={"clip_low": 0.2, "clip_high": 0.2, "clip_c": 3.0},
        ),
        Example(
            "log_adaptive: n = 4, p = 0.5: bounds 0.05 * 2 = 0.1, c = exp(0.5 * 2) = e; p_S = 0.5: r = 1.15 rose by "
            "0.075, kept; r = 1.3 rose by 0.15, masked; r = 3, A < 0: kept, weight truncated to e",
            ratio=(1.15, 1.3, 3.0),
            advantage=(1.0, 1.0, -1.0),
            log_prob=(-0.5,) * 3,
            old_log_prob=(math.log(0.5),) * 3,
            loss=(0.575, 0.0, -math.e / 2),
            grad=(-1.15, 0.0, math.e),
            settings={
                "clip_schedule": "log_adaptive",
                "log_clip_low": 0.05,
                "log_clip_high": 0.05,
                "log_clip_dual": 0.5,
                "clip_exponent": 0.5,
            },
            sizes=(4.0, 4.0, 4.0),
        ),
    )

    def within(self, p_old, p_new, log_r, bounds):
        change = p_new - p_old
        return change <= bounds.high, change >= -bounds.low


@register_surrogate
class DPPOKL(DPPO):
    """DPPO-Binary-KL: the binary KL p_S log(p_S / p_S') + (1 - p_S) log((1 - p_S) / (1 - p_S')), bounded only in
    the direction the advantage pushes (a rise where A > 0, a fall where A <= 0)."""

    name = "dppo_kl"
    order = 2
    examples = (
        Example(
            "p_S = 0.5, bounds 0.05: r = 1.2 (p' = 0.6): KL = 0.5 ln(5/6) + 0.5 ln(5/4) = 0.0204 <= 0.05, kept; "
            "r = 1.5 (p' = 0.75): KL = 0.5 ln(2/3) + 0.5 ln 2 = 0.1438, masked (high) where A > 0, kept where A < 0 "
            "(a rise); r = 0.5 (p' = 0.25): KL = 0.1438, masked (low) where A < 0, kept where A > 0; p_S = 0.1, "
            "r = 4, A < 0: a rise, kept, weight truncated to 3",
            ratio=(1.2, 1.5, 1.5, 0.5, 0.5, 4.0),
            advantage=(1.0, 1.0, -1.0, -1.0, 1.0, -1.0),
            log_prob=(-0.5,) * 6,
            old_log_prob=(math.log(0.5),) * 5 + (math.log(0.1),),
            loss=(0.6, 0.0, -0.75, 0.0, 0.25, -1.5),
            grad=(-1.2, 0.0, 1.5, 0.0, -0.5, 3.0),
            actor={"clip_low": 0.05, "clip_high": 0.05, "clip_c": 3.0},
        ),
        Example(
            "log_adaptive: n = 4, p = -0.5: KL bounds 0.1 * 4^(2 * -0.5) = 0.025, c = exp(2 * 4^-0.5) = e; "
            "p_S = 0.5, r = 1.2: KL = 0.0204 <= 0.025, kept; r = 0.7 (p' = 0.35): KL = 0.5 ln(1/0.7) + "
            "0.5 ln(0.5/0.65) = 0.0472 (within order 1's 0.05), masked (low) where A < 0",
            ratio=(1.2, 0.7),
            advantage=(1.0, -1.0),
            log_prob=(-0.5, -0.5),
            old_log_prob=(math.log(0.5),) * 2,
            loss=(0.6, 0.0),
            grad=(-1.2, 0.0),
            settings={
                "clip_schedule": "log_adaptive",
                "log_clip_low": 0.1,
                "log_clip_high": 0.1,
                "log_clip_dual": 2.0,
                "clip_exponent": -0.5,
            },
            sizes=(4.0, 4.0),
        ),
    )

    def within(self, p_old, p_new, log_r, bounds):
        guard = BINARY_KL_GUARD
        kl = p_old * -log_r + (1.0 - p_old) * torch.log((1.0 - p_old + guard) / (1.0 - p_new + guard))
        return (kl <= bounds.high) | (log_r <= 0), (kl <= bounds.low) | (log_r >= 0)


@dataclass(frozen=True)
class DroPenalty:
    """DRO's penalty weight beta (verl's ``policy_loss.dro_beta``)."""

    beta: float


@register_surrogate
class DRO(Surrogate[DroPenalty]):
    """DRO (verl's ``dro``, "Direct Reward Optimization"): REINFORCE with a quadratic penalty on the shared
    log-ratio, loss -A log pi + (beta / 2) l^2, gradient (-A + beta l) grad log pi: the penalty pulls each token
    back towards its set's old probability in proportion to how far the set's ratio moved. beta is verl's
    ``policy_loss.dro_beta`` (required, > 0)."""

    name = "dro"
    requires = {"dro_beta": 1.0}
    clip_schedules = ("ratio",)
    why_schedule = "DRO has no clip bounds: its penalty's weight is policy_loss.dro_beta"
    examples = (
        Example(
            "beta = 0.5, log pi = -0.5: l = 0: loss -A log pi = 0.5, gradient -A; l = 0.4, A = 1: loss 0.5 + 0.25 * "
            "0.16, gradient -1 + 0.5 * 0.4; l = -2, A = -1: loss -0.5 + 0.25 * 4, gradient 1 - 1 = 0; A = 0, l = 1: "
            "the penalty alone, loss 0.25, gradient 0.5",
            ratio=(1.0, math.exp(0.4), math.exp(-2.0), math.e),
            advantage=(1.0, 1.0, -1.0, 0.0),
            log_prob=(-0.5,) * 4,
            loss=(0.5, 0.54, 0.5, 0.25),
            grad=(-1.0, -0.8, 0.0, 0.5),
            settings={"dro_beta": 0.5},
        ),
    )

    def check(self, policy_loss: Any) -> None:
        super().check(policy_loss)
        beta = getattr(policy_loss, "dro_beta", None)
        if beta is None:
            fail("dro_beta", beta, "a number > 0 with surrogate='dro' (the weight of DRO's penalty, verl's field)")
        check_float("dro_beta", beta, 0.0, lo_open=True)

    def params(self, policy_loss, actor, sizes, set_log_prob=None) -> DroPenalty:
        return DroPenalty(float(policy_loss.dro_beta))

    def loss(self, r, log_r, adv, log_pi, params):
        return unclipped(0.5 * params.beta * log_r.square() - adv * log_pi)


def switch_fields(policy_loss: dict[str, Any], name: str) -> dict[str, Any]:
    """The policy-loss fields ``policy_loss`` with surrogate ``name``: its first accepted clip schedule where
    ``clip_schedule`` is not one, and the fields it requires (``Surrogate.requires``) that are unset, at their
    tools' values. How tests, the benchmark and the lab put any surrogate on a preset."""
    surrogate = SURROGATES[name]
    fields = {**policy_loss, "surrogate": name}
    schedules = surrogate.clip_schedules
    if schedules is not None and fields.get("clip_schedule", "ratio") not in schedules:
        fields["clip_schedule"] = schedules[0]
    for key, value in surrogate.requires.items():
        if fields.get(key) is None:
            fields[key] = value
    return fields


def check_config(policy_loss: Any) -> None:
    """``policy_loss.surrogate``: one of ``SURROGATES``, only with our token sets (verl's own losses ignore
    it), and what the surrogate refuses (``Surrogate.check``)."""
    from maspo_verl.core.token_sets import TOKEN_SETS

    check_choice("surrogate", policy_loss.surrogate, tuple(SURROGATES))
    if policy_loss.surrogate != DEFAULT and policy_loss.loss_mode not in TOKEN_SETS:
        fail(
            "surrogate",
            policy_loss.surrogate,
            f"{DEFAULT!r} with loss_mode={policy_loss.loss_mode!r} (verl's own losses ignore it; ours: "
            f"{', '.join(TOKEN_SETS)}; verl's token-level cispo and sapo are loss modes of their own)",
        )
    SURROGATES[policy_loss.surrogate].check(policy_loss)
