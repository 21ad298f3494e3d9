"""logprob: a new segment where the old policy's log-prob drops by more than a threshold."""

from __future__ import annotations

import math

import torch

from maspo_verl.core.segments.rule import (
    OLD_LOG_PROB,
    Candidates,
    Example,
    Packed,
    SegmentRule,
    Sweep,
    quantile_grid,
)
from maspo_verl.core.tensors import float_mask
from maspo_verl.validation import Bool, Float, Setting

# per-sample mode: sigma floor (nats), so a sample whose drops are all equal gets no boundaries
STD_FLOOR = 1e-3
# per-sample thresholds a calibration sweep tries: z-scores -1..4
Z_GRID = tuple(round(-1.0 + 0.25 * i, 2) for i in range(21))
# drops of non-finite log-probs (-inf old log-prob) are clamped to this magnitude
MAX_DROP = 1e4


def finite(log_prob: float) -> float:
    """A log-prob as the rules read it: NaN 0, infinities +-MAX_DROP."""
    if math.isinf(log_prob):
        return math.copysign(MAX_DROP, log_prob)
    return 0.0 if math.isnan(log_prob) else log_prob


def logprob_drops(old_log_prob: torch.Tensor, packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """d_p = lp_{p-1} - lp_p over valid neighbours (packed), zero where there is no previous token;
    returns (drops, has_previous as 0/1 floats)."""
    lp = packed.pack(old_log_prob).float().nan_to_num_(nan=0.0, neginf=-MAX_DROP, posinf=MAX_DROP)
    # (padded rather than written into a slice with out=, which torch.compile cannot trace)
    drop = torch.nn.functional.pad(lp[:, :-1] - lp[:, 1:], (1, 0))
    # zero where there is no previous valid token (a product: finite drops, cheaper than a select)
    w = float_mask(packed.has_previous)
    return drop.clamp_(-MAX_DROP, MAX_DROP).mul_(w), w


def per_sample_cutoffs(drop: torch.Tensor, w: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each row's drop cutoff mu + threshold * max(sigma, ``STD_FLOOR``) [B, 1], float64: mu and sigma
    the mean and population standard deviation of the row's drops (``w``: 0/1, which are drops)."""
    n = w.sum(-1, keepdim=True, dtype=torch.float64).clamp(min=1.0)
    mu = drop.sum(-1, keepdim=True, dtype=torch.float64) / n
    var = drop.double().sub_(mu).mul_(w).square_().sum(-1, keepdim=True) / n
    return mu + threshold * var.sqrt().clamp(min=STD_FLOOR)


def above(x: torch.Tensor, cutoffs: torch.Tensor) -> torch.Tensor:
    """float32 x > float64 cutoffs exactly, compared in float32: against each cutoff rounded down to a
    float32 (a float32 exceeds c exactly when it exceeds the largest float32 <= c)."""
    low = cutoffs.float()
    # the -inf operand is made on the device (a tensor from a Python scalar would be a host-to-device copy)
    down = torch.nextafter(low, torch.full_like(low, -math.inf))
    return x > torch.where(low.double() > cutoffs, down, low)


def logprob_candidates(
    old_log_prob: torch.Tensor, packed: Packed, threshold: float, per_sample: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(boundaries, scores) of the logprob rule (packed): a boundary where the drop exceeds
    ``threshold``, or with ``per_sample`` the row's cutoff (``per_sample_cutoffs``: a z-score above
    ``threshold``, decided in float64). The score is the drop itself, which orders a row's boundaries
    as their z-scores do."""
    drop, w = logprob_drops(old_log_prob, packed)
    above_cut = above(drop, per_sample_cutoffs(drop, w, threshold)) if per_sample else drop > threshold
    return above_cut.logical_and_(packed.valid), drop


class LogprobRule(SegmentRule):
    """A new segment where the old policy's log-prob drops by more than `logprob_threshold` (`logprob_per_sample`: in
    units of the sample's own drop mean and standard deviation)."""

    name = "logprob"
    needs = frozenset({OLD_LOG_PROB})
    settings = (
        Setting("logprob_threshold", 1.0, Float(), "log-prob drop (nats, or z-score per sample) that starts a segment"),
        Setting("logprob_per_sample", False, Bool(), "`logprob_threshold` in units of each sample's drop mean/std"),
    )
    # drops are clamped to +-MAX_DROP: a threshold below -MAX_DROP is passed by every drop, one above it by none
    limits = {
        "token": {"logprob_threshold": -2 * MAX_DROP, "logprob_per_sample": False},
        "sequence": {"logprob_threshold": 2 * MAX_DROP, "logprob_per_sample": False},
    }
    # drops lp[p-1] - lp[p] between valid neighbours
    examples = (
        Example(
            "drops 0.1 1.8 0.1 -1.6 2.5 with threshold 1: new segments at the 1.8 and the 2.5",
            ((1,) * 6,),
            ((2, 3, 1),),
            {"logprob_threshold": 1.0},
            {OLD_LOG_PROB: ((-0.1, -0.2, -2.0, -2.1, -0.5, -3.0),)},
        ),
        Example(
            "a drop is taken over a hole, whatever the hole holds",
            ((1, 0, 1, 1),),
            ((1, 2),),
            {"logprob_threshold": 1.0},
            {OLD_LOG_PROB: ((-0.1, -9.0, -2.0, -2.0),)},
        ),
        Example(
            "per sample: drops 0.5 0.5 0.5 2 0.5 have mean 0.8 and std 0.6; z > 1 means a drop above 1.4",
            ((1,) * 6,),
            ((4, 2),),
            {"logprob_threshold": 1.0, "logprob_per_sample": True},
            {OLD_LOG_PROB: ((0.0, -0.5, -1.0, -1.5, -3.5, -4.0),)},
        ),
        Example(
            "at the cutoff: drops 1.0 -0.5 1.5 with threshold 1: a drop equal to it starts nothing, only the 1.5 does",
            ((1,) * 4,),
            ((3, 1),),
            {"logprob_threshold": 1.0},
            {OLD_LOG_PROB: ((-0.5, -1.5, -1.0, -2.5),)},
        ),
        Example(
            "per sample at the cutoff: drops 1 -1 1 -1 have mean 0 and std 1, so z = 1 puts the row's cutoff on the "
            "drops of 1, which start nothing",
            ((1,) * 5,),
            ((5,),),
            {"logprob_threshold": 1.0, "logprob_per_sample": True},
            {OLD_LOG_PROB: ((0.0, -1.0, 0.0, -1.0, 0.0),)},
        ),
        Example(
            "per sample, a hair under the cutoff: z = 1 - 2^-30 puts it just below the drops of 1, which start "
            "segments (the float64 cutoff is not rounded up onto them in float32)",
            ((1,) * 5,),
            ((1, 2, 2),),
            {"logprob_threshold": 1.0 - 2.0**-30, "logprob_per_sample": True},
            {OLD_LOG_PROB: ((0.0, -1.0, 0.0, -1.0, 0.0),)},
        ),
    )

    def candidates(self, config, packed, inputs):
        boundaries, scores = logprob_candidates(
            inputs.get(OLD_LOG_PROB), packed, config.logprob_threshold, config.logprob_per_sample
        )
        return Candidates(boundaries, scores)

    def reference(self, config, row):
        lp = [finite(x) for x in row.old_log_prob]
        drops = [0.0] + [max(-MAX_DROP, min(MAX_DROP, lp[p - 1] - lp[p])) for p in range(1, len(lp))]
        cutoff = config.logprob_threshold
        if config.logprob_per_sample:  # mean and population standard deviation of the row's drops
            n = max(len(drops) - 1, 1)
            mu = sum(drops[1:]) / n
            sigma = math.sqrt(sum((d - mu) ** 2 for d in drops[1:]) / n)
            cutoff = mu + config.logprob_threshold * max(sigma, STD_FLOOR)
        return [d if d > cutoff else None for d in drops]

    def sweeps(self, config, packed, inputs):
        drop, w = logprob_drops(inputs.get(OLD_LOG_PROB), packed)
        fixed = {"segment_rule": self.name}
        return [
            Sweep(
                "logprob/absolute",
                {**fixed, "logprob_per_sample": False},
                "logprob_threshold",
                quantile_grid(drop[w.bool()], 3),
            ),
            Sweep("logprob/per_sample", {**fixed, "logprob_per_sample": True}, "logprob_threshold", Z_GRID),
        ]
