"""The verl micro-batch in scope of a loss call, and the keys that travel through verl's batch.

verl's registered policy losses receive log-probs, advantages and the mask, never the response token
ids, although the micro-batch that ``verl.workers.utils.losses.ppo_loss`` scores holds them. The
plugin's wrapper around ``ppo_loss`` (``maspo_verl.plugin.hooks``) puts that micro-batch in a context
variable for the duration of the call, with the actor's tokenizer (which verl's engine worker attaches
to the actor config); rules that need token ids or the vocabulary's text read them here. Outside verl,
wrap the call in ``micro_batch_scope({"responses": ids}, tokenizer)``.

Word ids (``segment_rule=words``) travel next to the responses under ``WORD_IDS_KEY``: one integer
per response token, the index of the recognised word the token belongs to, -1 between words and
where the reward found none. The path through verl's v1 trainer (0.9.0, 0.9.1, development branch):
the reward returns them in ``reward_extra_info[WORD_IDS_KEY]``; the plugin's hook on
``AgentLoopOutput.as_dict`` (the same hook that turns per-token scores into ``rm_scores``) makes
them a per-sample tensor field, which the agent loop stores with the sample in the TransferQueue;
the actor update fetches every field of its samples, and verl's data-parallel split, mini-batch
iterator and (dynamic) micro-batching index the whole TensorDict, so the field arrives in the micro-
batch ``ppo_loss`` scores as a jagged tensor, row-aligned with ``responses``.

The actor update a loss call belongs to (its trainer step, and whether this rank writes for data-parallel
rank 0) is in scope too (``update_scope``, set by the plugin's hook on verl's actor update): what
``policy_loss.inspect_dir`` needs (``maspo_verl.inspection``).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

import torch

# The keys that travel through verl's batch: per-token reward scores (``reward_extra_info``, which the
# plugin's hook turns into ``rm_scores``) and word ids (``reward_extra_info``, then a tensor field).
TOKEN_SCORES_KEY = "maspo_token_scores"
WORD_IDS_KEY = "maspo_word_ids"
NO_WORD = -1

_micro_batch: contextvars.ContextVar[Any] = contextvars.ContextVar("maspo_micro_batch", default=None)
_tokenizer: contextvars.ContextVar[Any] = contextvars.ContextVar("maspo_tokenizer", default=None)
_update: contextvars.ContextVar[Update | None] = contextvars.ContextVar("maspo_update", default=None)


@dataclass(frozen=True)
class Update:
    """The actor update a loss call belongs to: the trainer step, and whether this process writes
    what rank 0 of the data-parallel group writes (``writer``: DP rank 0 and, with model parallelism,
    the rank that holds the model outputs)."""

    step: int
    dp_rank: int = 0
    writer: bool = True


class update_scope:
    """Make ``update`` (an ``Update``) the one the loss calls in this scope belong to (the plugin's hook
    on verl's actor update sets it; outside verl, tests and tools set it themselves)."""

    def __init__(self, update: Update):
        self.update = update

    def __enter__(self):
        self._token = _update.set(self.update)
        return self.update

    def __exit__(self, *exc):
        _update.reset(self._token)


def current_update() -> Update | None:
    """The actor update in scope, or None (the loss was called outside verl's actor update)."""
    return _update.get()


def current_micro_batch() -> Any:
    """The verl micro-batch in scope (a dict or TensorDict), or None."""
    return _micro_batch.get()


def micro_batch_flag(name: str, default: Any = None) -> Any:
    """A non-tensor value of the micro-batch in scope (verl's ``NonTensorData``, unwrapped), else ``default``."""
    data = _micro_batch.get()
    if data is None or not hasattr(data, "get"):
        return default
    try:
        value = data.get(name, None)
    except Exception:  # noqa: BLE001 - a TensorDict may refuse a key it cannot stack
        return default
    return default if value is None else getattr(value, "data", value)


class micro_batch_scope:
    """Make ``data`` (a dict or TensorDict with ``responses``) and the actor's ``tokenizer`` (an HF
    tokenizer, for ``segment_rule=delimiters``; None: none) visible to the loss."""

    def __init__(self, data, tokenizer=None):
        self.data = data
        self.tokenizer = tokenizer

    def __enter__(self):
        self._tokens = (_micro_batch.set(self.data), _tokenizer.set(self.tokenizer))
        return self.data

    def __exit__(self, *exc):
        _tokenizer.reset(self._tokens[1])
        _micro_batch.reset(self._tokens[0])


def current_tokenizer(needed_by: str = "this segment rule") -> Any:
    """The actor's tokenizer in scope of the loss call (verl's ``ActorConfig.model_config.tokenizer``);
    ``needed_by`` names who asks in the error."""
    tokenizer = _tokenizer.get()
    if tokenizer is None:
        raise RuntimeError(
            f"{needed_by} needs the actor's tokenizer, but none is in scope: outside verl, wrap the "
            "loss call in maspo_verl.batch.micro_batch_scope(data, tokenizer); inside verl, the plugin's ppo_loss "
            "hook takes it from the actor config's model_config.tokenizer, which this verl worker does not set "
            "(run `python -m maspo_verl check`)"
        )
    return tokenizer


def current_response_ids(mask: torch.Tensor, needed_by: str = "this segment rule") -> torch.Tensor:
    """Response token ids of the micro-batch being scored, right-padded to ``mask``'s shape (``needed_by``: who
    asks, for the error)."""
    data = _micro_batch.get()
    if data is None:
        raise RuntimeError(
            f"{needed_by} needs the response token ids, but no verl micro-batch is in scope: the loss "
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


def current_word_ids(mask: torch.Tensor, needed_by: str = "this segment rule") -> torch.Tensor:
    """Word id of each token of the micro-batch being scored, right-padded to ``mask``'s shape (``needed_by``:
    who asks, for the error).

    ``NO_WORD`` (-1) on padding, between words, and on every token of a row whose ids are absent
    (no ``WORD_IDS_KEY`` in the micro-batch) or whose length differs from its response's (verl's
    synthetic padding samples copy another sample's fields): such rows have no words and take the
    fallback rule. Vectorised, no host sync.
    """
    data = _micro_batch.get()
    if data is None:
        raise RuntimeError(
            f"{needed_by} needs the word ids of verl's micro-batch, but none is in scope: the loss was "
            "called outside verl's ppo_loss (wrap the call in maspo_verl.batch.micro_batch_scope), or the "
            "plugin's ppo_loss hook is not installed (run `python -m maspo_verl check`)"
        )
    B, T = mask.shape
    words = data.get(WORD_IDS_KEY, None) if hasattr(data, "get") else None
    if words is None:
        return torch.full((B, T), NO_WORD, dtype=torch.long, device=mask.device)
    if words.is_nested:
        lengths = words.offsets().diff()
        responses = data.get("responses", None)
        same = lengths == responses.offsets().diff() if responses is not None and responses.is_nested else None
        words = words.to_padded_tensor(NO_WORD, output_size=(B, T))
        if same is not None:
            words = torch.where(same.to(words.device).unsqueeze(-1), words, NO_WORD)
    elif words.shape[-1] >= T:
        words = words[:, :T]
    else:
        words = torch.nn.functional.pad(words, (0, T - words.shape[-1]), value=NO_WORD)
    if words.shape[0] != B:
        raise RuntimeError(f"micro-batch word ids have shape {tuple(words.shape)}, loss mask {tuple(mask.shape)}")
    return words.to(device=mask.device, dtype=torch.long)
