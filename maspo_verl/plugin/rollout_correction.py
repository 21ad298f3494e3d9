"""verl's side of the rollout correction per segment (``maspo_verl.rollout_correction``): a hook on verl's
``compute_rollout_correction_and_add_to_batch`` and the start-up check of ``algorithm.rollout_correction``.

verl's trainer (v1 and legacy) computes the decoupled-mode correction once per batch, in the trainer
process, with ``rollout_corr_helper.compute_rollout_correction_and_add_to_batch(batch, config)``. The hook
(installed when verl imports that module, through ``hooks.patch``) leaves a config without our options to verl
as it is. With ``rollout_is: segment`` or a ``seg_*`` rejection option it calls verl's
``compute_rollout_correction_and_rejection_mask`` for what is verl's (its rejection options, its off-policy
metrics, its ``token``/``sequence`` weight), then ours, multiplies the masks, and puts the weights where
verl puts its own (``rollout_is_weights``), so the loss applies them as verl's. The hook checks the functions
and signatures it relies on, and a run that asks for a segment option on a verl without them is refused at
start-up with the reason.
"""

from __future__ import annotations

import inspect
import logging

from maspo_verl.plugin.hooks import after_import, patch, patch_problem
from maspo_verl.rollout_correction import SECTION, CorrectionSettings, segment_correction, segment_ids

logger = logging.getLogger("maspo_verl")

HELPER_MODULE = "verl.trainer.ppo.rollout_corr_helper"
HOOK = "rollout_correction"
ADD_TO_BATCH_PARAMS = ("batch", "rollout_corr_config")
MASK_PARAMS = (
    "old_log_prob",
    "rollout_log_prob",
    "response_mask",
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
)
PREFIX = "rollout_corr/"


def verl_rs_options() -> tuple[str, ...]:
    """The installed verl's ``rollout_rs`` options (imports verl's helper module)."""
    import importlib

    return tuple(sorted(importlib.import_module(HELPER_MODULE).SUPPORTED_ROLLOUT_RS_OPTIONS))


def _requires(helper):
    def check(original) -> str | None:
        params = tuple(inspect.signature(original).parameters)
        if params != ADD_TO_BATCH_PARAMS:
            return (
                f"{HELPER_MODULE}.compute_rollout_correction_and_add_to_batch has parameters {params}, "
                f"expected {ADD_TO_BATCH_PARAMS}"
            )
        fn = getattr(helper, "compute_rollout_correction_and_rejection_mask", None)
        if fn is None or tuple(inspect.signature(fn).parameters) != MASK_PARAMS:
            return f"{HELPER_MODULE}.compute_rollout_correction_and_rejection_mask is missing or has other parameters"
        if not isinstance(getattr(helper, "SUPPORTED_ROLLOUT_RS_OPTIONS", None), set | frozenset):
            return f"{HELPER_MODULE}.SUPPORTED_ROLLOUT_RS_OPTIONS is missing"
        return None

    return check


def _scalars(metrics: dict) -> dict[str, float]:
    """One host transfer for the tensors of ``metrics``."""
    import torch

    names = list(metrics)
    values = torch.stack([metrics[n].detach().double().cpu().reshape(()) for n in names]).tolist() if names else []
    return dict(zip(names, values, strict=True))


def corrected_batch(helper, batch, rollout_corr_config):
    """verl's ``compute_rollout_correction_and_add_to_batch`` with our segment options (module docstring)."""
    from verl.protocol import DataProto

    settings = CorrectionSettings.from_mapping(rollout_corr_config, helper.SUPPORTED_ROLLOUT_RS_OPTIONS)
    old = batch.batch["old_log_probs"]
    rollout = batch.batch["rollout_log_probs"]
    mask = batch.batch["response_mask"]
    weights_proto, verl_mask, metrics = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old,
        rollout_log_prob=rollout,
        response_mask=mask,
        rollout_is=None if settings.segment_is else settings.rollout_is,
        rollout_is_threshold=settings.rollout_is_threshold,
        rollout_is_batch_normalize=settings.rollout_is_batch_normalize,
        rollout_rs=",".join(settings.verl_rs) or None,
        rollout_rs_threshold=settings.verl_rs_threshold(),
    )
    ids = segment_ids(mask, settings, old)
    ours = segment_correction(old, rollout, mask, settings, ids)
    if ours.weights is not None:
        # verl's token-level view of the applied weights, under verl's names (rollout_corr/rollout_is_*)
        raw = ours.weights  # metrics of the applied weights; the raw ones are in rollout_is_segment_raw_*
        is_metrics = helper.compute_is_metrics(
            rollout_is_weights=ours.weights, raw_rollout_is_weights=raw, log_ratio_for_metrics=old - rollout,
            response_mask=mask, rollout_is="token", rollout_is_threshold=settings.is_upper,
            rollout_is_threshold_lower=settings.is_lower,
        )  # fmt: skip
        metrics.update({PREFIX + k: float(v) for k, v in is_metrics.items()})
        weights_proto = DataProto.from_dict(tensors={"rollout_is_weights": ours.weights.to(old.dtype)})
    new_mask = verl_mask if ours.keep is None else (verl_mask * ours.keep).to(verl_mask.dtype)
    if ours.keep is not None:
        ours.metrics["rollout_rs_masked_fraction"] = ((1 - new_mask.float()) * mask.float()).sum() / mask.sum()
    metrics.update({PREFIX + k: v for k, v in _scalars(ours.metrics).items()})
    batch.batch["response_mask"] = new_mask
    if weights_proto is not None:
        batch = batch.union(weights_proto)
    return batch, metrics


def _with_segments(helper):
    def make(original):
        def compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config):
            if not CorrectionSettings.from_mapping(
                rollout_corr_config, helper.SUPPORTED_ROLLOUT_RS_OPTIONS
            ).uses_segments:
                return original(batch, rollout_corr_config)
            return corrected_batch(helper, batch, rollout_corr_config)

        return compute_rollout_correction_and_add_to_batch

    return make


def _install(helper) -> None:
    try:
        patch(HOOK, helper, "compute_rollout_correction_and_add_to_batch", _with_segments(helper), _requires(helper))
    except Exception as exc:  # never break verl's import
        from maspo_verl.plugin.hooks import PATCHES

        PATCHES[HOOK] = f"{type(exc).__name__}: {exc}"
        logger.error("maspo_verl: rollout-correction hook not installed", exc_info=True)


def install_rollout_correction_hook() -> None:
    """The hook, installed when verl imports its rollout-correction helper (importing it here, while verl
    loads its plugins, would resolve verl's device before the local mode registers its platform)."""
    after_import(HELPER_MODULE, _install)


def rollout_correction_checks(config) -> list[str]:
    """Start-up check of ``algorithm.rollout_correction``: every value verl's or ours (refused naming the field
    and the allowed values), and what the segment options need (decoupled mode, rollout log-probs, the hook)."""
    section = (config.get("algorithm", {}) or {}).get("rollout_correction", None)
    if section is None:
        return []
    settings = CorrectionSettings.from_mapping(section, verl_rs_options())
    if not settings.uses_segments:
        return []
    from maspo_verl.validation import FieldError

    what = "rollout_is=segment" if settings.segment_is else f"rollout_rs={settings.rollout_rs}"
    if settings.bypass_mode:
        raise FieldError(
            f"{SECTION}.bypass_mode",
            f"{SECTION}.{what} is a decoupled-mode correction (πold/πrollout): set {SECTION}.bypass_mode=false "
            "(bypass mode has no πold; the policy loss's own ratio covers the mismatch there)",
        )
    rollout = config.actor_rollout_ref.rollout
    if not rollout.get("calculate_log_probs", False):
        raise FieldError(
            "actor_rollout_ref.rollout.calculate_log_probs",
            f"{SECTION}.{what} needs the rollout's log-probs: set actor_rollout_ref.rollout.calculate_log_probs=true",
        )
    import importlib

    importlib.import_module(HELPER_MODULE)  # installs the hook
    problem = patch_problem(HOOK)
    if problem:
        raise RuntimeError(f"{SECTION}.{what} is unavailable on this verl: {problem}")
    return []
