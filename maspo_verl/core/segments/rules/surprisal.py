"""surprisal: forking tokens, the most surprising share of each response's tokens, start segments."""

from __future__ import annotations

import math

import torch

from maspo_verl.core.segments.rule import OLD_LOG_PROB, Candidates, Example, Packed, SegmentRule
from maspo_verl.core.segments.rules.logprob import MAX_DROP, finite
from maspo_verl.core.tensors import float_mask
from maspo_verl.validation import Float, Setting


def surprisal_candidates(
    old_log_prob: torch.Tensor, packed: Packed, quantile: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(boundaries, scores) of the surprisal rule on the packed rows: the k = floor(q L + 1/2) tokens of
    largest surprisal -log pi_old (float32; ties to the earlier token) of each row of L valid tokens
    start segments. The score is the surprisal."""
    B, T = packed.valid.shape
    lp = packed.pack(old_log_prob).float().nan_to_num_(nan=0.0, neginf=-MAX_DROP, posinf=MAX_DROP)
    surprisal = lp.neg_().clamp_(-MAX_DROP, MAX_DROP).mul_(float_mask(packed.valid))
    ranked = surprisal.masked_fill(~packed.valid, -math.inf)  # padding ranks last
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(T, device=order.device).expand(B, T))
    count = packed.lengths.double().mul_(quantile).add_(0.5).floor_().long()
    return (rank < count).logical_and_(packed.valid), surprisal


class SurprisalRule(SegmentRule):
    """Forking tokens: the `surprisal_quantile` share of each response's tokens with the largest −log πold start
    segments (0: GSPO's one segment, 1: GRPO's every token)."""

    name = "surprisal"
    needs = frozenset({OLD_LOG_PROB})
    settings = (
        Setting(
            "surprisal_quantile",
            0.2,
            Float(0.0, 1.0),
            "share of each response's tokens, most surprising first, that start a segment (`surprisal`)",
        ),
    )
    limits = {"token": {"surprisal_quantile": 1.0}, "sequence": {"surprisal_quantile": 0.0}}
    examples = (
        Example(
            "q = 0.2 of 10 tokens: the 2 most surprising (3.0 and 2.0) start segments, as does the first",
            ((1,) * 10,),
            ((1, 3, 6),),
            {"surprisal_quantile": 0.2},
            {OLD_LOG_PROB: ((-0.1, -2.0, -0.2, -0.3, -3.0, -0.1, -0.2, -0.1, -0.5, -0.4),)},
        ),
        Example(
            "q = 0.25 of 4 tokens: one start; of two equal surprisals the earlier wins",
            ((1, 1, 1, 1),),
            ((1, 3),),
            {"surprisal_quantile": 0.25},
            {OLD_LOG_PROB: ((-1.0, -2.0, -2.0, -0.5),)},
        ),
        Example(
            "at the cutoff: q L = 0.5 x 5 = 2.5 rounds half up, floor(2.5 + 1/2) = 3 starts (the surprisals 5, 4, 3; "
            "rounding half to even would give 2)",
            ((1,) * 5,),
            ((1, 2, 1, 1),),
            {"surprisal_quantile": 0.5},
            {OLD_LOG_PROB: ((-1.0, -5.0, -2.0, -4.0, -3.0),)},
        ),
    )

    def reference(self, config, row):
        surprisal = [max(-MAX_DROP, min(MAX_DROP, -finite(x))) for x in row.old_log_prob]
        count = math.floor(len(surprisal) * config.surprisal_quantile + 0.5)
        top = sorted(range(len(surprisal)), key=lambda p: (-surprisal[p], p))[:count]  # ties: the earlier
        return [s if p in top else None for p, s in enumerate(surprisal)]

    def candidates(self, config, packed, inputs):
        return Candidates(*surprisal_candidates(inputs.get(OLD_LOG_PROB), packed, config.surprisal_quantile))
