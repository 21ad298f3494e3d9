"""fixed: one segment per ``segment_window`` valid tokens."""

from __future__ import annotations

import torch

from maspo_verl.core.segments.rule import Candidates, Example, SegmentRule, Sweep
from maspo_verl.validation import Int, Setting

# the longest window a calibration sweep tries
MAX_SWEPT_WINDOW = 100


class FixedRule(SegmentRule):
    """A new segment every `segment_window` valid tokens (5 / 15 / 50 ≈ phoneme / syllable / phrase at 50 Hz)."""

    name = "fixed"
    settings = (Setting("segment_window", 15, Int(1), "valid tokens per segment (`fixed`)"),)
    limits = {"token": {"segment_window": 1}, "sequence": {"segment_window": 1 << 30}}
    examples = (
        Example("a window of 4: ten tokens are 4, 4, 2", ((1,) * 10,), ((4, 4, 2),), {"segment_window": 4}),
        Example(
            "windows count valid tokens only (left padding, holes)",
            ((0, 0, 1, 1, 1, 0, 0), (1, 1, 0, 1, 1, 1, 0)),
            ((2, 1), (2, 2, 1)),
            {"segment_window": 2},
        ),
        Example(
            "max_segment_len splits a window: 5 -> 2, 2, 1",
            ((1,) * 10,),
            ((2, 2, 1, 2, 2, 1),),
            {"segment_window": 5, "max_segment_len": 2},
        ),
        Example(
            "at the cutoff: W = 3 over exactly 6 tokens is 3, 3 (no empty third window); over 7 it is 3, 3, 1",
            ((1,) * 6 + (0,), (1,) * 7),
            ((3, 3), (3, 3, 1)),
            {"segment_window": 3},
        ),
    )

    def candidates(self, config, packed, inputs):
        boundaries = packed.valid & (packed.columns % config.segment_window == 0)
        return Candidates(boundaries, torch.ones(boundaries.shape, device=boundaries.device))

    def reference(self, config, row):
        return [1.0 if p % config.segment_window == 0 else None for p in range(len(row.positions))]

    def sweeps(self, config, packed, inputs):
        longest = int(packed.lengths.max()) if packed.lengths.numel() else 1
        return [
            Sweep(
                "fixed",
                {"segment_rule": self.name},
                "segment_window",
                tuple(range(1, min(longest, MAX_SWEPT_WINDOW) + 1)),
            )
        ]
