"""Rollout correction per segment: verl's decoupled-mode weight πold/πrollout and its rejection masks, one per
segment instead of one per token or per response (docs/algorithms.md, "Rollout correction per segment").

verl's ``algorithm.rollout_correction`` has two levels for the weight (``rollout_is: token | sequence``) and
per-token or per-response rejection options (``rollout_rs: token_k1, seq_sum_k1, seq_mean_k3, ...``). This
module adds the level between them, with the same value style:

- ``rollout_is: segment``: one weight per segment, w_s = exp(clamp(Σ_{t∈s} log πold_t − log πrollout_t, ±20)),
  then verl's TIS cap (``rollout_is_threshold: 2.0``: min(w_s, 2)) or IcePop band (``"0.5_5.0"``: w_s outside
  [0.5, 5] becomes 0), per segment; every token of the segment carries w_s.
- ``rollout_rs: seg_sum_k1 | seg_sum_k2 | seg_sum_k3 | seg_mean_k1 | ... | seg_max_k3``: verl's k1/k2/k3
  statistics summed, averaged or maximised over each segment; a segment that fails is masked, the response's
  other segments still train. They mix with verl's options in one comma-separated list.
- ``rollout_segment_rule`` (default ``turns``: one segment per assistant turn) and ``rollout_segment`` (the
  rule's settings, e.g. ``{turn_window: 0}``): the correction's own segmentation, set apart from the policy
  loss's ``segment_rule``.

One token per segment gives verl's ``token`` level, one segment per response verl's ``sequence`` level (and
``seg_*`` verl's ``seq_*`` options), exactly. Everything is per sample (no batch statistic except the optional
``rollout_is_batch_normalize``), vectorised over [B, T]. Core layer: torch and the segment rules only; the
plugin hook (``maspo_verl.plugin.rollout_correction``) calls it inside verl's trainer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from maspo_verl.core.segments import OLD_LOG_PROB, SEGMENT_RULES, compute_segment_ids
from maspo_verl.core.segments import compute as segmentation
from maspo_verl.validation import FieldError, check_bool, fail, reject_unknown

SECTION = "algorithm.rollout_correction"
SEGMENT = "segment"
# verl's levels, then ours
IS_LEVELS = ("token", "sequence", SEGMENT)
SEGMENT_RS_OPTIONS = (
    "seg_sum_k1",
    "seg_sum_k2",
    "seg_sum_k3",
    "seg_mean_k1",
    "seg_mean_k2",
    "seg_mean_k3",
    "seg_max_k2",
    "seg_max_k3",
)
SAFETY_BOUND = 20.0  # verl's clamp of log-ratios before exp
DEFAULT_RULE = "turns"
# what a correction rule may read: verl's trainer has the mask and the log-probs there, not the token ids
CORRECTION_INPUTS = frozenset({OLD_LOG_PROB})
# our keys in verl's section (hydra_configs/maspo_trainer.yaml declares them with these defaults)
OWN_KEYS = {"rollout_segment_rule": DEFAULT_RULE, "rollout_segment": {}}


def correction_rules() -> tuple[str, ...]:
    """The segment rules the correction can run: those that read nothing but the mask and log-probs."""
    return tuple(name for name, rule in SEGMENT_RULES.items() if rule.needs <= CORRECTION_INPUTS)


def _is_threshold(spec: Any) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: a number (TIS upper bound) or "lower_upper" (IcePop band)."""
    name = f"{SECTION}.rollout_is_threshold"
    allowed = 'a positive number (TIS cap) or "lower_upper" with 0 < lower <= upper (IcePop band)'
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        fail(name, spec, allowed)
    parts = str(spec).strip().split("_") if isinstance(spec, str) else [spec]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        fail(name, spec, allowed)
    if len(values) not in (1, 2) or any(not (v > 0) or not math.isfinite(v) for v in values):
        fail(name, spec, allowed)
    if len(values) == 2 and values[0] > values[1]:
        fail(name, spec, allowed)
    return (values[0], None) if len(values) == 1 else (values[1], values[0])


def _rs_thresholds(options: list[str], spec: Any) -> list[tuple[float, float | None]]:
    """verl's ``rollout_rs_threshold``: one entry shared by all options or one per option; a k1 option takes
    "lower_upper" ratio bounds (a single upper u means [1/u, u]), the others a single upper bound."""
    name = f"{SECTION}.rollout_rs_threshold"
    if spec is None or isinstance(spec, bool) or not isinstance(spec, int | float | str):
        fail(name, spec, "one threshold, or one per rollout_rs option, comma-separated")
    raw = [p.strip() for p in str(spec).split(",") if p.strip()] if isinstance(spec, str) else [str(spec)]
    if len(raw) not in (1, len(options)):
        fail(name, spec, f"one threshold, or {len(options)} (one per rollout_rs option: {', '.join(options)})")
    raw = raw * len(options) if len(raw) == 1 else raw
    out = []
    for option, text in zip(options, raw, strict=True):
        k1 = option.endswith("k1")
        allowed = f"for {option}: " + (
            '"lower_upper" ratio bounds or one upper bound u ([1/u, u])' if k1 else "one positive upper bound"
        )
        parts = text.split("_")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            fail(name, spec, allowed)
        if (len(values) == 2 and not k1) or len(values) not in (1, 2) or any(not v > 0 for v in values):
            fail(name, spec, allowed)
        if k1:
            lower, upper = (1.0 / values[0], values[0]) if len(values) == 1 else values
            if lower > upper:
                fail(name, spec, allowed)
            out.append((upper, lower))
        else:
            out.append((values[0], None))
    return out


def segmentation_config(rule: str, settings: Mapping | None) -> SimpleNamespace:
    """The settings a segmentation reads (``maspo_verl.core.segments``), for the correction: every declared field at
    its default, ``segment_rule`` = ``rule``, then ``settings`` (the rule's and the segmentation's own fields;
    anything else is refused naming the allowed ones)."""
    allowed_rules = correction_rules()
    if rule not in allowed_rules:
        fail(f"{SECTION}.rollout_segment_rule", rule, "one of " + ", ".join(allowed_rules))
    declared = [s for s in segmentation.SETTINGS if s.name != "segment_rule"]
    declared += [s for r in SEGMENT_RULES.values() for s in r.settings]
    own = [s.name for s in (*segmentation.SETTINGS[1:], *SEGMENT_RULES[rule].settings)]
    settings = dict(settings or {})
    where = f"{SECTION}.rollout_segment"
    reject_unknown(where, settings, own, lambda message: FieldError(where, message), "settings")
    values = {"segment_rule": rule}
    for s in declared:
        values[s.name] = s.allowed.check(f"{SECTION}.rollout_segment.{s.name}", settings.get(s.name, s.default))
    config = SimpleNamespace(**values)
    config.get = lambda key, default=None: getattr(config, key, default)  # the registry reads mappings too
    try:
        segmentation.validate(config)
    except FieldError as exc:  # the loss's field names, as this section's
        raise FieldError(f"{SECTION}.rollout_segment", str(exc).replace("policy_loss.", "rollout_segment.")) from exc
    return config


@dataclass(frozen=True)
class CorrectionSettings:
    """``algorithm.rollout_correction`` as this module reads it (verl's keys and ours), checked."""

    rollout_is: str | None = None
    rollout_is_threshold: Any = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False
    rollout_segment_rule: str = DEFAULT_RULE
    rollout_segment: dict = field(default_factory=dict)
    # derived
    is_upper: float = 2.0
    is_lower: float | None = None
    verl_rs: tuple[str, ...] = ()
    segment_rs: tuple[str, ...] = ()
    rs_bounds: dict = field(default_factory=dict)
    segmentation: Any = None

    @property
    def segment_is(self) -> bool:
        return self.rollout_is == SEGMENT

    @property
    def uses_segments(self) -> bool:
        return self.segment_is or bool(self.segment_rs)

    def verl_rs_threshold(self) -> str | None:
        """The thresholds of verl's own options, in verl's format (one per option)."""
        if not self.verl_rs:
            return None
        parts = []
        for option in self.verl_rs:
            upper, lower = self.rs_bounds[option]
            parts.append(f"{lower!r}_{upper!r}" if option.endswith("k1") else f"{upper!r}")
        return ",".join(parts)

    @classmethod
    def from_mapping(cls, section: Mapping | None, verl_rs_options: Iterable[str]) -> CorrectionSettings:
        """From verl's section (DictConfig, dict or dataclass); ``verl_rs_options``: the installed verl's
        ``rollout_rs`` options. A value that neither verl nor we accept is refused naming the allowed ones."""
        get = (
            (lambda k, d=None: section.get(k, d))
            if hasattr(section, "get")
            else (lambda k, d=None: getattr(section, k, d))
        )
        if section is None:
            return cls()
        level = get("rollout_is", None)
        if level is not None and level not in IS_LEVELS:
            fail(f"{SECTION}.rollout_is", level, "null, " + ", ".join(IS_LEVELS))
        check_bool(f"{SECTION}.rollout_is_batch_normalize", get("rollout_is_batch_normalize", False))
        upper, lower = _is_threshold(get("rollout_is_threshold", 2.0))
        verl_options = sorted(verl_rs_options)
        rs = get("rollout_rs", None)
        options: list[str] = []
        if rs is not None:
            if not isinstance(rs, str) or not rs.strip():
                fail(f"{SECTION}.rollout_rs", rs, "null or comma-separated options")
            for option in (o.strip() for o in rs.split(",") if o.strip()):
                if option not in (*verl_options, *SEGMENT_RS_OPTIONS):
                    fail(
                        f"{SECTION}.rollout_rs",
                        rs,
                        "comma-separated options of " + ", ".join((*verl_options, *SEGMENT_RS_OPTIONS)),
                    )
                if option not in options:
                    options.append(option)
        bounds = (
            dict(zip(options, _rs_thresholds(options, get("rollout_rs_threshold", None)), strict=True))
            if options
            else {}
        )
        rule = get("rollout_segment_rule", DEFAULT_RULE)
        settings = get("rollout_segment", None)
        settings = {} if settings is None else {str(k): v for k, v in dict(settings).items()}
        made = cls(
            rollout_is=level,
            rollout_is_threshold=get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=bool(get("rollout_is_batch_normalize", False)),
            rollout_rs=rs,
            rollout_rs_threshold=get("rollout_rs_threshold", None),
            bypass_mode=bool(get("bypass_mode", False)),
            rollout_segment_rule=rule,
            rollout_segment=settings,
            is_upper=upper,
            is_lower=lower,
            verl_rs=tuple(o for o in options if o not in SEGMENT_RS_OPTIONS),
            segment_rs=tuple(o for o in options if o in SEGMENT_RS_OPTIONS),
            rs_bounds=bounds,
        )
        if made.uses_segments:
            object.__setattr__(made, "segmentation", segmentation_config(rule, settings))
        return made


def rule_segment_ids(mask: torch.Tensor, config: Any, old_log_prob: torch.Tensor | None = None) -> torch.Tensor:
    """Segment ids [B, T] (0 on padding) of a ``segmentation_config``: the one call into the segmentation (for the
    correction and for turn credit)."""
    return compute_segment_ids(mask.bool(), config, old_log_prob=old_log_prob)


def segment_ids(mask: torch.Tensor, settings: CorrectionSettings, old_log_prob: torch.Tensor | None) -> torch.Tensor:
    """The correction's segment ids [B, T] (0 on padding)."""
    return rule_segment_ids(mask, settings.segmentation, old_log_prob)


# ---------------------------------------------------------------------------------------------- per-segment math
def _slots(ids: torch.Tensor) -> torch.Tensor:
    """Flat index of each token's segment in a [B * T] table (segment k of row b at b * T + k)."""
    B, T = ids.shape
    return (ids.long() + torch.arange(B, device=ids.device).unsqueeze(-1) * T).reshape(-1)


def segment_reduce(values: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor, how: str = "sum") -> torch.Tensor:
    """Per segment, the sum / mean / max of ``values`` over its valid tokens: [B, T], slot k of row b is segment
    k (slots past the row's last segment: 0)."""
    B, T = values.shape
    valid = mask.bool().reshape(-1)
    slots = _slots(ids)
    flat = values.reshape(-1)
    if how == "max":
        table = torch.full((B * T,), -math.inf, dtype=values.dtype, device=values.device)
        table = table.scatter_reduce(0, slots[valid], flat[valid], reduce="amax", include_self=True)
        return table.masked_fill(table == -math.inf, 0.0).view(B, T)
    table = torch.zeros(B * T, dtype=values.dtype, device=values.device).index_add_(0, slots[valid], flat[valid])
    if how == "mean":
        count = torch.zeros(B * T, dtype=values.dtype, device=values.device)
        count.index_add_(0, slots[valid], torch.ones_like(flat[valid]))
        table = table / count.clamp_min(1)
    return table.view(B, T)


def segment_slots_valid(mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Bool [B, T]: slot k of row b holds a segment (k < the row's number of segments)."""
    count = torch.where(mask.bool(), ids.long() + 1, 0).amax(-1, keepdim=True)
    return torch.arange(ids.shape[-1], device=ids.device).unsqueeze(0) < count


def to_tokens(table: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each valid token gets its segment's slot of ``table`` ([B, T]); padding 0."""
    return table.gather(-1, ids.long().clamp_min(0)) * mask


def _ess(weights: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Normalised effective sample size (Σw)² / (n Σw²) over the valid entries, in (0, 1]; 0 if all are 0."""
    w = weights[valid]
    square = (w * w).sum()
    return torch.where(square > 0, w.sum() ** 2 / (w.numel() * square).clamp_min(torch.finfo(w.dtype).tiny), 0.0)


@dataclass
class SegmentCorrection:
    """What ``segment_correction`` computes: per-token weights (None without ``rollout_is=segment``), the keep
    mask of the segment rejection options (None without), and metrics (name -> 0-d tensor)."""

    weights: torch.Tensor | None
    keep: torch.Tensor | None
    metrics: dict[str, torch.Tensor]


def segment_weights(log_ratio, mask, ids, upper: float, lower: float | None, batch_normalize: bool = False):
    """Per-token weights of ``rollout_is=segment`` and the per-segment tables (raw, applied, valid slots)."""
    mask = mask.to(log_ratio.dtype)
    log_sum = segment_reduce(log_ratio, mask, ids, "sum")
    valid = segment_slots_valid(mask, ids)
    raw = torch.exp(log_sum.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * valid
    if lower is None:  # TIS
        applied = raw.clamp(max=upper)
    else:  # IcePop
        applied = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    if batch_normalize:
        mean = applied[valid].mean()
        applied = torch.where(mean > 1e-8, applied / mean.clamp_min(1e-8), applied)
    return to_tokens(applied, mask, ids).detach(), raw, applied, valid, log_sum


def segment_rejection(log_ratio, mask, ids, options, bounds) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Keep mask [B, T] of the ``seg_*`` options (a segment failing any of them is masked) and their metrics."""
    mask_f = mask.to(log_ratio.dtype)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    valid = segment_slots_valid(mask, ids)
    keep = valid.clone()
    metrics = {}
    n = valid.sum().clamp_min(1)
    for option in options:
        _, how, k = option.split("_")
        stat = segment_reduce(stats[k], mask_f, ids, how)
        upper, lower = bounds[option]
        if k == "k1":
            ok = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            ok = stat <= upper
        ok = ok | ~valid
        keep &= ok
        metrics[f"rollout_rs_{option}_mean"] = stat[valid].mean()
        metrics[f"rollout_rs_{option}_max"] = stat[valid].max()
        metrics[f"rollout_rs_{option}_segment_rejected_fraction"] = (~ok & valid).sum() / n
    metrics["rollout_rs_segment_rejected_fraction"] = (~keep & valid).sum() / n
    rows = mask.bool().any(-1)
    kept_rows = (keep & valid).any(-1)
    metrics["rollout_rs_segment_all_rejected_seq_fraction"] = (rows & ~kept_rows).sum() / rows.sum().clamp_min(1)
    return to_tokens(keep.to(log_ratio.dtype), mask_f, ids), metrics


def segment_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    settings: CorrectionSettings,
    ids: torch.Tensor | None = None,
) -> SegmentCorrection:
    """The segment-level weights and rejection of ``settings`` (``ids``: the correction's segment ids, else
    computed by its rule). Metrics: the weight's mean/min/max and ESS over segments before the cap
    (``raw_*``) and after it, the share of segments the cap or band changed, segments per response, the
    rejection's share of segments."""
    if ids is None:
        ids = segment_ids(response_mask, settings, old_log_prob)
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, torch.Tensor] = {}
    valid = segment_slots_valid(response_mask, ids)
    rows = response_mask.bool().any(-1)
    metrics["segments_per_response"] = valid.sum() / rows.sum().clamp_min(1)
    weights = keep = None
    if settings.segment_is:
        weights, raw, applied, valid, log_sum = segment_weights(
            log_ratio, response_mask, ids, settings.is_upper, settings.is_lower, settings.rollout_is_batch_normalize
        )
        for name, table in (("raw_", raw), ("", applied)):
            metrics[f"rollout_is_segment_{name}mean"] = table[valid].mean()
            metrics[f"rollout_is_segment_{name}min"] = table[valid].min()
            metrics[f"rollout_is_segment_{name}max"] = table[valid].max()
            metrics[f"rollout_is_segment_{name}ess"] = _ess(table, valid)
        changed = (raw > settings.is_upper) | ((raw < settings.is_lower) if settings.is_lower else False)
        metrics["rollout_is_segment_capped_fraction"] = (changed & valid).sum() / valid.sum().clamp_min(1)
        metrics["rollout_is_segment_log_ratio_mean"] = log_sum[valid].mean()
    if settings.segment_rs:
        keep, rs_metrics = segment_rejection(log_ratio, response_mask, ids, settings.segment_rs, settings.rs_bounds)
        metrics.update(rs_metrics)
    return SegmentCorrection(weights, keep, metrics)
