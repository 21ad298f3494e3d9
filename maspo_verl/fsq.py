"""FSQ codes as mixed-radix digits, and distances between codes digit by digit (the ``tokenval`` rule's
``fsq_l1`` / ``fsq_hamming``; docs/algorithms.md). Vectorised; shared by the torch and C paths."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch


def _digits_slice(x: torch.Tensor, radix: int, size: int, out: torch.Tensor) -> torch.Tensor:
    """(x // radix) % size into ``out``: a shift and a mask when both are powers of two."""
    if radix & (radix - 1) == 0 and size & (size - 1) == 0:
        return torch.bitwise_right_shift(x, radix.bit_length() - 1, out=out).bitwise_and_(size - 1)
    return torch.div(x, radix, rounding_mode="floor", out=out).remainder_(size)


def _digit_loop(a: torch.Tensor, b: torch.Tensor, levels: Sequence[int], kind: str, radix: int = 1) -> torch.Tensor:
    """The distance digit by digit (the definition; also fills the lookup tables)."""
    dist = torch.zeros_like(a)
    da, db = torch.empty_like(a), torch.empty_like(b)
    for level in levels:
        _digits_slice(a, radix, level, da)
        _digits_slice(b, radix, level, db)
        dist.add_(da.sub_(db).abs_() if kind == "fsq_l1" else da.ne_(db))
        radix *= level
    return dist


# Digits are looked up in groups whose codes fit one byte: a table of all 256 x 256 pairs per group.
GROUP_CODES = 256


@functools.lru_cache(maxsize=16)
def pair_table(levels: tuple[int, ...], kind: str, device: str) -> torch.Tensor:
    """table[i * P + j] = distance between the codes i, j < P = prod(levels) (uint8: at most P - 1)."""
    size = math.prod(levels)
    i = torch.arange(size, dtype=torch.int32).repeat_interleave(size)
    j = torch.arange(size, dtype=torch.int32).repeat(size)
    return _digit_loop(i, j, levels, kind).to(torch.uint8).to(device)


def digit_groups(levels: Sequence[int]) -> list[tuple[int, ...]]:
    """Consecutive digits grouped while their codes fit a byte (a larger level stays alone)."""
    groups, current = [], []
    for level in levels:
        if current and math.prod(current) * level > GROUP_CODES:
            groups.append(tuple(current))
            current = []
        current.append(level)
    return groups + [tuple(current)]


def digits_distance(a: torch.Tensor, b: torch.Tensor, levels: Sequence[int], kind: str) -> torch.Tensor:
    """Distance between FSQ codes a, b in [0, prod(levels)) split into mixed-radix digits (digit 0
    least significant), as int64.

    ``fsq_l1``: sum_k |a_k - b_k|; ``fsq_hamming``: sum_k [a_k != b_k]. For XCodec2's [4]*8,
    digit k is (c >> 2k) & 3. Digits are taken a byte's worth at a time (four 2-bit digits) and
    their distance read from a table of all pairs, so [4]*8 costs two lookups; never loops over tokens.
    """
    return distance(a, b, levels, kind).long()


def distance(a: torch.Tensor, b: torch.Tensor, levels: Sequence[int], kind: str) -> torch.Tensor:
    """``digits_distance`` in the narrowest integer type that holds it (uint8 for [4]*8)."""
    levels = list(levels)
    # int32 when the codes fit: several times faster than int64 on CPU
    dtype = torch.int32 if math.prod(levels) < 2**31 else torch.long
    largest = sum(level - 1 for level in levels) if kind == "fsq_l1" else len(levels)
    out_dtype = torch.uint8 if largest < 256 else dtype
    a, b = a.to(dtype), b.to(dtype)
    dist = None
    ga, gb = torch.empty_like(a), torch.empty_like(b)
    radix = 1
    for group in digit_groups(levels):
        size = math.prod(group)
        if size > GROUP_CODES:  # one large digit: compute it directly
            part = _digit_loop(a, b, group, kind, radix)
        else:
            _digits_slice(a, radix, size, ga)
            _digits_slice(b, radix, size, gb)
            pair = ga.mul_(size).add_(gb)
            table = pair_table(group, kind, str(a.device))
            part = table.index_select(0, pair.reshape(-1)).view(a.shape)
        dist = part.to(out_dtype) if dist is None else dist.add_(part)
        radix *= size
    return dist
