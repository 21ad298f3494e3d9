"""A cell, one point of a study's axes: ``L<tokens>/<mismatch>/U<updates>[/lr<lr>][/u<median unit frames>]`` (or
``<tokens>/<mismatch>/<updates>``, as ``lab learn --cells`` takes it), and its rollout mismatch: ``none``, or terms
joined by ``+``: first a rollout precision ``bf16`` | ``fp16``, then ``stale<K>`` (the rollout's weights K updates
behind) and a noise sigma on the reported log-probs, ``noise<SIGMA>`` or ``SIGMA`` (e.g. ``bf16+0.05``,
``stale1+0.2``). A cell's label keeps its mismatch as written."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

UNIT_MEDIAN = 6  # frames: the speech-like task's median unit (120 ms at 50 Hz)
NO_MISMATCH = "none"
DTYPES = ("bf16", "fp16")
STALE, NOISE = "stale", "noise"
ALLOWED = (
    f"{NO_MISMATCH}, or terms joined by +: first bf16 | fp16, then {STALE}<K> (K >= 1 updates behind) and a sigma "
    f">= 0 ({NOISE}<SIGMA> or SIGMA), e.g. bf16, {STALE}2, {NOISE}0.2, 0.2, bf16+0.05, {STALE}1+0.2"
)


@dataclass(frozen=True)
class Mismatch:
    """The rollout against the trained policy: its precision, its staleness in updates and the noise sigma on its
    reported log-probs."""

    dtype: str = "fp32"
    stale: int = 0
    sigma: float = 0.0


def parse_mismatch(text: str) -> Mismatch:
    """A mismatch (the module's grammar) -> its ``Mismatch``; anything else: a SystemExit naming the allowed forms."""
    if text == NO_MISMATCH:
        return Mismatch()
    fields: dict = {}
    for i, term in enumerate(text.split("+")):
        if term in DTYPES and i == 0:
            key, value = "dtype", term
        elif term.startswith(STALE):
            k = term.removeprefix(STALE)
            key, value = "stale", int(k) if k.isdigit() and int(k) >= 1 else None
        else:
            try:
                value = float(term.removeprefix(NOISE))
            except ValueError:
                value = None
            key, value = "sigma", value if value is not None and math.isfinite(value) and value >= 0 else None
        if value is None or key in fields:
            raise SystemExit(f"--mismatch {text!r}: allowed {ALLOWED}")
        fields[key] = value
    return Mismatch(**fields)


@dataclass(frozen=True)
class Cell:
    length: int
    mismatch: str
    updates: int
    lr: float | None = None  # None: the study's learning rate
    unit: int = UNIT_MEDIAN  # the speech-like task's median unit length

    @property
    def label(self) -> str:
        return (
            f"L{self.length}/{self.mismatch}/U{self.updates}"
            + (f"/lr{self.lr:g}" if self.lr is not None else "")
            + (f"/u{self.unit}" if self.unit != UNIT_MEDIAN else "")
        )

    @property
    def rollout(self) -> Mismatch:
        return parse_mismatch(self.mismatch)

    def reference(self) -> Cell:
        """The same cell without mismatch."""
        return replace(self, mismatch=NO_MISMATCH)


def parse_cell(text: str) -> Cell:
    """A cell (the module's grammar) -> its ``Cell``, the mismatch checked."""
    m = re.fullmatch(r"L(\d+)/([^/]+)/U(\d+)(?:/lr([0-9.e-]+))?(?:/u(\d+))?", text) or re.fullmatch(
        r"(\d+)/([^/]+)/(\d+)()()", text
    )
    if not m:
        raise SystemExit(
            f"--cells {text!r}: L<tokens>/<mismatch>/U<updates>[/lr<lr>][/u<unit>] (e.g. L96/stale2/U4/lr1/u24) or "
            "LENGTH/MISMATCH/UPDATES (e.g. 96/0.2/1)"
        )
    parse_mismatch(m.group(2))
    lr, unit = m.group(4), m.group(5)
    return Cell(
        int(m.group(1)), m.group(2), int(m.group(3)), float(lr) if lr else None, int(unit) if unit else UNIT_MEDIAN
    )
