"""Hyperparameters of the granular losses, as a verl ``PolicyLossConfig`` subclass, and of the span
credit advantage estimator (``SpanCreditConfig``, ``algorithm.span_credit``).

Every field of ``GranularLossConfig`` is declared once as a ``Setting`` (name, default, allowed values, one
line), in one shape everywhere: what a part shares in a module-level ``SETTINGS`` (the loss's own in
``LOSS_SETTINGS`` below, the segmentation's in ``maspo_verl.core.segments.compute``, the surrogate selector in
``maspo_verl.core.surrogates``) and what each registered member owns in its class's ``settings`` (each rule in
``maspo_verl/core/segments/rules/``, each token set in ``maspo_verl.core.token_sets``, each surrogate). The
dataclass, its checks, the Hydra defaults in ``hydra_configs/maspo_base.yaml`` and the README's field table are
made from them (``python -m maspo_verl generate`` writes the last two). Selected with
``actor_rollout_ref.actor.policy_loss._target_=maspo_verl.config.GranularLossConfig`` (our
``hydra_configs/maspo_trainer.yaml`` sets it). verl builds it with ``hydra.utils.instantiate``, which does not
type-check, so every field is checked in ``__post_init__``: a bad value fails when verl converts the actor
config at start-up (``validate_config`` in the driver), not at the first update. Importing this module
registers nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from verl.workers.config import ActorConfig, PolicyLossConfig

from maspo_verl.core import segments, surrogates
from maspo_verl.core.segments import SEGMENT_RULES
from maspo_verl.core.token_sets import TOKEN_SETS
from maspo_verl.validation import Bool, Choice, Float, Int, OptionalPath, Setting, check_float, fail, reject_unknown

if TYPE_CHECKING:  # the declared fields for static tools (generated: maspo_verl/config_fields.py)
    from maspo_verl.config_fields import GranularLossFields
else:
    GranularLossFields = object

MAX_POSITION_BUCKETS = 64
# the loss's own settings: normalisation, clipping, aggregation, metrics, compilation, inspection
LOSS_SETTINGS = (
    Setting("length_exponent", 1.0, Float(0.0, 1.0), "α of ℓ_t = Σ δ / abs(S(t))^α (`maspo`, `pgspo`; 1 = mean)"),
    Setting(
        "clip_schedule", "ratio", Choice(("ratio", "log_adaptive")), "ratio: verl's clip_ratio_*; log_adaptive: below"
    ),
    Setting("log_clip_low", 0.025, Float(0.0, lo_open=True), "log_adaptive: ε_low of the lower bound exp(−ε_low n^p)"),
    Setting("log_clip_high", 0.05, Float(0.0, lo_open=True), "log_adaptive: ε_high of the upper bound exp(ε_high n^p)"),
    Setting("log_clip_dual", 0.05, Float(0.0, lo_open=True), "log_adaptive: ε_c of the dual clip exp(ε_c n^p)"),
    # |p| <= 1 covers CTPO (+-0.5) and P-GSPO (1 - alpha); beyond, n^p makes bounds that never clip
    Setting("clip_exponent", 0.5, Float(-1.0, 1.0), "log_adaptive: p, with n = abs(S(t))"),
    Setting(
        "agg_mode",
        "actor",
        Choice(("actor", "seg-mean-token-mean")),
        "actor: actor.loss_agg_mode; seg-mean-token-mean: token-mean per segment, mean over segments, then sequences",
    ),
    Setting("position_buckets", 4, Int(1, MAX_POSITION_BUCKETS), "equal parts of the response for clipfrac_posKofN"),
    Setting("compile", False, Bool(), "run the loss through torch.compile (fused kernels, for GPUs)"),
    Setting(
        "inspect_dir", None, OptionalPath(), "a folder rank 0's loss writes samples of its segments to (null: off)"
    ),
    Setting("inspect_every", 10, Int(1), "steps between two `inspect_dir` samples"),
)


def declared_settings() -> tuple[Setting, ...]:
    """Every field of ``GranularLossConfig``: each part's shared settings, then its members' (registry order):
    the segmentation and the rules, the loss and the token sets, the surrogate selector and the surrogates."""
    parts = (
        (segments.compute.SETTINGS, SEGMENT_RULES),
        (LOSS_SETTINGS, TOKEN_SETS),
        (surrogates.SETTINGS, surrogates.SURROGATES),
    )
    declared = tuple(s for shared, members in parts for s in (*shared, *members_settings(members)))
    names = [s.name for s in declared]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"policy_loss fields declared more than once: {twice}")
    return declared


def members_settings(members: dict) -> tuple[Setting, ...]:
    """The settings the registered ``members`` (rules, token sets, surrogates) declare on their classes."""
    return tuple(s for member in members.values() for s in member.settings)


SETTINGS = declared_settings()


def check_loss_mode(loss_mode: Any) -> None:
    """``loss_mode`` must be in verl's policy-loss registry; for ours, say why the plugin is missing."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    if loss_mode in POLICY_LOSS_REGISTRY:
        return
    if loss_mode in TOKEN_SETS:
        problem = load_plugin()
        if loss_mode in POLICY_LOSS_REGISTRY:
            return
        raise RuntimeError(
            f"policy_loss.loss_mode={loss_mode!r} is not registered in verl: the maspo_verl plugin did not "
            f"load ({problem or 'loaded, but registered nothing'}). "
            "Run `python -m maspo_verl check` in the same environment."
        )
    fail("loss_mode", loss_mode, "a loss registered in verl: one of " + ", ".join(sorted(POLICY_LOSS_REGISTRY)))


def load_plugin() -> str | None:
    """Load our ``verl.plugins`` entry point as ``import verl`` does; None, or why it failed.

    verl logs a failing plugin at debug level only; this is how the config finds the reason.
    """
    import traceback
    from importlib.metadata import entry_points

    ours = [ep for ep in entry_points(group="verl.plugins") if ep.value.split(".")[0] == "maspo_verl"]
    if not ours:
        return "no `verl.plugins` entry point of maspo_verl: is maspo-verl installed in this environment?"
    for ep in ours:
        try:
            ep.load()
        except Exception as exc:  # noqa: BLE001 - the reason is the message
            where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            at = f" at {where.filename}:{where.lineno}" if where else ""
            return f"entry point {ep.name} = {ep.value} raised {type(exc).__name__}: {exc}{at}"
    return None


def _declared_fields(cls):
    """``cls`` as a dataclass with one field per declared setting (annotation and default from it)."""
    cls.__annotations__ = {s.name: s.allowed.type for s in SETTINGS}
    for s in SETTINGS:
        mutable = isinstance(s.default, list | dict)
        setattr(cls, s.name, field(default_factory=lambda d=s.default: copy.deepcopy(d)) if mutable else s.default)
    return dataclass(cls)


@_declared_fields
class GranularLossConfig(PolicyLossConfig, GranularLossFields):
    """Token set x normalisation x clip schedule (docs/algorithms.md); one field per declared ``SETTINGS``.

    ``loss_mode`` picks the token set (``maspo_verl.core.token_sets``): ``maspo`` (segments), ``ctpo``
    (prefixes), ``pgspo`` (whole response). verl's own modes (``vanilla``, ``gspo``, ...) may also be
    selected with this config; they ignore our fields.
    """

    def __post_init__(self):
        check_loss_mode(self.loss_mode)
        for s in SETTINGS:
            object.__setattr__(self, s.name, s.check(getattr(self, s.name)))
        segments.compute.validate(self)
        surrogates.check_config(self)
        token_set = TOKEN_SETS.get(self.loss_mode)
        if self.agg_mode != "actor" and token_set is not None and not token_set.partition:
            fail("agg_mode", self.agg_mode, f"'actor' with loss_mode={self.loss_mode!r} (its sets are not a partition)")


def _reject_unknown_fields(cls) -> None:
    """Wrap the dataclass ``__init__`` so an unknown field names the allowed ones (``+policy_loss.x=``)."""
    generated = cls.__init__

    def __init__(self, *args, **kwargs):
        reject_unknown("policy_loss", kwargs, [f.name for f in fields(cls) if f.init], TypeError, "fields")
        generated(self, *args, **kwargs)

    cls.__init__ = __init__


_reject_unknown_fields(GranularLossConfig)
# what ``policy_loss._target_`` names to select it
TARGET = f"{GranularLossConfig.__module__}.{GranularLossConfig.__qualname__}"


def actor_config(clip_low=0.2, clip_high=0.28, clip_c=3.0, loss_agg_mode="token-mean", **policy_loss) -> ActorConfig:
    """A verl ``ActorConfig`` around our policy-loss dataclass, to call the losses outside the trainer
    (``fn(old, new, adv, mask, loss_agg_mode, actor_config(...))``); ``loss_mode`` defaults to ``maspo``."""
    policy_loss.setdefault("loss_mode", "maspo")
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=clip_low,
        clip_ratio_high=clip_high,
        clip_ratio_c=clip_c,
        loss_agg_mode=loss_agg_mode,
        policy_loss=GranularLossConfig(**policy_loss),
    )


@dataclass(frozen=True)
class SpanCreditConfig:
    """``algorithm.span_credit`` of the ``maspo_span_grpo`` advantage estimator (maspo_verl.advantages).

    ``lam``: weight of the local (per-token) term added to GRPO's utterance advantage; 0 gives verl's
    ``grpo`` advantages exactly.
    """

    lam: float = 0.5

    def __post_init__(self):
        check_float("algorithm.span_credit.lam", self.lam, 0.0)

    @classmethod
    def from_algorithm(cls, algorithm: Any) -> SpanCreditConfig:
        """From verl's ``algorithm`` config (DictConfig, dict or None); unknown keys are errors."""
        section = algorithm.get("span_credit", None) if algorithm is not None else None
        if section is None:
            return cls()
        if isinstance(section, SpanCreditConfig):
            return section
        values = {k: v for k, v in dict(section).items() if k != "_target_"}
        reject_unknown("algorithm.span_credit", values, [f.name for f in fields(cls)])
        return cls(**values)


@dataclass(frozen=True)
class TurnCreditConfig:
    """``algorithm.turn_credit`` of the ``maspo_turn_grpo`` advantage estimator (maspo_verl.advantages).

    ``lam``: weight of the per-turn term added to GRPO's episode advantage; 0 gives verl's ``grpo`` exactly.
    """

    lam: float = 0.5

    def __post_init__(self):
        check_float("algorithm.turn_credit.lam", self.lam, 0.0)

    @classmethod
    def from_algorithm(cls, algorithm: Any) -> TurnCreditConfig:
        """From verl's ``algorithm`` config (DictConfig, dict or None); unknown keys are errors."""
        section = algorithm.get("turn_credit", None) if algorithm is not None else None
        if section is None:
            return cls()
        if isinstance(section, TurnCreditConfig):
            return section
        values = {k: v for k, v in dict(section).items() if k != "_target_"}
        reject_unknown("algorithm.turn_credit", values, [f.name for f in fields(cls)])
        return cls(**values)
