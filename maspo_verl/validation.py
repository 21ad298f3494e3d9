"""Field validators shared by the loss config and the recipes' settings (no verl, no torch).

Each raises ``FieldError`` (a ``ValueError``) "<field path>=<value> is invalid: allowed <what>"; a
bare field name is prefixed with ``policy_loss.``, a dotted path is used as it is.
"""

from __future__ import annotations

import math
from typing import Any


class FieldError(ValueError):
    """A setting is invalid; ``field`` is its full path. Survives pickling (raised in a Ray worker)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):
        return type(self), (self.field, str(self))


def fail(name: str, value: Any, allowed: str) -> None:
    """Raise the project's field error: the field's path, its value and what is allowed."""
    path = name if "." in name else "policy_loss." + name
    raise FieldError(path, f"{path}={value!r} is invalid: allowed {allowed}")


def reject_unknown(section: str, given, allowed, error: type[Exception] = ValueError, kind: str = "keys") -> None:
    """Raise ``error`` naming the keys of ``given`` not in ``allowed`` (``kind``: what they are called),
    and the allowed ones."""
    allowed = list(allowed)
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise error(f"{section} has unknown {kind} {unknown}: allowed {', '.join(allowed)}")


def check_choice(name: str, value: Any, choices: tuple[str, ...] | list[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        fail(name, value, "one of " + ", ".join(choices))


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int) and value >= minimum
    if not ok or (maximum is not None and value > maximum):
        fail(name, value, f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else ""))


def check_float(name: str, value: Any, lo: float, hi: float = math.inf, lo_open: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        bound = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi != math.inf else "")
        fail(name, value, f"a finite number {bound}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        fail(name, value, "true or false")
