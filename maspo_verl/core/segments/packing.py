"""Packed rows: each row's valid tokens moved to the front, so that "the previous valid token" is the previous
column and a position counted in valid tokens is a column index, whatever the padding (left, right, holes)."""

from __future__ import annotations

import torch


class Packed:
    """The valid tokens of each row of a [B, T] mask moved to the front of the row, in order.

    Column p of a packed tensor holds the row's valid token number p, so the previous valid token is
    the previous column and a position counted in valid tokens is the column index; columns from the
    row's length on are padding. ``pack`` is one scatter, ``unpack`` one gather.
    """

    def __init__(self, mask: torch.Tensor):
        self.mask = mask = mask.bool()  # token order
        B, T = mask.shape
        count = torch.cumsum(mask, dim=-1, dtype=torch.int32)  # int32: several times faster than int64 on CPU
        self.lengths = count[:, -1:].clone() if T else count.new_zeros(B, 1)
        # each token's column; padding goes to a dump column T, cut off after packing
        self.slot = torch.where(mask, count.sub_(1), T).long()
        self.columns = torch.arange(T, device=mask.device, dtype=torch.int32)
        self.valid = self.columns < self.lengths
        # valid tokens with a previous valid token: all but column 0
        self.has_previous = self.valid.clone()
        self.has_previous[:, :1] = False

    def pack(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """x [B, T] in token order -> packed [B, T] (``fill`` past each row's length)."""
        B, T = x.shape
        return x.new_full((B, T + 1), fill).scatter_(-1, self.slot, x)[:, :T]

    def unpack(self, y: torch.Tensor, fill=0) -> torch.Tensor:
        """Packed y -> token order, ``fill`` on padding."""
        B, T = y.shape
        ext = y.new_empty((B, T + 1))
        ext[:, T] = fill
        ext[:, :T] = y
        return torch.gather(ext, -1, self.slot)


def previous(x: torch.Tensor) -> torch.Tensor:
    """Packed x shifted by one column: each valid token sees the previous valid token's value (0 in
    column 0, which has none)."""
    out = torch.empty_like(x)
    out[:, :1] = 0
    out[:, 1:] = x[:, :-1]
    return out
