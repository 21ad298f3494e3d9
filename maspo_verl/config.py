"""Hyperparameters of the granular losses, as a verl ``PolicyLossConfig`` subclass, and of the span
credit advantage estimator (``SpanCreditConfig``, ``algorithm.span_credit``).

Selected with ``actor_rollout_ref.actor.policy_loss._target_=maspo_verl.config.GranularLossConfig``
(our ``hydra_configs/maspo_trainer.yaml`` sets it). verl builds it with ``hydra.utils.instantiate``,
which does not type-check, so every field is checked in ``__post_init__``: a bad value fails when
verl converts the actor config at start-up (``validate_config`` in the driver), not at the first
update. The allowed segment rules and loss modes come from their registries
(``maspo_verl.segments.SEGMENT_RULES``, ``maspo_verl.token_sets.TOKEN_SETS``). Importing this module
registers nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from verl.workers.config import ActorConfig, PolicyLossConfig

from maspo_verl.segments import SEGMENT_KERNELS, SEGMENT_RULES, TOKENVAL_DISTANCES, fallback_rules
from maspo_verl.surrogates import check_config as check_surrogate
from maspo_verl.token_sets import TOKEN_SETS
from maspo_verl.validation import check_bool, check_choice, check_float, check_int, fail, reject_unknown
from maspo_verl.vocab import MAX_SPLITS, split_count

CTPO_MODES = ("cumprod", "geomean")
# paragraph and line breaks, sentence ends
DEFAULT_DELIMITERS = ("\n\n", "\n", ". ", "? ", "! ")
CLIP_SCHEDULES = ("ratio", "log_adaptive")
AGG_MODES = ("actor", "seg-mean-token-mean")
MAX_POSITION_BUCKETS = 64


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


@dataclass
class GranularLossConfig(PolicyLossConfig):
    """Token set x normalisation x clip schedule (docs/algorithms.md).

    ``loss_mode`` picks the token set (``maspo_verl.token_sets``): ``maspo`` (segments), ``ctpo``
    (prefixes), ``pgspo`` (whole response). verl's own modes (``vanilla``, ``gspo``, ...) may also be
    selected with this config; they ignore the fields below.
    """

    # MASPO segmentation (maspo_verl.segments)
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
    # segment_rule=words: the rule of a sample without word times
    words_fallback_rule: str = "tokenval"
    # segment_rule=delimiters (maspo_verl.vocab): a segment ends after a token where a delimiter occurs
    # (inside it or across it and the next token), a new one starts at a token where a step marker occurs
    delimiters: list[str] = field(default_factory=lambda: list(DEFAULT_DELIMITERS))
    step_markers: list[str] = field(default_factory=list)
    # segment_rule=surprisal: the share of each response's tokens, most surprising first, that start a segment
    surprisal_quantile: float = 0.2
    # how segment ids are computed: "auto" = by the C library (maspo_verl.native) for CPU tensors in
    # eager mode when a C compiler can build it, by torch ops otherwise (GPU, torch.compile);
    # "torch" = always by torch ops. Both give the same ids.
    segment_kernel: str = "auto"
    # normalisation: l_t = sum_{S(t)} delta / |S(t)|^alpha (maspo, pgspo)
    length_exponent: float = 1.0
    ctpo_mode: str = "cumprod"
    # clipping (maspo_verl.clipping)
    clip_schedule: str = "ratio"
    log_clip_low: float = 0.025
    log_clip_high: float = 0.05
    log_clip_dual: float = 0.05
    clip_exponent: float = 0.5
    # aggregation: "actor" uses actor.loss_agg_mode; "seg-mean-token-mean" is the token-mean inside
    # each segment, then the mean over segments, then the mean over sequences.
    agg_mode: str = "actor"
    # number of equal position buckets for the clip-fraction-by-position metrics
    position_buckets: int = 4
    # run the loss through torch.compile (fewer, fused kernels: for GPUs, where the eager loss is
    # bound by kernel launches); the first call of each shape family compiles (seconds to a minute)
    compile: bool = False
    # samples of what the loss did (maspo_verl.inspection): null = off; else a folder that data-parallel
    # rank 0 writes one small JSON file to every `inspect_every` steps (read by `python -m maspo_verl.lab segments`)
    inspect_dir: str | None = None
    inspect_every: int = 10

    # ---- surrogate (maspo_verl.surrogates): what the objective does with the shared ratio ----
    # ppo (clip schedule + dual clip) | cispo (clipped stop-gradient weight on A log pi) | sapo (soft gate,
    # the actor's tau_pos/tau_neg); refused combinations: maspo_verl.surrogates.check_config
    surrogate: str = "ppo"

    def __post_init__(self):
        check_loss_mode(self.loss_mode)
        check_choice("segment_rule", self.segment_rule, tuple(SEGMENT_RULES))
        check_int("segment_window", self.segment_window, 1)
        check_float("logprob_threshold", self.logprob_threshold, -math.inf)
        check_bool("logprob_per_sample", self.logprob_per_sample)
        check_float("tokenval_threshold", self.tokenval_threshold, 0.0)
        check_choice("tokenval_distance", self.tokenval_distance, TOKENVAL_DISTANCES)
        check_int("codec_offset", self.codec_offset, 0)
        check_int("codec_size", self.codec_size, 1)
        is_list = isinstance(self.fsq_levels, Sequence) and not isinstance(self.fsq_levels, str | bytes)
        levels = list(self.fsq_levels) if is_list else None
        if not levels or any(isinstance(v, bool) or not isinstance(v, int) or v < 2 for v in levels):
            fail("fsq_levels", self.fsq_levels, "a non-empty list of integers >= 2")
        if self.tokenval_distance != "id" and math.prod(levels) != self.codec_size:
            fail(
                "fsq_levels",
                self.fsq_levels,
                f"levels whose product equals policy_loss.codec_size={self.codec_size} "
                f"(tokenval_distance={self.tokenval_distance!r} splits codes into FSQ digits)",
            )
        object.__setattr__(self, "fsq_levels", levels)
        check_choice("words_fallback_rule", self.words_fallback_rule, fallback_rules())
        for name in ("delimiters", "step_markers"):
            object.__setattr__(self, name, check_strings(name, getattr(self, name)))
        if self.segment_rule == "delimiters" and not (self.delimiters or self.step_markers):
            fail("delimiters", self.delimiters, "at least one string in delimiters or step_markers")
        if split_count(self.delimiters + self.step_markers) > MAX_SPLITS:
            fail(
                "step_markers",
                self.step_markers,
                f"strings with at most {MAX_SPLITS} characters after the first in all, delimiters included",
            )
        check_float("surprisal_quantile", self.surprisal_quantile, 0.0, 1.0)
        check_choice("segment_kernel", self.segment_kernel, SEGMENT_KERNELS)
        check_int("min_segment_len", self.min_segment_len, 0)
        check_int("max_segment_len", self.max_segment_len, 0)
        if self.max_segment_len and self.max_segment_len < self.min_segment_len:
            fail(
                "max_segment_len",
                self.max_segment_len,
                f"0 (none) or an integer >= min_segment_len={self.min_segment_len}",
            )
        check_float("length_exponent", self.length_exponent, 0.0, 1.0)
        check_choice("ctpo_mode", self.ctpo_mode, CTPO_MODES)
        check_choice("clip_schedule", self.clip_schedule, CLIP_SCHEDULES)
        check_float("log_clip_low", self.log_clip_low, 0.0, lo_open=True)
        check_float("log_clip_high", self.log_clip_high, 0.0, lo_open=True)
        check_float("log_clip_dual", self.log_clip_dual, 0.0, lo_open=True)
        # |p| <= 1 covers CTPO (+-0.5) and P-GSPO (1 - alpha); beyond, n^p makes bounds that never clip
        check_float("clip_exponent", self.clip_exponent, -1.0, 1.0)
        check_choice("agg_mode", self.agg_mode, AGG_MODES)
        check_bool("compile", self.compile)
        token_set = TOKEN_SETS.get(self.loss_mode)
        if self.agg_mode != "actor" and token_set is not None and not token_set.partition:
            fail("agg_mode", self.agg_mode, f"'actor' with loss_mode={self.loss_mode!r} (its sets are not a partition)")
        check_int("position_buckets", self.position_buckets, 1, MAX_POSITION_BUCKETS)
        if self.inspect_dir is not None and (not isinstance(self.inspect_dir, str) or not self.inspect_dir.strip()):
            fail("inspect_dir", self.inspect_dir, "null (off) or a folder path")
        check_int("inspect_every", self.inspect_every, 1)
        # ---- surrogate ----
        check_surrogate(self)


def check_strings(name: str, value: Any) -> list[str]:
    """A list of non-empty strings (``delimiters``, ``step_markers``), as a list."""
    ok = isinstance(value, Sequence) and not isinstance(value, str | bytes)
    if not ok or not all(isinstance(s, str) and s for s in value):
        fail(name, value, "a list of non-empty strings")
    return list(value)


def _reject_unknown_fields(cls) -> None:
    """Wrap the dataclass ``__init__`` so an unknown field names the allowed ones (``+policy_loss.x=``)."""
    generated = cls.__init__

    def __init__(self, *args, **kwargs):
        reject_unknown("policy_loss", kwargs, [f.name for f in fields(cls) if f.init], TypeError, "fields")
        generated(self, *args, **kwargs)

    cls.__init__ = __init__


_reject_unknown_fields(GranularLossConfig)


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
