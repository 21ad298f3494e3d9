"""Field validators shared by the loss config and the recipes' settings (no verl, no torch).

Each raises ``FieldError`` (a ``ValueError``) "<field path>=<value> is invalid: allowed <what>"; a
bare field name is prefixed with ``policy_loss.``, a dotted path is used as it is.
"""

from __future__ import annotations

import difflib
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
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


def close_names(name: str, allowed) -> list[str]:
    """The allowed names closest to a misspelt ``name``: difflib's matches (similarity >= 0.6) within 0.1
    of the best one, at most three, best first."""
    scored = []
    for a in dict.fromkeys(str(a) for a in allowed):
        score = difflib.SequenceMatcher(None, str(name), a).ratio()
        if score >= 0.6:
            scored.append((score, a))
    scored.sort(key=lambda sa: -sa[0])
    return [a for score, a in scored[:3] if score >= scored[0][0] - 0.1]


def wrap_names(names, indent: str = "  ", width: int = 100) -> str:
    """``names`` comma-separated, wrapped to ``width`` columns, each line indented."""
    return textwrap.fill(", ".join(str(n) for n in names), width=width, initial_indent=indent, subsequent_indent=indent)


def unknown_message(section: str, unknown, allowed, kind: str = "keys") -> str:
    """ "<section> has unknown <kind> [...]", a "did you mean" for each misspelt one with close names,
    then the allowed names, wrapped."""
    allowed, unknown = list(allowed), sorted(unknown)
    hints = [did_you_mean(name, allowed, len(unknown) > 1) for name in unknown]
    head = f"{section} has unknown {kind} {unknown}" + "".join(f": {h}" for h in hints if h)
    return f"{head}\nallowed {kind}:\n{wrap_names(allowed)}"


def did_you_mean(name: str, allowed, named: bool = False) -> str:
    """ "did you mean `a` or `b`?" (the closest allowed names), or "" when none is close."""
    close = close_names(name, allowed)
    if not close:
        return ""
    return (f"{name}: " if named else "") + f"did you mean {' or '.join(f'`{c}`' for c in close)}?"


def reject_unknown(section: str, given, allowed, error: type[Exception] = ValueError, kind: str = "keys") -> None:
    """Raise ``error`` naming the keys of ``given`` not in ``allowed`` (``kind``: what they are called),
    the closest allowed names of each, and the allowed ones (``unknown_message``)."""
    allowed = list(allowed)
    unknown = set(given) - set(allowed)
    if unknown:
        raise error(unknown_message(section, unknown, allowed, kind))


def check_choice(name: str, value: Any, choices: tuple[str, ...] | list[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        fail(name, value, "one of " + ", ".join(choices))


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    Int(minimum, maximum).check(name, value)


def check_float(name: str, value: Any, lo: float, hi: float = math.inf, lo_open: bool = False) -> None:
    Float(lo, hi, lo_open).check(name, value)


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        fail(name, value, "true or false")


def root_cause(error: BaseException) -> BaseException:
    """The error a user can act on: the first ``FieldError`` in ``error``'s chain of causes, else the
    cause under Hydra's ``InstantiationException`` wrappers, else ``error``."""
    seen, chain, current = set(), [], error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    found = next((e for e in chain if isinstance(e, FieldError)), None)
    if found is not None:
        return found
    while type(error).__name__ == "InstantiationException" and error.__cause__ is not None:
        error = error.__cause__
    return error


# ---- declared settings ---------------------------------------------------------------------------------------------
# A setting of the policy-loss config is declared once (``Setting``): its name, default, allowed values and a
# one-line description. ``maspo_verl.config`` builds the dataclass field, its check, the Hydra defaults and the
# docs table from the declarations; the allowed values are one of the kinds below, each a check and its wording.


class Allowed:
    """What values a setting allows: ``check(path, value)`` returns the value (normalised) or raises ``FieldError``;
    ``text`` says what is allowed, as the error and the docs table put it; ``type`` is the field's annotation."""

    type: Any = Any
    text: str = ""

    def check(self, path: str, value: Any) -> Any:
        raise NotImplementedError


class Int(Allowed):
    type = int

    def __init__(self, minimum: int, maximum: int | None = None):
        self.minimum, self.maximum = minimum, maximum
        self.text = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")

    def check(self, path, value):
        ok = not isinstance(value, bool) and isinstance(value, int) and value >= self.minimum
        if not ok or (self.maximum is not None and value > self.maximum):
            fail(path, value, self.text)
        return value


class Float(Allowed):
    type = float

    def __init__(self, lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False):
        self.lo, self.hi, self.lo_open = lo, hi, lo_open
        bound = "" if lo == -math.inf else f" {'>' if lo_open else '>='} {lo}"
        if hi != math.inf:
            bound += (" and" if bound else "") + f" <= {hi}"
        self.text = "a finite number" + bound

    def check(self, path, value):
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not (ok and (value > self.lo if self.lo_open else value >= self.lo) and value <= self.hi):
            fail(path, value, self.text)
        return value


class Bool(Allowed):
    type = bool
    text = "true or false"

    def check(self, path, value):
        check_bool(path, value)
        return value


class Choice(Allowed):
    """One of ``choices`` (a tuple, or a function giving it when it is asked: a registry's names)."""

    type = str

    def __init__(self, choices):
        self._choices = choices

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(self._choices() if callable(self._choices) else self._choices)

    @property
    def text(self) -> str:
        return "one of " + ", ".join(self.choices)

    def check(self, path, value):
        check_choice(path, value, self.choices)
        return value


class Strings(Allowed):
    type = list[str]
    text = "a list of non-empty strings"

    def check(self, path, value):
        ok = isinstance(value, Sequence) and not isinstance(value, str | bytes)
        if not ok or not all(isinstance(s, str) and s for s in value):
            fail(path, value, self.text)
        return list(value)


class Ints(Allowed):
    type = list[int]

    def __init__(self, minimum: int):
        self.minimum = minimum
        self.text = f"a non-empty list of integers >= {minimum}"

    def check(self, path, value):
        ok = isinstance(value, Sequence) and not isinstance(value, str | bytes) and len(value) > 0
        if not ok or any(isinstance(v, bool) or not isinstance(v, int) or v < self.minimum for v in value):
            fail(path, value, self.text)
        return list(value)


class OptionalPath(Allowed):
    type = str | None
    text = "null (off) or a folder path"

    def check(self, path, value):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            fail(path, value, self.text)
        return value


@dataclass(frozen=True)
class Setting:
    """One policy-loss field: its name, default, allowed values (``Allowed``) and what it does (one line)."""

    name: str
    default: Any
    allowed: Allowed
    doc: str

    def check(self, value: Any) -> Any:
        return self.allowed.check(self.name, value)
