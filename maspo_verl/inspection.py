"""Samples of what the loss did, written during training (``policy_loss.inspect_dir``).

With ``inspect_dir`` set, every ``inspect_every``-th trainer step the loss on data-parallel rank 0
writes one JSON file ``<inspect_dir>/step_<step>.json`` holding the first ``ROWS`` responses of one
micro-batch (the first of the step's last mini-batch, whose ratios are off-policy when the step has
several): response ids, mask, old and new log-probs, advantages, word ids when the batch has them,
the segment ids of the configured rule, and per segment its shared ratio and clip counts
(``python -m maspo_verl.lab segments`` reads these files). Other loss modes write what applies:
``ctpo`` has no segments (per-token prefix ratios), verl's ``vanilla``, ``cispo`` and ``sapo`` are one
segment per token, ``gspo`` one per response, verl's other losses only the inputs.

Costs: with ``inspect_dir`` unset the loss runs exactly as without this module (one Python
attribute test). On an inspected step the loss gathers the rows on the device and moves them to
the host in one transfer; other steps add nothing.

The step and the rank come from the actor update in scope (``maspo_verl.batch.current_update``,
set by the plugin's hook on verl's actor update); outside verl each loss call counts as a step and
the rank is torch.distributed's (0 without it). The folder must be writable from the node of
data-parallel rank 0 (use an absolute path on storage that node can reach, as for verl's
checkpoint folder ``trainer.default_local_dir``; a relative path is made absolute on the driver
before Ray starts). Files are written to a temporary name and renamed, so several model-parallel
ranks writing the same step cannot leave a torn file.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from typing import Any

import torch

from maspo_verl.batch import WORD_IDS_KEY, current_micro_batch, current_update, micro_batch_flag

FORMAT = "maspo_verl.inspect/1"
# responses written per inspected step
ROWS = 4
# per-token clip outcome codes (clipped_low / clipped_high / clipped_dual are disjoint)
CLIP_NONE, CLIP_LOW, CLIP_HIGH, CLIP_DUAL = 0, 1, 2, 3
# verl marks the micro-batches of a step's last mini-batch with this flag (True there)
LAST_MINI_BATCH_FLAG = "update_lr_scheduler"

_written: set[tuple[str, int]] = set()
_calls = itertools.count(1)


def file_name(step: int) -> str:
    return f"step_{step:06d}.json"


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def due(pl: Any) -> int | None:
    """The step to write in this loss call, or None. Pure Python, no tensor op; called only when
    ``pl.inspect_dir`` is set. Each (folder, step) is written once per process."""
    update = current_update()
    if update is None:
        step, writer = next(_calls), _rank() == 0
    else:
        step, writer = update.step, update.writer
    if not writer or step % pl.inspect_every:
        return None
    if not micro_batch_flag(LAST_MINI_BATCH_FLAG, True):
        return None
    key = (os.path.abspath(pl.inspect_dir), step)
    if key in _written:
        return None
    _written.add(key)
    return step


def record(
    rows: int,
    mask: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    ratio: torch.Tensor | None = None,
    surrogate: Any = None,
    seg_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The first ``rows`` rows of the loss's [B, T] tensors and of the micro-batch's response and word ids
    where it has them (on the device; ``write`` moves them).
    ``ratio``: the shared ratio of each token; ``surrogate``: the clip masks; ``seg_ids``: segments."""
    out = {
        "mask": mask[:rows],
        "old_log_probs": old_log_prob[:rows],
        "log_probs": log_prob.detach()[:rows],
        "advantages": advantages.expand(mask.shape)[:rows],
    }
    if ratio is not None:
        out["ratio"] = ratio[:rows]
    if surrogate is not None:
        clip = surrogate.clipped_low[:rows].to(torch.int8) * CLIP_LOW
        clip += surrogate.clipped_high[:rows].to(torch.int8) * CLIP_HIGH
        clip += surrogate.clipped_dual[:rows].to(torch.int8) * CLIP_DUAL
        out["clip"] = clip * mask[:rows]
    if seg_ids is not None:
        out["segment_ids"] = seg_ids[:rows]
    return {**out, **_batch_ids(rows, mask)}


def _batch_ids(rows: int, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Response ids and word ids of the micro-batch in scope (first ``rows`` rows), where it has them."""
    from maspo_verl.batch import current_response_ids, current_word_ids

    data = current_micro_batch()
    out = {}
    if data is None:
        return out
    if "responses" in data.keys():
        out["response_ids"] = current_response_ids(mask)[:rows]
    if WORD_IDS_KEY in data.keys():
        out["word_ids"] = current_word_ids(mask)[:rows]
    return out


def _config_dict(pl: Any) -> dict:
    if dataclasses.is_dataclass(pl):
        fields = {f.name: getattr(pl, f.name) for f in dataclasses.fields(pl) if not f.name.startswith("_")}
    else:
        fields = dict(pl)
    return {k: (list(v) if isinstance(v, tuple | list) else v) for k, v in fields.items() if _jsonable(v)}


def _jsonable(v: Any) -> bool:
    return v is None or isinstance(v, bool | int | float | str) or isinstance(v, list | tuple)


def _clip_settings(actor: Any) -> dict:
    get = actor.get if hasattr(actor, "get") else lambda k, d=None: getattr(actor, k, d)
    return {k: get(k, None) for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c")}


def write(step: int, tensors: dict[str, torch.Tensor], pl: Any, actor: Any, loss_mode: str) -> str:
    """Write ``tensors`` (``record``'s) for ``step``: one device-to-host
    transfer of all of them, then a JSON file. Returns its path."""
    rows, width = tensors["mask"].shape
    names = list(tensors)
    # one transfer: every value fits a float64 exactly (ids < 2**53, float32/bf16 log-probs)
    flat = torch.cat([tensors[n].reshape(-1).to(torch.float64) for n in names]).tolist()
    host = {n: flat[i * rows * width : (i + 1) * rows * width] for i, n in enumerate(names)}
    responses = [_response(r, width, host) for r in range(rows)]
    doc = {
        "format": FORMAT,
        "step": step,
        "dp_rank": 0,
        "loss_mode": loss_mode,
        "policy_loss": _config_dict(pl),
        "actor": _clip_settings(actor),
        "responses": responses,
    }
    os.makedirs(pl.inspect_dir, exist_ok=True)
    path = os.path.join(pl.inspect_dir, file_name(step))
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"), allow_nan=False)
    os.replace(tmp, path)
    return path


INT_FIELDS = ("mask", "response_ids", "word_ids", "segment_ids", "clip")


def _response(r: int, width: int, host: dict[str, list[float]]) -> dict:
    row = {n: v[r * width : (r + 1) * width] for n, v in host.items()}
    out: dict[str, Any] = {"row": r}
    for name, values in row.items():
        if name in INT_FIELDS:
            out[name] = [int(x) for x in values]
        else:  # -inf old log-probs (a valid token the engine could not score) become null
            out[name] = [x if math.isfinite(x) else None for x in values]
    if "segment_ids" in out and "ratio" in out:
        out["segments"] = segment_table(out)
    return out


def segment_table(resp: dict) -> dict[str, list]:
    """Per segment of a written response (valid tokens only): first token, length, shared ratio and
    the number of its tokens clipped low / high / dual."""
    starts, lengths, ratios, clips = [], [], [], []
    last = None
    for t, (m, s) in enumerate(zip(resp["mask"], resp["segment_ids"], strict=True)):
        if not m:
            continue
        if s != last:
            starts.append(t)
            lengths.append(0)
            ratios.append(resp["ratio"][t])
            clips.append([0, 0, 0])
            last = s
        lengths[-1] += 1
        code = resp.get("clip", [CLIP_NONE] * len(resp["mask"]))[t]
        if code:
            clips[-1][code - 1] += 1
    return {
        "start": starts,
        "length": lengths,
        "ratio": ratios,
        "clip_low": [c[0] for c in clips],
        "clip_high": [c[1] for c in clips],
        "clip_dual": [c[2] for c in clips],
    }
