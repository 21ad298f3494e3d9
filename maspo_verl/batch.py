"""The verl micro-batch in scope of a loss call.

verl's registered policy losses receive log-probs, advantages and the mask, never the response token
ids, although the micro-batch that ``verl.workers.utils.losses.ppo_loss`` scores holds them. The
plugin's wrapper around ``ppo_loss`` (``maspo_verl.plugin``) puts that micro-batch in a context
variable for the duration of the call; rules that need token ids read it here. Outside verl, wrap the
call in ``micro_batch_scope({"responses": ids})``.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

_micro_batch: contextvars.ContextVar[Any] = contextvars.ContextVar("maspo_micro_batch", default=None)


class micro_batch_scope:
    """Make ``data`` (a dict or TensorDict with ``responses``) visible to the loss."""

    def __init__(self, data):
        self.data = data

    def __enter__(self):
        self._token = _micro_batch.set(self.data)
        return self.data

    def __exit__(self, *exc):
        _micro_batch.reset(self._token)


def current_response_ids(mask: torch.Tensor) -> torch.Tensor:
    """Response token ids of the micro-batch being scored, right-padded to ``mask``'s shape."""
    data = _micro_batch.get()
    if data is None:
        raise RuntimeError(
            "this segment rule needs the response token ids, but no verl micro-batch is in scope: the loss "
            "was called outside verl's ppo_loss (wrap the call in maspo_verl.batch.micro_batch_scope), or the "
            "plugin's ppo_loss hook is not installed (run `python -m maspo_verl check`)"
        )
    responses = data["responses"]
    B, T = mask.shape
    if responses.is_nested:
        # every response fits in the loss width T (verl pads log-probs to the longest response)
        responses = responses.to_padded_tensor(0, output_size=(B, T))
    if responses.shape[0] != B or responses.shape[1] < T:
        raise RuntimeError(f"micro-batch responses have shape {tuple(responses.shape)}, loss mask {tuple(mask.shape)}")
    return responses[:, :T].to(mask.device)
