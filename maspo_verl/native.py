"""The C path of the segmentation: ``maspo_verl.segments``'s segment ids from a small C library
(``maspo_verl/csrc/segment_ids.c``) that walks each row's valid tokens once, for tensors on the CPU.

The library is compiled with the system's C compiler (``$CC``, else ``cc``) the first time it is
needed, in well under a second, and cached by a hash of its source and flags under
``$MASPO_VERL_CACHE`` (default ``$XDG_CACHE_HOME/maspo_verl``, else ``~/.cache/maspo_verl``). Without
a compiler the torch path runs instead and ``unavailable()`` says why. The segmentation
(``maspo_verl.segments``) asks ``config_for`` whether its rules have a C implementation (each rule's
``native_code``; the settings that cross are the rule's ``native_fields``) and runs ``compute_segments``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from maspo_verl import fsq

SOURCE = Path(__file__).with_name("csrc") / "segment_ids.c"
# no -ffast-math and no contraction: float32 arithmetic as torch does it, so both paths agree exactly
FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-pthread")
MAX_GROUPS = 64  # as in the C source
# distances by their C codes (the rules' codes are their ``native_code``)
DISTANCES = {"id": 0, "fsq_l1": 1, "fsq_hamming": 2}
_FLOATS = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}
_INTS = {torch.int64: 0, torch.int32: 1}
# row_state values
ROW_EMPTY, ROW_OWN_RULE, ROW_FALLBACK = 0, 1, 2
# rows go to threads in slices of at least this many tokens (a thread start costs more than a few)
TOKENS_PER_THREAD = 1 << 16


class Config(ctypes.Structure):
    """The C ``config`` struct: a rule's settings (built by ``config_for``)."""

    _fields_ = (
        [
            (name, ctypes.c_int64)
            for name in ("rule", "fallback_rule", "window", "per_sample", "min_len", "max_len", "turn_window")
        ]
        + [(name, ctypes.c_double) for name in ("logprob_threshold", "tokenval_threshold", "std_floor", "max_drop")]
        + [(name, ctypes.c_int64) for name in ("codec_offset", "codec_size", "distance", "n_groups")]
        + [
            ("group_radix", ctypes.c_int64 * MAX_GROUPS),
            ("group_size", ctypes.c_int64 * MAX_GROUPS),
            ("group_shift", ctypes.c_int64 * MAX_GROUPS),
            ("group_table", ctypes.c_void_p * MAX_GROUPS),
        ]
    )


def cache_dir() -> Path:
    explicit = os.environ.get("MASPO_VERL_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "maspo_verl"


_lock = threading.Lock()


@functools.cache
def load_library() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded library, None) or (None, why it could not be built); cached per process
    (``load_library.cache_clear()`` makes the next call look again)."""
    cc = os.environ.get("CC") or "cc"
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join((cc, *FLAGS)).encode()).hexdigest()[:16]
    errors = []
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"maspo_verl-{os.getuid()}"):
        path = folder / f"segment_ids-{key}.so"
        try:
            if not path.exists():
                folder.mkdir(parents=True, exist_ok=True)
                # build under a private name, then rename: processes starting together never load a half-written file
                tmp = folder / f".{path.name}.{os.getpid()}.{threading.get_ident()}"
                done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True)
                if done.returncode != 0:
                    tmp.unlink(missing_ok=True)
                    return None, f"`{cc}` could not build {SOURCE.name}: {done.stderr.strip()[-2000:]}"
                os.replace(tmp, path)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{folder}: {exc}")
            continue
        fn = lib.maspo_segment_ids
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.POINTER(Config),
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
        ]
        return lib, None
    return None, "no folder to build the segmentation library in: " + "; ".join(errors)


def library() -> ctypes.CDLL | None:
    with _lock:
        return load_library()[0]


def unavailable() -> str | None:
    """Why the C path cannot run here (None: it can)."""
    with _lock:
        return load_library()[1]


def _pointer(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def _as(x: torch.Tensor | None, kinds: dict, default: torch.dtype) -> tuple[torch.Tensor | None, int]:
    """x contiguous in a dtype the library reads (converted to ``default`` otherwise), and its code."""
    if x is None:
        return None, 0
    if x.dtype not in kinds:
        x = x.to(default)
    return x.contiguous(), kinds[x.dtype]


def segment_ids(
    mask: torch.Tensor,
    config: Config,
    old_log_prob: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    word_ids: torch.Tensor | None = None,
    sizes_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, bytes, torch.Tensor | None]:
    """For CPU tensors: segment ids [B, T] (int64, token order, 0 on padding), each row's state (B
    bytes: ``ROW_EMPTY``, ``ROW_OWN_RULE``, ``ROW_FALLBACK``) and, with ``sizes_dtype`` (float32 or
    float64), each segment's number of tokens at its id [B, T] (0 elsewhere; what a scatter-add of
    the mask over the ids gives). The inputs the rule reads must be given: ``old_log_prob``
    (logprob), ``token_ids`` (tokenval), ``word_ids`` (words)."""
    lib = library()
    if lib is None:
        raise RuntimeError(unavailable())
    B, T = mask.shape
    mask = mask.bool().contiguous()
    logp, logp_kind = _as(old_log_prob, _FLOATS, torch.float32)
    tokens, tokens_kind = _as(token_ids, _INTS, torch.int64)
    words, words_kind = _as(word_ids, _INTS, torch.int64)
    ids = torch.empty((B, T), dtype=torch.long)
    rows = ctypes.create_string_buffer(B)  # host bytes: reading them back is no tensor transfer
    if sizes_dtype is not None and sizes_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"sizes_dtype={sizes_dtype} is invalid: allowed torch.float32, torch.float64")
    sizes = None if sizes_dtype is None else torch.empty((B, T), dtype=sizes_dtype)
    threads = max(1, min(torch.get_num_threads(), B * T // TOKENS_PER_THREAD))
    status = lib.maspo_segment_ids(
        B,
        T,
        mask.data_ptr(),
        _pointer(logp),
        logp_kind,
        _pointer(tokens),
        tokens_kind,
        _pointer(words),
        words_kind,
        ctypes.byref(config),
        ids.data_ptr(),
        rows,
        _pointer(sizes),
        _FLOATS.get(sizes_dtype, 0),
        threads,
    )
    if status != 0:
        raise MemoryError(f"the segmentation library could not allocate its row buffers (T={T})")
    return ids, rows.raw, sizes


def config_for(config: Any, rules: Sequence[Any]) -> Config | None:
    """The C library's settings for the policy-loss ``config`` whose segmentation runs ``rules`` (the
    rule, then its fallback): the lengths, then each rule's own (``SegmentRule.native_fields``); None when
    one of the rules has no C implementation."""
    if any(rule.native_code is None for rule in rules):
        return None
    values = {"min_len": int(config.min_segment_len), "max_len": int(config.max_segment_len)}
    for rule in rules:
        values.update(rule.native_fields(config))
    return _config(tuple(rule.native_code for rule in rules), tuple(sorted(values.items())))


@functools.lru_cache(maxsize=64)
def _config(codes: tuple[int, ...], items: tuple[tuple[str, Any], ...]) -> Config | None:
    values = dict(items)
    levels = values.pop("fsq_levels", ())
    distance = values.pop("distance", "id")
    groups = fsq.digit_groups(levels) if levels and distance != "id" else []
    if len(groups) > MAX_GROUPS or math.prod(levels) >= 2**62:
        return None
    spec = Config(
        rule=codes[0],
        fallback_rule=codes[1] if len(codes) > 1 else 0,
        distance=DISTANCES[distance],
        n_groups=len(groups),
        **values,
    )
    spec.tables = []  # kept alive with the struct that points at them
    radix = 1
    for g, group in enumerate(groups):
        width = math.prod(group)
        spec.group_radix[g], spec.group_size[g] = radix, width
        powers = radix & (radix - 1) == 0 and width & (width - 1) == 0
        spec.group_shift[g] = radix.bit_length() - 1 if powers else -1
        if width <= fsq.GROUP_CODES:
            table = fsq.pair_table(group, distance, "cpu").contiguous()
            spec.tables.append(table)
            spec.group_table[g] = table.data_ptr()
        radix *= width
    return spec


def compute_segments(mask, spec: Config, rules: Sequence[Any], inputs: Any, metrics, sizes_dtype):
    """``maspo_verl.segments.compute_segments`` through the library: the inputs the ``rules`` read
    (``inputs.get(name)`` for each of their ``needs``), the ids and sizes, and the share of rows that
    took the fallback as the first rule's ``fallback_metric``."""
    needed = frozenset().union(*(rule.needs for rule in rules))
    read = {name: inputs.get(name) for name in needed}
    old_log_prob = read.get("old_log_prob")
    ids, rows, sizes = segment_ids(
        mask,
        spec,
        old_log_prob=None if old_log_prob is None else old_log_prob.detach(),
        token_ids=read.get("response_ids"),
        word_ids=read.get("word_ids"),
        sizes_dtype=sizes_dtype,
    )
    if metrics is not None and rules[0].fallback_metric:
        nonempty = len(rows) - rows.count(ROW_EMPTY)
        fell_back = rows.count(ROW_FALLBACK) / max(nonempty, 1)
        metrics[rules[0].fallback_metric] = torch.tensor(fell_back, dtype=torch.float64)
    return ids, sizes
