"""The grid's cells: ``L<tokens>/<mismatch>/U<updates>[/lr<lr>][/u<median unit frames>]``, and its mismatches."""

from __future__ import annotations

import re

UNIT_MEDIAN = 6  # frames: the speech-like task's median unit (120 ms at 50 Hz)


def parse_mismatch(text: str) -> tuple[str, float]:
    """``none`` | ``bf16`` | ``fp16`` | ``stale<K>`` | ``noise<SIGMA>`` -> (kind, K or SIGMA)."""
    allowed = "none, bf16, fp16, stale<K> (K >= 1 updates behind, e.g. stale2), noise<SIGMA> (e.g. noise0.2)"
    if text in ("none", "bf16", "fp16"):
        return text, 0.0
    m = re.fullmatch(r"(stale|noise)([0-9.]+)", text)
    if m:
        value = float(m.group(2))
        if (m.group(1) == "stale" and value >= 1 and value == int(value)) or (m.group(1) == "noise" and value > 0):
            return m.group(1), value
    raise SystemExit(f"--mismatch {text!r}: allowed {allowed}")


def parse_cell(text: str) -> dict:
    """``L<tokens>/<mismatch>/U<updates>[/lr<lr>][/u<median unit frames>]`` -> a grid job's cell fields."""
    m = re.fullmatch(r"L(\d+)/([^/]+)/U(\d+)(?:/lr([0-9.e-]+))?(?:/u(\d+))?", text)
    if not m:
        raise SystemExit(
            f"--cells {text!r}: L<tokens>/<mismatch>/U<updates>[/lr<lr>][/u<unit>], e.g. L96/stale2/U4/lr1/u24"
        )
    parse_mismatch(m.group(2))
    return {
        "length": int(m.group(1)),
        "mismatch": m.group(2),
        "updates": int(m.group(3)),
        "lr": float(m.group(4)) if m.group(4) else None,
        "unit": int(m.group(5)) if m.group(5) else UNIT_MEDIAN,
    }
