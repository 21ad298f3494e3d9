"""Hyperparameters of the granular losses, as a verl ``PolicyLossConfig`` subclass, and of the span
credit advantage estimator (``SpanCreditConfig``, ``algorithm.span_credit``).

Selected with ``actor_rollout_ref.actor.policy_loss._target_=maspo_verl.config.GranularLossConfig``
(our ``hydra_configs/maspo_trainer.yaml`` sets it). verl builds it with ``hydra.utils.instantiate``,
which does not type-check, so every field is checked in ``__post_init__``: a bad value fails when
verl converts the actor config at start-up (``validate_config`` in the driver), not at the first
update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from verl.workers.config import PolicyLossConfig

SEGMENT_RULES = ("fixed", "logprob", "tokenval")
TOKENVAL_DISTANCES = ("id", "fsq_l1", "fsq_hamming")
CTPO_MODES = ("cumprod", "geomean")
CLIP_SCHEDULES = ("ratio", "log_adaptive")
AGG_MODES = ("actor", "seg-mean-token-mean")

# Loss names this package registers in verl's POLICY_LOSS_REGISTRY (see maspo_verl.losses).
OUR_LOSS_MODES = ("maspo", "ctpo", "pgspo")


def _fail(name: str, value: Any, allowed: str) -> None:
    section = "" if "." in name else "policy_loss."
    raise ValueError(f"{section}{name}={value!r} is invalid: allowed {allowed}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(name, value, "one of " + ", ".join(choices))


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(name, value, f"an integer >= {minimum}")


def _check_float(name: str, value: Any, lo: float, hi: float = math.inf, lo_open: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        bound = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi != math.inf else "")
        _fail(name, value, f"a finite number {bound}")


@dataclass
class GranularLossConfig(PolicyLossConfig):
    """Token set x normalisation x clip schedule (SPEC §1-§3).

    ``loss_mode`` picks the token set: ``maspo`` (segments), ``ctpo`` (prefixes), ``pgspo``
    (whole response). verl's own modes (``vanilla``, ``gspo``, ...) may also be selected with this
    config; they ignore the fields below.
    """

    # MASPO segmentation (SPEC §3)
    segment_rule: str = "fixed"
    segment_window: int = 15
    logprob_threshold: float = 1.0
    logprob_per_sample: bool = False
    tokenval_threshold: float = 8.0
    tokenval_distance: str = "fsq_l1"
    codec_offset: int = 128264
    codec_size: int = 65536
    fsq_levels: list[int] = field(default_factory=lambda: [4] * 8)
    min_segment_len: int = 0
    max_segment_len: int = 0
    # normalisation: l_t = sum_{S(t)} delta / |S(t)|^alpha (maspo, pgspo)
    length_exponent: float = 1.0
    ctpo_mode: str = "cumprod"
    # clipping (SPEC §2)
    clip_schedule: str = "ratio"
    log_clip_low: float = 0.025
    log_clip_high: float = 0.05
    log_clip_dual: float = 0.05
    clip_exponent: float = 0.5
    # aggregation: "actor" uses actor.loss_agg_mode; "seg-mean-token-mean" is seed 001's
    # token-mean inside each segment, then mean over segments, then mean over sequences.
    agg_mode: str = "actor"
    # number of equal position buckets for the clip-fraction-by-position metrics
    position_buckets: int = 4

    def __post_init__(self):
        if self.loss_mode in OUR_LOSS_MODES:
            from maspo_verl.verl_glue import require_registered

            require_registered(self.loss_mode)
        _check_choice("segment_rule", self.segment_rule, SEGMENT_RULES)
        _check_int("segment_window", self.segment_window, 1)
        _check_float("logprob_threshold", self.logprob_threshold, -math.inf)
        if not isinstance(self.logprob_per_sample, bool):
            _fail("logprob_per_sample", self.logprob_per_sample, "true or false")
        _check_float("tokenval_threshold", self.tokenval_threshold, 0.0)
        _check_choice("tokenval_distance", self.tokenval_distance, TOKENVAL_DISTANCES)
        _check_int("codec_offset", self.codec_offset, 0)
        _check_int("codec_size", self.codec_size, 1)
        levels = list(self.fsq_levels) if not isinstance(self.fsq_levels, str | bytes) else None
        if not levels or any(isinstance(v, bool) or not isinstance(v, int) or v < 2 for v in levels):
            _fail("fsq_levels", self.fsq_levels, "a non-empty list of integers >= 2")
        if self.tokenval_distance != "id" and math.prod(levels) != self.codec_size:
            _fail(
                "fsq_levels",
                self.fsq_levels,
                f"levels whose product equals policy_loss.codec_size={self.codec_size} "
                f"(tokenval_distance={self.tokenval_distance!r} splits codes into FSQ digits)",
            )
        object.__setattr__(self, "fsq_levels", levels)
        _check_int("min_segment_len", self.min_segment_len, 0)
        _check_int("max_segment_len", self.max_segment_len, 0)
        if self.max_segment_len and self.max_segment_len < self.min_segment_len:
            _fail(
                "max_segment_len",
                self.max_segment_len,
                f"0 (none) or an integer >= min_segment_len={self.min_segment_len}",
            )
        _check_float("length_exponent", self.length_exponent, 0.0, 1.0)
        _check_choice("ctpo_mode", self.ctpo_mode, CTPO_MODES)
        _check_choice("clip_schedule", self.clip_schedule, CLIP_SCHEDULES)
        _check_float("log_clip_low", self.log_clip_low, 0.0, lo_open=True)
        _check_float("log_clip_high", self.log_clip_high, 0.0, lo_open=True)
        _check_float("log_clip_dual", self.log_clip_dual, 0.0, lo_open=True)
        _check_float("clip_exponent", self.clip_exponent, -2.0, 2.0)
        _check_choice("agg_mode", self.agg_mode, AGG_MODES)
        if self.agg_mode != "actor" and self.loss_mode == "ctpo":
            _fail("agg_mode", self.agg_mode, "'actor' with loss_mode='ctpo' (prefixes are not a partition)")
        _check_int("position_buckets", self.position_buckets, 1)


@dataclass(frozen=True)
class SpanCreditConfig:
    """``algorithm.span_credit`` of the ``maspo_span_grpo`` advantage estimator (maspo_verl.advantages).

    ``lam``: weight of the local (per-token) term added to GRPO's utterance advantage; 0 gives verl's
    ``grpo`` advantages exactly.
    """

    lam: float = 0.5

    def __post_init__(self):
        _check_float("algorithm.span_credit.lam", self.lam, 0.0)

    @classmethod
    def from_algorithm(cls, algorithm: Any) -> SpanCreditConfig:
        """From verl's ``algorithm`` config (DictConfig, dict or None); unknown keys are errors."""
        section = algorithm.get("span_credit", None) if algorithm is not None else None
        if section is None:
            return cls()
        if isinstance(section, SpanCreditConfig):
            return section
        values = {k: v for k, v in dict(section).items() if k != "_target_"}
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(f"algorithm.span_credit has unknown keys {unknown}: allowed {', '.join(names)}")
        return cls(**values)
