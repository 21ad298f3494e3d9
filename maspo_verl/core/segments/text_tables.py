"""The actor tokenizer's text tables for rules that look for strings in the response (``segment_rule=delimiters``):
``maspo_verl.vocab.resolve`` of the strings over the vocabulary, once per process and tokenizer, as tensors once
per device; and the tokenizer verl's actor will load, opened on the driver at start-up."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from maspo_verl import vocab

# (id(tokenizer), delimiters, step_markers) -> (tokenizer, vocab.TextTables, {device: tensors})
_TEXT_TABLES: dict[tuple, tuple[Any, vocab.TextTables, dict]] = {}


def _entry(tokenizer: Any, delimiters: Sequence[str], step_markers: Sequence[str]) -> tuple:
    key = (id(tokenizer), tuple(delimiters), tuple(step_markers))
    if key not in _TEXT_TABLES:
        tables = vocab.resolve(vocab.vocabulary_texts(tokenizer), delimiters, step_markers)
        _TEXT_TABLES[key] = (tokenizer, tables, {})  # the tokenizer is kept so that its id stays unique
    return _TEXT_TABLES[key]


def text_tables(tokenizer: Any, delimiters: Sequence[str], step_markers: Sequence[str]) -> vocab.TextTables:
    """``vocab.resolve`` of the strings over ``tokenizer``'s vocabulary (an HF tokenizer, or the text of
    each id), once per process."""
    return _entry(tokenizer, delimiters, step_markers)[1]


def device_tables(
    tokenizer, delimiters, step_markers, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """The tables of the strings as int64 tensors on ``device`` (moved once), and the split masks."""
    _, tables, on_device = _entry(tokenizer, delimiters, step_markers)
    if device not in on_device:
        on_device[device] = tuple(
            torch.tensor(t, dtype=torch.int64, device=device) for t in (tables.inside, tables.ends, tables.starts)
        )
    return (*on_device[device], tables.delimiter_splits, tables.marker_splits)


def driver_tokenizer(trainer_config: Any) -> tuple[Any, str]:
    """(the tokenizer verl's actor will load, its path), opened on the driver; raises what loading raises."""
    from transformers import AutoTokenizer

    model = trainer_config.actor_rollout_ref.model
    path = str(model.get("tokenizer_path") or model.get("path"))
    return AutoTokenizer.from_pretrained(path, trust_remote_code=bool(model.get("trust_remote_code"))), path
