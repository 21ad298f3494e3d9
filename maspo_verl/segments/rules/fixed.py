"""fixed: one segment per ``segment_window`` valid tokens."""

from __future__ import annotations

import torch

from maspo_verl.segments.rule import Candidates, SegmentRule, Sweep
from maspo_verl.validation import Int, Setting

# the longest window a calibration sweep tries
MAX_SWEPT_WINDOW = 100


def fixed_window_ids(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Segment ids of the fixed rule without min/max length effects: (valid position) // W."""
    mask = mask.bool()
    # floor((count - 1) / W) in float32: exact for counts below 2**24; 0 on padding
    pos = torch.cumsum(mask, dim=-1, dtype=torch.int32).sub_(1).mul_(mask).float()
    return pos.div_(window).floor_().long()


class FixedRule(SegmentRule):
    """A new segment every `segment_window` valid tokens (5 / 15 / 50 ≈ phoneme / syllable / phrase at 50 Hz)."""

    name = "fixed"
    settings = (Setting("segment_window", 15, Int(1), "valid tokens per segment (`fixed`)"),)
    limits = {"token": {"segment_window": 1}, "sequence": {"segment_window": 1 << 30}}
    native_code = 0

    def candidates(self, config, packed, inputs):
        boundaries = packed.valid & (packed.columns % config.segment_window == 0)
        return Candidates(boundaries, torch.ones(boundaries.shape, device=boundaries.device))

    def native_fields(self, config):
        return {"window": int(config.segment_window)}

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

    def direct_ids(self, config, mask):
        # min/max lengths cannot move boundaries that are W apart when min <= W and (max 0 or >= W)
        window, min_len, max_len = config.segment_window, config.min_segment_len, config.max_segment_len
        if min_len <= window and (max_len == 0 or max_len >= window):
            return fixed_window_ids(mask, window)
        return None
