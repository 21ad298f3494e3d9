"""The README's loss-field table, filled in from the composed configs: ``python -m tests.docs_table``
rewrites it in README.md, ``tests/test_docs.py`` fails when it is out of date.

The README keeps the hand-written parts of each row (the fields it covers, what is allowed); the
`default` column is the value with no loss preset (``~loss``: the dataclass defaults and verl's), the
`in the presets` column every preset of ``hydra_configs/loss/`` that sets one of the row's fields, with
the value it composes to. A field cell names one or more fields: ``a``, ``a`, `b``, or ``a_x/y/z``
(``a_x``, ``a_y``, ``a_z``); `(actor)` marks fields of ``actor_rollout_ref.actor`` itself (verl's),
the others are ``actor_rollout_ref.actor.policy_loss`` fields.
"""

from __future__ import annotations

import re
import sys
from dataclasses import fields
from pathlib import Path

from omegaconf import OmegaConf

from maspo_verl.util import config_dir, preset_names
from tests.helpers import compose_config

README = Path(__file__).resolve().parent.parent / "README.md"
HEADER = "| field | default | in the presets | allowed |"
ACTOR = "actor_rollout_ref.actor"


def row_fields(cell: str) -> tuple[list[str], str]:
    """The config keys a field cell names (under ``actor_rollout_ref.actor``) and the separator of its values."""
    prefix = "" if "(actor)" in cell else "policy_loss."
    keys = []
    for name in re.findall(r"`([^`]+)`", cell):
        first, *more = name.split("/")
        keys += [prefix + first] + [prefix + first.rsplit("_", 1)[0] + "_" + part for part in more]
    return keys, " / " if "/" in cell else ", "


def fmt(value) -> str:
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, list) and value and all(v == value[0] for v in value):
        return f"[{value[0]}]*{len(value)}"
    return str(value)


def _select(cfg, key: str):
    return OmegaConf.select(cfg, f"{ACTOR}.{key}", default=None)


def columns(keys: list[str], sep: str, default_cfg, presets: dict) -> tuple[str, str]:
    """(default, in the presets) for a row."""
    default = sep.join(fmt(_select(default_cfg, k)) for k in keys)
    groups: dict[str, list[str]] = {}
    for name, (own, composed) in presets.items():
        if any(_select(own, k) is not None for k in keys):
            groups.setdefault(sep.join(fmt(_select(composed, k)) for k in keys), []).append(name)
    return default, "; ".join(f"{', '.join(names)}: {value}" for value, names in groups.items()) or "–"


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip()[1:-1].split("|")]


def render(table: list[str]) -> list[str]:
    """The table's lines with the `default` and `in the presets` columns recomputed."""
    assert table[0] == HEADER, table[0]
    default_cfg = compose_config("~loss")
    presets = {
        name: (OmegaConf.load(config_dir() / "loss" / f"{name}.yaml"), compose_config(f"loss={name}"))
        for name in preset_names()
    }
    out = table[:2]
    for line in table[2:]:
        cell, _, _, allowed = cells(line)
        keys, sep = row_fields(cell)
        default, in_presets = columns(keys, sep, default_cfg, presets)
        out.append(f"| {cell} | {default} | {in_presets} | {allowed} |")
    return out


def table_span(lines: list[str]) -> tuple[int, int]:
    start = lines.index(HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return start, end


def documented_fields(table: list[str]) -> set[str]:
    """The policy_loss fields the table rows name."""
    keys = {k for line in table[2:] for k in row_fields(cells(line)[0])[0]}
    return {k.removeprefix("policy_loss.") for k in keys if k.startswith("policy_loss.")}


def policy_loss_fields() -> set[str]:
    """Our fields of the policy-loss dataclass (verl's own ones aside), and `loss_mode`."""
    from verl.workers.config import PolicyLossConfig

    from maspo_verl.config import GranularLossConfig

    return {f.name for f in fields(GranularLossConfig)} - {f.name for f in fields(PolicyLossConfig)} | {"loss_mode"}


def updated(text: str) -> str:
    lines = text.split("\n")
    start, end = table_span(lines)
    return "\n".join(lines[:start] + render(lines[start:end]) + lines[end:])


if __name__ == "__main__":
    text = README.read_text()
    new = updated(text)
    if new != text:
        README.write_text(new)
    print("README.md field table:", "updated" if new != text else "up to date", file=sys.stderr)
