"""Which segment rules exist: every ``SegmentRule`` defined in a module of ``maspo_verl/core/segments/rules/``
(discovered on import, in module-name order), and which of them a policy-loss config runs."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

from maspo_verl.core.segments.rule import LIMITS, TOKENIZER, Example, SegmentRule
from maspo_verl.validation import fail

SEGMENT_RULES: dict[str, SegmentRule] = {}


def register_segment_rule(cls: type[SegmentRule]) -> type[SegmentRule]:
    """Make ``cls`` selectable as ``policy_loss.segment_rule=<cls.name>`` (rule modules are registered by
    discovery; this is for rules defined elsewhere, e.g. in a test). Refuses a declaration that clashes."""
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name:
        raise TypeError(f"segment rule {cls.__qualname__} declares no name")
    if name in SEGMENT_RULES:
        raise ValueError(
            f"segment rule {name!r} is defined twice: {cls.__module__} and {SEGMENT_RULES[name].__module__}"
        )
    taken = {s.name: other for other in SEGMENT_RULES.values() for s in other.settings}
    for s in cls.settings:
        if s.name in taken:
            raise ValueError(
                f"segment rule {name!r} declares policy_loss.{s.name}, which rule {taken[s.name].name!r} owns"
            )
    declared = {s.name for s in cls.settings}
    for limit, values in cls.limits.items():
        if limit not in LIMITS:
            raise ValueError(f"segment rule {name!r}: limit {limit!r} is none of {', '.join(LIMITS)}")
        if cls.fallback_field is None and not set(values) <= declared:
            raise ValueError(f"segment rule {name!r}: limit {limit!r} sets fields it does not declare")
    for index, example in enumerate(cls.examples):
        check_example(name, index, example)
    SEGMENT_RULES[name] = cls()
    return cls


def check_example(rule: str, index: int, example: Example) -> None:
    """Refuse a worked example whose shapes do not fit (``ValueError`` naming the rule and the example): a ragged
    or non-0/1 mask, lengths that do not add up to each row's valid tokens, an input row not shaped like the mask."""

    def refuse(problem: str) -> None:
        raise ValueError(f"segment rule {rule!r}, example {index} ({example.why!r}): {problem}")

    rows = [tuple(row) for row in example.mask]
    if not rows or len({len(row) for row in rows}) != 1:
        refuse(f"mask rows must all have one length, got lengths {[len(row) for row in rows]}")
    if any(v not in (0, 1) for row in rows for v in row):
        refuse("mask values must be 0 or 1")
    if len(example.lengths) != len(rows):
        refuse(f"{len(example.lengths)} rows of lengths for {len(rows)} mask rows")
    for r, (row, lengths) in enumerate(zip(rows, example.lengths, strict=True)):
        if any(n < 1 for n in lengths) or sum(lengths) != sum(row):
            refuse(f"row {r}: segment lengths {tuple(lengths)} must be >= 1 and add up to its {sum(row)} valid tokens")
    for name, values in example.inputs.items():
        if name == TOKENIZER:
            continue
        shape = [len(row) for row in values]
        if len(values) != len(rows) or any(n != len(rows[0]) for n in shape):
            refuse(f"inputs[{name!r}] has rows of lengths {shape}; the mask has {len(rows)} rows of {len(rows[0])}")


def discover() -> None:
    """Register the rules of every module in ``maspo_verl/core/segments/rules/`` (once; import errors propagate)."""
    from maspo_verl.core.segments import rules

    for info in sorted(pkgutil.iter_modules(rules.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{rules.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, SegmentRule) and cls.__module__ == module.__name__ and "name" in cls.__dict__:
                if cls.name not in SEGMENT_RULES:
                    register_segment_rule(cls)


def fallback_rules() -> tuple[str, ...]:
    """The rules that may serve as another's fallback: those with no fallback of their own."""
    return tuple(name for name, rule in SEGMENT_RULES.items() if rule.fallback_field is None)


def setting(config: Any, name: str, default: Any = None) -> Any:
    """A policy-loss setting of a config object or a (Dict)Config mapping."""
    return config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)


def configured_rule(config: Any) -> SegmentRule:
    """The rule ``policy_loss.segment_rule`` names (``FieldError`` with the allowed ones otherwise)."""
    name = setting(config, "segment_rule")
    rule = SEGMENT_RULES.get(name)
    if rule is None:
        fail("segment_rule", name, "one of " + ", ".join(SEGMENT_RULES))
    return rule


def rules_in_use(config: Any) -> tuple[SegmentRule, ...]:
    """The rules a segmentation with ``config`` runs: ``segment_rule`` and its fallback, if it has one."""
    rule = configured_rule(config)
    if rule.fallback_field is None:
        return (rule,)
    name = setting(config, rule.fallback_field)
    fallback = SEGMENT_RULES.get(name)
    if fallback is None or fallback.fallback_field is not None:
        fail(rule.fallback_field, name, "one of " + ", ".join(fallback_rules()))
    return (rule, fallback)
