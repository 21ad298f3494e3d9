"""``min_segment_len`` and ``max_segment_len``, for every rule: non-maximum suppression of boundaries closer than
the minimum to a stronger one, and a forced boundary every maximum tokens inside a segment (packed rows)."""

from __future__ import annotations

import math

import torch

from maspo_verl.core.ratios import float_mask
from maspo_verl.core.segments.packing import Packed

# the key of a token that is no boundary
_FLOOR = torch.finfo(torch.float32).max


def suppress_close(
    boundaries: torch.Tensor, scores: torch.Tensor, min_len: int, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """Non-maximum suppression on packed rows: drop a boundary within ``min_len - 1`` tokens of a
    stronger one.

    Boundaries are ordered by score, ties going to the earlier one (a strict total order);
    boundaries that must stay (the first valid token, tokens outside the codec: ``forced``, a subset
    of ``boundaries``) carry score +inf; ``scores`` are otherwise finite. A boundary survives when it
    is the strongest of all boundaries within ``min_len - 1`` valid tokens on either side,
    *suppressed ones included*, so no two survivors are closer than ``min_len``. Two consequences: a
    boundary can be dropped by a stronger neighbour that is itself dropped (in 9 . 8 . 9 with
    min_len 3 the 9s survive, the 8 goes, but in 7 . 8 . 9 only the 9 survives: the 7 is dropped by
    the 8, which the 9 drops), and the row's last segment may be shorter than ``min_len``. Forced
    boundaries next to each other suppress each other like equal scores (the caller keeps them).

    Linear in T: the strongest earlier and later neighbours come from one sliding-window max over
    the packed rows (strictly stronger than every earlier neighbour, at least as strong as every
    later one).
    """
    if min_len <= 1:
        return boundaries
    B, T = boundaries.shape
    pad = min_len - 1
    keys = torch.empty((B, T + 2 * pad), device=boundaries.device)
    keys[:, :pad] = -math.inf
    keys[:, pad + T :] = -math.inf
    own = keys[:, pad : pad + T]
    # the score on boundaries, the float32 floor elsewhere, as arithmetic (faster than a select)
    on = float_mask(boundaries)
    torch.addcmul(on.sub(1.0).mul_(_FLOOR), scores, on, out=own)
    if forced is not None:  # + inf where forced (0 * inf is nan: made 0)
        own.add_(float_mask(forced).mul_(math.inf).nan_to_num_(nan=0.0, posinf=math.inf))
    # window max over the pad columns before each column; column p's later neighbours are the window at p + min_len
    window = torch.nn.functional.max_pool1d(keys.unsqueeze(1), pad, stride=1).squeeze(1)
    keep = (own > window[:, :T]).logical_and_(own >= window[:, min_len : min_len + T])
    return keep.logical_and_(boundaries)


def split_long(boundaries: torch.Tensor, packed: Packed, max_len: int) -> torch.Tensor:
    """Add a boundary every ``max_len`` valid tokens inside each segment (packed; the first valid
    token must be a boundary; what it adds past a row's length is never unpacked)."""
    if max_len <= 0:
        return boundaries
    columns = packed.columns
    # distance to the last boundary, in valid tokens (exact in float32 below 2**24); a multiple of
    # max_len when its quotient is a whole number
    last = torch.cummax(float_mask(boundaries, torch.int32).mul_(columns), dim=-1).values
    since = torch.sub(columns.float(), last).div_(max_len)
    return boundaries | (since.frac_() == 0)
