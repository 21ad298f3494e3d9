"""Tensor helpers the whole core shares (the loss, the metrics, the token sets, the segment rules)."""

from __future__ import annotations

import torch


def float_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A mask as 0/1 floats; bool goes through uint8, which CPU kernels convert much faster (not under
    ``torch.compile``, whose fused kernels convert directly and cannot reinterpret a bool buffer)."""
    if mask.dtype == torch.bool and mask.is_contiguous() and not torch.compiler.is_compiling():
        return mask.view(torch.uint8).to(dtype)
    return mask.bool().to(dtype)
