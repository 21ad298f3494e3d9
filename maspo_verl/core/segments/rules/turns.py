"""turns: one segment per assistant turn of a multi-turn response (a contiguous run of ``response_mask == 1``)."""

from __future__ import annotations

import torch

from maspo_verl.core.segments.rule import FORCED, Candidates, Example, SegmentRule, previous
from maspo_verl.validation import Int, Setting


class TurnsRule(SegmentRule):
    """One segment per assistant turn (a contiguous run of valid tokens between masked environment tokens);
    `turn_window` > 0 splits a longer turn into windows.

    A turn starts at a valid token whose previous valid token is not its neighbour: masked tokens (tool
    outputs, observations) lie between them. Turn starts always stay (``min_segment_len`` never merges two
    turns); the window boundaries inside a turn are ordinary ones. A response of one turn is GSPO's sequence
    ratio, ``turn_window=1`` GRPO's token ratio.
    """

    name = "turns"
    settings = (
        Setting(
            "turn_window", 0, Int(0), "split a turn into windows of this many tokens (0 = the whole turn; `turns`)"
        ),
    )
    limits = {"token": {"turn_window": 1}}
    examples = (
        Example("holes split turns: 2, 3, 1", ((1, 1, 0, 0, 1, 1, 1, 0, 1),), ((2, 3, 1),)),
        Example(
            "turn_window 2 splits each turn from its start: turns of 3 and 5 are 2, 1 and 2, 2, 1",
            ((1, 1, 1, 0, 1, 1, 1, 1, 1),),
            ((2, 1, 2, 2, 1),),
            {"turn_window": 2},
        ),
        Example("min_segment_len never merges turns", ((1, 0, 1, 1, 1),), ((1, 3),), {"min_segment_len": 3}),
        Example(
            "at the cutoff: a hole of exactly one token splits; turn_window equal to a turn's length keeps it whole",
            ((1, 1, 1, 0, 1, 1),),
            ((3, 2),),
            {"turn_window": 3},
        ),
    )

    def reference(self, config, row):
        out, since = [], 0
        for p, position in enumerate(row.positions):
            turn_start = p > 0 and position - row.positions[p - 1] > 1  # masked tokens in between
            since = 0 if p == 0 or turn_start else since + 1
            window_start = config.turn_window > 0 and since % config.turn_window == 0
            out.append(FORCED if turn_start else 1.0 if window_start else None)
        return out

    def candidates(self, config, packed, inputs):
        B, T = packed.valid.shape
        # each packed column's position in token order; a gap to the previous valid token is a hole
        where = packed.pack(packed.columns.expand(B, T).contiguous())
        starts = packed.has_previous & (where - previous(where) > 1)
        boundaries = starts.clone()
        window = config.turn_window
        if window > 0:
            # columns since the turn's start (the row's first valid token starts one too)
            first = starts.clone()
            first[:, :1] = True
            since = packed.columns - torch.cummax(first * packed.columns, dim=-1).values
            boundaries |= packed.valid & (since % window == 0)
        return Candidates(boundaries, torch.ones(boundaries.shape, device=boundaries.device), starts)
