"""The inference engine's log-probs, checked: the engine-mismatch metrics and the conformance check.

In bypass mode (``algorithm.rollout_correction.bypass_mode=true``) verl takes the rollout engine's log-probs as
the old log-probs and computes none of its own. On the first mini-batch of each step the actor's weights are
still the ones the engine sampled with (on-policy), so there the current log-prob the update computes is the
trainer's log-prob of the same tokens, and

    delta_t = log pi_trainer(y_t) - log pi_engine(y_t)

is the engine mismatch itself, at no extra forward pass. Per step, over that mini-batch's response tokens (all
data-parallel ranks), logged as ``actor/engine_mismatch/<name>``: ``mean``, ``sd``, ``rms``, ``max_abs``,
``tokens``, ``nonfinite`` (tokens whose delta is not finite) and the correlation of delta along the response
(``corr_lag1``, ``vif<n>``: ``maspo_verl.core.metrics.correlation_metrics``). Outside bypass mode the old
log-probs are the trainer's own (verl's ``rollout_corr/*`` metrics compare the engine there) and these
metrics are left out.

Worker side (hooks in ``maspo_verl.plugin.hooks``): ``update`` and ``minibatch`` mark the first ``train_batch`` of
an actor update; ``observe`` adds each of its micro-batches' sums on the device; ``finish_minibatch`` sums them over
the data-parallel ranks and moves them to the host in one transfer; ``attach`` puts the metrics in the update's.

Trainer side (``EngineCheck``, on verl's ``Tracking.log``): the conformance check at step 1 and every
``maspo.engine_check.every`` steps. It fails where any token's delta is not finite, or where the RMS of delta
exceeds ``maspo.engine_check.max_rms`` (default 0.2 nats: a bf16 engine against an fp32 trainer measures
~0.05, an fp32 one ~1e-5; 0.2 means typical token ratios off by e^0.2 = 22 %, past PPO's usual clip of 0.2, before
any update), and then warns with the numbers (``mode: warn``, the default), stops the run (``stop``) or is
``off``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

logger = logging.getLogger("maspo_verl")

PREFIX = "engine_mismatch/"
# as the trainer logs them: verl puts the actor update's metrics under actor/
LOGGED = f"actor/{PREFIX}"
SECTION = "maspo.engine_check"
MODES = ("warn", "stop", "off")
# [tokens, sum delta, sum delta^2, non-finite tokens] (summed over micro-batches and ranks); max |delta| apart
_SUMS = 4


class _Collector:
    """The first mini-batch's sums in this worker (``None`` outside it)."""

    def __init__(self):
        self.sums: torch.Tensor | None = None
        self.max_abs: torch.Tensor | None = None
        self.corr: dict[str, torch.Tensor] = {}
        self.active = False
        self.metrics: dict[str, float] | None = None
        self.minibatches: int | None = None  # of the actor update under way (None: none)


_state = _Collector()


@contextlib.contextmanager
def update():
    """Around one actor update (verl's ``train_mini_batch``): its mini-batches are counted from 0."""
    _state.minibatches, _state.metrics = 0, None
    try:
        yield
    finally:
        _state.minibatches = None


@contextlib.contextmanager
def minibatch(group=None):
    """Around one ``train_batch`` (one mini-batch): the first of an update collects its micro-batches' sums,
    summed over the data-parallel ``group`` at its end."""
    first = _state.minibatches == 0
    if _state.minibatches is not None:
        _state.minibatches += 1
    _state.active = first
    if first:
        _state.sums, _state.max_abs, _state.corr = None, None, {}
    try:
        yield
    finally:
        _state.active = False
    if first:
        finish_minibatch(group)


def observe(log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Add one micro-batch's delta sums (padded [B, T] tensors), on the device, when collecting."""
    if not _state.active:
        return
    from maspo_verl.core.losses import token_log_ratios
    from maspo_verl.core.metrics import correlation_sums

    mask = response_mask.bool()
    delta, kept = token_log_ratios(log_prob, old_log_prob, mask)
    delta = delta.double()
    sums = torch.stack([kept.sum().double(), delta.sum(), (delta * delta).sum(), (mask & ~kept).sum().double()])
    max_abs = delta.abs().max() if delta.numel() else delta.new_zeros(())
    corr = correlation_sums(delta, kept)
    if _state.sums is None:
        _state.sums, _state.max_abs, _state.corr = sums, max_abs, corr
    else:
        _state.sums = _state.sums + sums
        _state.max_abs = torch.maximum(_state.max_abs, max_abs)
        _state.corr = {k: _state.corr[k] + v for k, v in corr.items()}


def finish_minibatch(group=None) -> None:
    """Sum the collected sums over the data-parallel ``group`` and turn them into metrics (one host transfer)."""
    if _state.sums is None:
        return
    from maspo_verl.core.metrics import host_sums

    names = list(_state.corr)
    flat = torch.cat([_state.sums] + [_state.corr[k].reshape(-1).double() for k in names])
    top = _state.max_abs.double().reshape(1)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        flat, top = flat.clone(), top.clone()
        dist.all_reduce(flat, group=group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    values = host_sums({"sums": flat, "top": top})
    sums, corr_flat = values["sums"][:_SUMS], values["sums"][_SUMS:]
    corr, start = {}, 0
    for k in names:
        size = _state.corr[k].numel()
        corr[k], start = corr_flat[start : start + size], start + size
    _state.metrics = delta_metrics(sums, values["top"][0], corr)
    _state.sums = None


def delta_metrics(sums, max_abs: float, corr: Mapping | None = None) -> dict[str, float]:
    """``engine_mismatch/*`` from [tokens, sum delta, sum delta^2, non-finite tokens], max |delta| and the
    correlation sums."""
    from maspo_verl.core.metrics import correlation_metrics

    n, total, squares, nonfinite = (float(v) for v in sums)
    metrics = {f"{PREFIX}tokens": n, f"{PREFIX}nonfinite": nonfinite}
    if n > 0:
        mean = total / n
        metrics[f"{PREFIX}mean"] = mean
        metrics[f"{PREFIX}rms"] = math.sqrt(squares / n)
        metrics[f"{PREFIX}max_abs"] = float(max_abs)
        if n > 1:
            metrics[f"{PREFIX}sd"] = math.sqrt(max(squares - n * mean * mean, 0.0) / (n - 1))
    if corr:
        metrics.update(correlation_metrics(corr, prefix=PREFIX))
    return metrics


def attach(output, extra: Mapping[str, float] | None = None) -> None:
    """Put the collected metrics (once), and ``extra``, in an update's output metrics (verl's ``train_mini_batch``
    result)."""
    metrics, _state.metrics = _state.metrics, None
    metrics = {**(metrics or {}), **(extra or {})}
    if not metrics or output is None:
        return
    from verl.utils import tensordict_utils as tu

    found = tu.get(output, "metrics", default=None)
    if isinstance(found, dict):
        found.update({k: [v] for k, v in metrics.items()})


# ------------------------------------------------------------------ the trainer's side: the conformance check


@dataclass(frozen=True)
class EngineCheck:
    mode: str = "warn"
    every: int = 10
    max_rms: float = 0.2

    def __post_init__(self):
        from maspo_verl.validation import check_choice, check_float, check_int

        check_choice(f"{SECTION}.mode", self.mode, MODES)
        check_int(f"{SECTION}.every", self.every, 1)
        check_float(f"{SECTION}.max_rms", self.max_rms, 0.0)

    @classmethod
    def from_config(cls, config) -> EngineCheck:
        from maspo_verl.validation import reject_unknown

        section = dict(((config or {}).get("maspo") or {}).get("engine_check") or {})
        reject_unknown(SECTION, section, ["mode", "every", "max_rms"])
        return cls(**section)

    def due(self, step: int) -> bool:
        return self.mode != "off" and (step == 1 or step % self.every == 0)

    def problem(self, metrics: Mapping) -> str | None:
        """Why the engine's log-probs fail the check (None: they pass, or there is nothing to check); ``metrics``
        named as the update reports them (``engine_mismatch/*``) or as the trainer logs them (``actor/...``)."""
        metrics = {PREFIX + k.split(PREFIX, 1)[1]: v for k, v in metrics.items() if PREFIX in k}
        rms = metrics.get(f"{PREFIX}rms")
        nonfinite = metrics.get(f"{PREFIX}nonfinite") or 0
        tokens = metrics.get(f"{PREFIX}tokens") or 0

        def shown(key):
            value = metrics.get(f"{PREFIX}{key}")
            return "n/a" if value is None else f"{value:.4g}"

        figures = (
            f"{int(tokens)} tokens of the step's first (on-policy) mini-batch, delta = trainer - engine log-prob: "
            f"mean {shown('mean')}, sd {shown('sd')}, rms {shown('rms')}, max |delta| {shown('max_abs')}, "
            f"{int(nonfinite)} non-finite"
        )
        if nonfinite > 0:
            return f"the engine's log-probs are not finite at {int(nonfinite)} tokens ({figures})"
        if rms is not None and rms > self.max_rms:
            return (
                f"the engine's log-probs disagree with the trainer's: rms {rms:.4g} > {SECTION}.max_rms="
                f"{self.max_rms:g} ({figures}); the engine may run other weights (a weight sync that failed), "
                "another precision or another model"
            )
        return None


def on_step(data: dict, step: int, bypass: bool, check: EngineCheck) -> None:
    """What the trainer's metrics logger does with a step's metrics (in place): drop the engine-mismatch metrics
    outside bypass mode; run the conformance check on the steps it is due."""
    keys = [k for k in data if k.startswith(LOGGED)]
    if not keys:
        return
    if not bypass:
        for k in keys:
            del data[k]
        return
    if not check.due(step):
        return
    problem = check.problem(data)
    if problem is None:
        return
    message = f"maspo_verl engine check (step {step}): {problem}"
    if check.mode == "stop":
        raise RuntimeError(message + f" [{SECTION}.mode=stop; warn or off to go on]")
    print(f"WARNING {message}", flush=True)
    logger.warning(message)


def collecting() -> bool:
    return _state.active
