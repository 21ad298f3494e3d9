"""The generated reference: the parts of ``hydra_configs/maspo_base.yaml``, ``maspo_verl/config_fields.py``,
``docs/configuration.md`` and ``README.md`` made from the declared settings (``maspo_verl.config.SETTINGS``), the
segment rules (``maspo_verl.core.segments.SEGMENT_RULES``) and the loss presets (``hydra_configs/loss/``), and
``docs/choosing.md`` from the committed result tables (``maspo_verl.choosing``). ``python -m maspo_verl generate``
rewrites them; ``--check`` (and ``tests/test_reference.py``) fails when a file is out of date.

Each generated part stands between two marker lines and is replaced whole; the rest of each file is written by hand.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from maspo_verl import choosing
from maspo_verl.config import SETTINGS
from maspo_verl.core.segments import SEGMENT_RULES, compute
from maspo_verl.core.surrogates import SURROGATES
from maspo_verl.core.token_sets import TOKEN_SETS
from maspo_verl.util import config_dir, preset_names

COMMAND = "python -m maspo_verl generate"
ACTOR = "actor_rollout_ref.actor"
# verl's own fields the table documents too: (field, key under the actor, what, allowed)
VERL_FIELDS = (
    (
        "`loss_mode`",
        "policy_loss.loss_mode",
        "which loss (`maspo`, `ctpo`, `pgspo` are ours)",
        "a loss registered in verl",
    ),
    ("`loss_agg_mode` (actor)", "loss_agg_mode", "verl's aggregation", "verl's: token-mean, seq-mean-token-mean, ..."),
    (
        "`clip_ratio_low` (actor)",
        "clip_ratio_low",
        "ratio-space clip, lower (`clip_schedule=ratio`); `dppo_tv`/`dppo_kl`: the divergence bound where the "
        "probability fell",
        "verl's; > 0 with `dppo_*`",
    ),
    (
        "`clip_ratio_high` (actor)",
        "clip_ratio_high",
        "ratio-space clip, upper (`clip_schedule=ratio`); `dppo_tv`/`dppo_kl`: the divergence bound where it rose",
        "verl's; > 0 with `dppo_*`",
    ),
    (
        "`clip_ratio_c` (actor)",
        "clip_ratio_c",
        "dual clip (`clip_schedule=ratio`); `tis`, `dppo_*`: the weight's truncation",
        "verl's; > 0 with `dppo_*`",
    ),
    ("`dro_beta`", "policy_loss.dro_beta", "DRO's penalty weight β (`surrogate=dro`, required there)", "> 0"),
    ("`tau_pos` (actor)", "tau_pos", "SAPO's gate temperature for A > 0 (`surrogate=sapo`)", "> 0"),
    ("`tau_neg` (actor)", "tau_neg", "SAPO's gate temperature for A ≤ 0 (`surrogate=sapo`)", "> 0"),
)


def compose_config(*overrides: str, config_name: str = "maspo_trainer"):
    """Our trainer config (``hydra_configs/``) with Hydra overrides, as the CLI composes it: a copy of the one
    composed for the same arguments and config files in this process (composing takes about a second; a copy, a
    twentieth)."""
    stats = [(str(p), p.stat()) for p in sorted(config_dir().rglob("*.yaml"))]
    files = tuple((name, st.st_mtime_ns, st.st_size) for name, st in stats)
    return copy.deepcopy(_composed(config_name, overrides, files))


@functools.cache
def _composed(config_name: str, overrides: tuple[str, ...], files: tuple) -> Any:
    """``files``: the config files' paths, times and sizes, so that an edited file is composed again."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def _owner(name: str) -> str:
    if any(s.name == name for s in compute.SETTINGS):
        return "segmentation"
    for kind, members in (("rule", SEGMENT_RULES), ("loss", TOKEN_SETS), ("surrogate", SURROGATES)):
        for member in members.values():
            if any(s.name == name for s in member.settings):
                return f"{kind} `{member.name}`"
    return "loss"


def _value(value: Any) -> str:
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if isinstance(value, list) and len(value) > 1 and all(v == value[0] for v in value):
        return f"[{json.dumps(value[0])}]*{len(value)}"
    return json.dumps(value, ensure_ascii=False).replace("|", "\\|")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _yaml_value(value: Any) -> str:
    """A YAML flow value (JSON is YAML: strings double-quoted with escapes, lists in brackets, null)."""
    return json.dumps(value, ensure_ascii=False)


def base_yaml_fields() -> list[str]:
    """The ``policy_loss`` fields of ``maspo_base.yaml``: every declared setting at its default, by owner."""
    lines, owner = [], None
    for s in SETTINGS:
        if _owner(s.name) != owner:
            owner = _owner(s.name)
            lines.append(f"# {owner}")
        lines.append(f"{s.name}: {_yaml_value(s.default)}  # {s.doc}")
    return ["      " + line for line in lines]


def _presets() -> dict[str, tuple[Any, Any]]:
    """preset -> (its own YAML, the config it composes to); a preset that sets no loss is refused."""
    presets = {}
    for name in preset_names():
        own = OmegaConf.load(config_dir() / "loss" / f"{name}.yaml")
        if OmegaConf.select(own, f"{ACTOR}.policy_loss.loss_mode", default=None) is None:
            raise ValueError(
                f"hydra_configs/loss/{name}.yaml sets no {ACTOR}.policy_loss.loss_mode: a preset starts with "
                "'# @package _global_' and nests its fields under actor_rollout_ref.actor.policy_loss, as the others"
            )
        presets[name] = (own, compose_config(f"loss={name}"))
    return presets


def _in_presets(key: str, presets: dict) -> str:
    groups: dict[str, list[str]] = {}
    for name, (own, composed) in presets.items():
        if OmegaConf.select(own, f"{ACTOR}.{key}", default=None) is not None:
            groups.setdefault(_value(OmegaConf.select(composed, f"{ACTOR}.{key}")), []).append(name)
    return "; ".join(f"{', '.join(names)}: {value}" for value, names in groups.items()) or "–"


def fields_table(presets: dict) -> list[str]:
    """The field table (docs/configuration.md): verl's fields the losses read, then every declared setting."""
    bare = compose_config("~loss")
    rows = ["| field | of | what | default | in the presets | allowed |", "|---|---|---|---|---|---|"]
    for cell, key, what, allowed in VERL_FIELDS:
        default = _value(OmegaConf.select(bare, f"{ACTOR}.{key}"))
        rows.append(f"| {cell} | verl | {what} | {default} | {_in_presets(key, presets)} | {allowed} |")
    for s in SETTINGS:
        key = f"policy_loss.{s.name}"
        rows.append(
            f"| `{s.name}` | {_owner(s.name)} | {_cell(s.doc)} | {_value(s.default)} | {_in_presets(key, presets)} "
            f"| {_cell(s.allowed.text)} |"
        )
    return rows


def rules_table() -> list[str]:
    """The table of segment rules (docs/configuration.md), from their declarations."""
    names = {"old_log_prob": "old log-probs", "response_ids": "response ids", "word_ids": "word ids"}
    rows = ["| `segment_rule` | what | settings | reads | limits | worked examples |", "|---|---|---|---|---|---|"]
    for rule in SEGMENT_RULES.values():
        settings = ", ".join(f"`{s.name}`" for s in rule.settings) or "–"
        reads = ", ".join(names.get(n, n) for n in sorted(rule.needs)) or "the mask"
        limits = "; ".join(
            f"{limit}: " + ", ".join(f"{k}={_value(v)}" for k, v in values.items())
            for limit, values in rule.limits.items()
        )
        examples = len(rule.examples)
        rows.append(
            f"| `{rule.name}` | {_cell(rule.summary())} | {settings} | {reads} | {limits or '–'} | {examples} |"
        )
    return rows


def _first_sentence(path: Path) -> str:
    """The first sentence of a YAML file's leading comment (after the ``@package`` line)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if "@package" not in line:
            lines.append(line.lstrip("#").strip())
    text = " ".join(lines).split(". ", 1)[0].rstrip(".")
    return text + "." if text else "–"


def presets_table(presets: dict) -> list[str]:
    """The presets table (docs/configuration.md): each one's loss, rule and the first sentence of its comment."""
    rows = ["| `loss=` | `loss_mode` | `segment_rule` | what |", "|---|---|---|---|"]
    for name, (_, composed) in presets.items():
        policy_loss = OmegaConf.select(composed, f"{ACTOR}.policy_loss")
        rule = policy_loss.segment_rule if policy_loss.loss_mode == "maspo" else "–"
        what = _first_sentence(config_dir() / "loss" / f"{name}.yaml")
        rows.append(
            f"| `{name}` | `{policy_loss.loss_mode}` | {rule if rule == '–' else f'`{rule}`'} | {_cell(what)} |"
        )
    return rows


def _replace(text: str, begin: str, end: str, lines: list[str], where: str) -> str:
    """``text`` with the lines between the marker lines ``begin`` and ``end`` replaced by ``lines``."""
    rows = text.split("\n")
    starts = [i for i, row in enumerate(rows) if row.strip() == begin]
    ends = [i for i, row in enumerate(rows) if row.strip() == end]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"{where}: expected one line {begin!r} and, after it, one line {end!r}")
    return "\n".join(rows[: starts[0] + 1] + lines + rows[ends[0] :])


def _readme_part(name: str) -> tuple[str, str]:
    return f"<!-- generated: {name} ({COMMAND}) -->", f"<!-- end of generated: {name} -->"


FIELDS_MARKERS = (
    f"# generated ({COMMAND}): one annotation per declared setting",
    "# end of generated fields",
)


def _type_name(kind: Any) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind)


def field_annotations() -> list[str]:
    """``maspo_verl/config_fields.py``'s body: each declared setting's name and type."""
    return [f"    {s.name}: {_type_name(s.allowed.type)}" for s in SETTINGS]


YAML_MARKERS = (
    f"# generated ({COMMAND}): every declared setting at its default, so each is settable from the CLI",
    "# end of generated settings",
)


GRANULARITY = {"vanilla": "token", "gspo": "response", "pgspo": "response", "ctpo": "prefix"}


def presets_short(presets: dict) -> list[str]:
    """The README's short list of loss presets: who shares a ratio (the full table: docs/configuration.md)."""
    rows = ["| `loss=` | one ratio per | `loss_mode` |", "|---|---|---|"]
    for name, (_, composed) in presets.items():
        policy_loss = OmegaConf.select(composed, f"{ACTOR}.policy_loss")
        mode = policy_loss.loss_mode
        shared = f"segment (`{policy_loss.segment_rule}`)" if mode == "maspo" else GRANULARITY.get(mode, "–")
        if policy_loss.get("surrogate", "ppo") != "ppo":
            shared += f", surrogate `{policy_loss.surrogate}`"
        rows.append(f"| `{name}` | {shared} | `{mode}` |")
    return rows


def lab_commands() -> dict[str, tuple[str, str]]:
    """command -> (what it measures, its results folder) of each lab study that declares a command (``STUDY`` in
    maspo_verl/lab/studies/, ``maspo_verl.lab.engine.study``), read from the source: the lab is not imported."""
    found = {}
    for path in sorted((Path(__file__).parent / "lab" / "studies").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["STUDY"]:
                command, summary = (ast.literal_eval(a) for a in node.value.args[:2])
                folder = next((ast.literal_eval(k.value) for k in node.value.keywords if k.arg == "folder"), command)
                if command:
                    found[command] = (summary, folder)
    return found


def lab_table(root: Path) -> list[str]:
    """docs/lab.md's table of the lab's commands, with the committed results folder of each that has one."""
    rows = ["| command | what it measures | committed results |", "|---|---|---|"]
    for command, (summary, folder) in lab_commands().items():
        results = f"[`{folder}/`](results/{folder}/)" if (root / "docs" / "results" / folder).is_dir() else "–"
        rows.append(f"| `python -m maspo_verl.lab {command}` | {_cell(summary)} | {results} |")
    return rows


def generated(root: Path) -> dict[Path, Callable[[str], str]]:
    """file -> the function that makes its generated text from its current text."""
    presets = _presets()
    docs = {"fields": fields_table(presets), "rules": rules_table(), "presets": presets_table(presets)}
    readme = {"presets_short": presets_short(presets)}
    if (root / choosing.GRID_CSV).is_file():  # the README's "Which loss", from the committed result tables
        readme = {"which_loss": choosing.which_loss(root)} | readme

    def parts(where: str, named: dict[str, list[str]]) -> Callable[[str], str]:
        def make(text: str) -> str:
            for name, lines in named.items():
                text = _replace(text, *_readme_part(name), lines, where)
            return text

        return make

    yaml_lines = base_yaml_fields()
    annotations = field_annotations()
    files = {
        Path(__file__).parent / "config_fields.py": lambda text: _replace(
            text, *FIELDS_MARKERS, annotations, "config_fields.py"
        ),
        root / "README.md": parts("README.md", readme),
        root / "docs" / "configuration.md": parts("docs/configuration.md", docs),
        root / "docs" / "lab.md": parts("docs/lab.md", {"lab_commands": lab_table(root)}),
        config_dir() / "maspo_base.yaml": lambda text: _replace(text, *YAML_MARKERS, yaml_lines, "maspo_base.yaml"),
    }
    if (root / choosing.GRID_CSV).is_file():  # a checkout with the committed results: the guide from their tables
        files[root / choosing.PAGE] = lambda text: choosing.render(root)
    return files


def stale(root: Path) -> list[Path]:
    """The files whose generated parts are out of date."""
    return [path for path, make in generated(root).items() if make(_text(path)) != _text(path)]


def _text(path: Path) -> str:
    """A file's text; a generated page not written yet is empty."""
    return path.read_text() if path.is_file() else ""


def write(root: Path) -> list[Path]:
    """Rewrite the generated parts; returns the files that changed."""
    changed = []
    for path, make in generated(root).items():
        text = _text(path)
        new = make(text)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed
