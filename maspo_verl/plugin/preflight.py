"""The driver's preflight: what the config names on this machine, checked before Ray starts.

``preflight(config, local)`` looks at every path the run will open and at the GPUs it asks for:

- the model (``actor_rollout_ref.model.path``, ``.tokenizer_path``, an enabled reward model's
  ``model_path``) is a folder with a ``config.json``; a name that is not a local path but has the form
  ``org/name`` is taken as a Hugging Face Hub id (said in one line): with ``HF_HUB_OFFLINE=1`` it must be
  in the local cache, else the Hub must answer within seconds (``maspo_verl.util.hub_unreachable``; the
  Hub clients would retry for a minute); a URI (``hdfs://...``) is left to verl;
- ``data.train_files`` / ``data.val_files`` exist, are ``.parquet`` / ``.json`` / ``.jsonl`` (what verl's
  dataset reads) and hold the column ``data.prompt_key`` (a parquet's schema only is read);
- the custom reward function (``reward.custom_reward_function``, or verl's legacy top-level
  ``custom_reward_function``) is a file (or ``pkg://`` module) that defines the function named;
- without ``local=cpu`` and without a Ray cluster to join, ``trainer.n_gpus_per_node`` GPUs are here
  (a dry run checks the config, not the node it runs on: there, GPUs missing are a note).

Each problem is a ``FieldError`` naming the field, the value and what to change; the first one is
raised, every one listed. ``maspo.preflight``: ``refuse`` (default, the dry run too), ``warn`` (print the
problems and go on: a config checked on another machine than the run's, as the recipes' ``DRY_RUN=1``),
``off``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass, field

from maspo_verl.util import hub_offline, hub_unreachable
from maspo_verl.validation import FieldError, check_choice

MODES = ("refuse", "warn", "off")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
URI = re.compile(r"^[a-z][a-z0-9+.-]*://")
DATA_SUFFIXES = (".parquet", ".json", ".jsonl")
PKG = "pkg://"


@dataclass
class Report:
    problems: list[tuple[str, str]] = field(default_factory=list)  # (field, message)
    notes: list[str] = field(default_factory=list)

    def problem(self, name: str, value, message: str) -> None:
        self.problems.append((name, f"{name}={value!s}: {message}"))


def _unset(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip() in ("", "null", "None"))


def _paths(value) -> list[str]:
    """A data-files setting as a list of strings (one path, or a list of them)."""
    if _unset(value):
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _hub_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def check_model(r: Report, name: str, value) -> None:
    """A model folder with its config.json, a Hub id, or a URI verl copies itself."""
    path = str(value)
    local = os.path.expanduser(path)
    if URI.match(path):
        return
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            r.problem(name, path, "is a folder without config.json: point it at a Hugging Face model folder")
        return
    if os.path.exists(local):
        r.problem(name, path, "is a file, not a model folder (a folder with config.json)")
        return
    first = path.split("/", 1)[0]
    if HUB_ID.fullmatch(path) and not os.path.isdir(first):
        download = f"download it where the Hub is reachable (huggingface-cli download {path} --local-dir DIR)"
        if hub_offline():
            if not _hub_cached(path):
                r.problem(
                    name, path, "is a Hub id that is not in the local Hugging Face cache, and HF_HUB_OFFLINE is set: "
                    f"{download} and give that folder"
                )  # fmt: skip
            return
        unreachable = hub_unreachable()
        if unreachable and _hub_cached(path):
            r.problem(name, path, f"is a Hub id in the local cache, but {unreachable}: set HF_HUB_OFFLINE=1")
        elif unreachable:
            r.problem(name, path, f"is a Hub id, but {unreachable}: {download} and give that folder")
        else:
            r.notes.append(f"{name}={path}: no such folder here, a Hugging Face Hub id (downloaded on first use)")
        return
    r.problem(name, path, "no such folder: set it to a local model folder (with config.json) or a Hub id (org/name)")


def _columns(path: str) -> list[str] | None:
    """The column names of a data file (None: not known without reading it all)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            line = f.readline()
        return list(json.loads(line)) if line.strip() else []
    return None


def check_data(r: Report, name: str, value, prompt_key: str, custom_dataset: bool) -> None:
    for path in _paths(value):
        local = os.path.expanduser(path)
        if URI.match(path):
            continue
        if not os.path.isfile(local):
            what = "is a folder" if os.path.isdir(local) else "no such file"
            r.problem(name, path, f"{what}: set it to a data file (.parquet, e.g. python -m maspo_verl.math.prepare)")
            continue
        if custom_dataset:
            continue  # a data.custom_cls dataset reads its files its own way
        if not path.endswith(DATA_SUFFIXES):
            r.problem(name, path, f"verl's dataset reads {', '.join(DATA_SUFFIXES)} files only")
            continue
        try:
            columns = _columns(local)
        except Exception as exc:  # an unreadable file: the reason, not a traceback later in a worker
            r.problem(name, path, f"cannot be read ({type(exc).__name__}: {exc})")
            continue
        if columns is not None and prompt_key not in columns:
            r.problem(
                name, path, f"has no column data.prompt_key={prompt_key!r} (columns: {', '.join(columns)}): "
                "set data.prompt_key to the prompt column"
            )  # fmt: skip


def _defines(source: str, name: str) -> bool | None:
    """Whether the module source defines ``name`` at top level (None: cannot tell, a star import)."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return None
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return True
    return False


def check_function(r: Report, section: str, path, name) -> None:
    """A reward function file (or ``pkg://`` module) that defines ``name``."""
    if _unset(path):
        return
    path = str(path)
    if _unset(name):
        r.problem(f"{section}.name", name, f"{section}.path is set: name the function to call in it")
        return
    if path.startswith(PKG):
        module = path[len(PKG) :]
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            r.problem(f"{section}.path", path, f"no module {module!r} is importable here")
        elif not hasattr(importlib.import_module(module), str(name)):
            r.problem(f"{section}.name", name, f"{module} defines no {name!r}")
        return
    local = os.path.expanduser(path)
    if not os.path.isfile(local):
        r.problem(f"{section}.path", path, "no such file: set it to the Python file that defines the reward function")
        return
    try:
        defined = _defines(open(local, encoding="utf-8").read(), str(name))
    except SyntaxError as exc:
        r.problem(f"{section}.path", path, f"is not valid Python (line {exc.lineno}: {exc.msg})")
        return
    if defined is False:
        r.problem(f"{section}.name", name, f"{path} defines no function {name!r}: set {section}.name to one it defines")


def reward_function_section(config) -> tuple[str, object]:
    """verl's legacy top-level ``custom_reward_function`` wins when it sets anything (verl moves it under
    ``reward``), else ``reward.custom_reward_function``."""
    legacy = config.get("custom_reward_function", None) or {}
    if any(not _unset(v) for v in legacy.values()):
        return "custom_reward_function", legacy
    return "reward.custom_reward_function", (config.get("reward", {}) or {}).get("custom_reward_function", {}) or {}


def _cluster_to_join(config) -> str | None:
    """A Ray cluster the trainer's ``ray.init`` joins: an address set, or one ``ray start`` left on this node."""
    ray_init = (config.get("ray_kwargs", {}) or {}).get("ray_init", {}) or {}
    address = ray_init.get("address") or os.environ.get("RAY_ADDRESS")
    if not _unset(address) and str(address) != "local":
        return str(address)
    try:
        from ray._private.utils import read_ray_address

        return read_ray_address(ray_init.get("_temp_dir")) or None
    except Exception:  # no such Ray internal: nothing known
        return None


def check_gpus(r: Report, config, dry_run: bool = False) -> None:
    """A run on this node's own Ray needs its GPUs here; ``local=cpu`` is the CPU way. A dry run checks the
    config, not this node (a login node has no GPUs): there the GPUs missing are a note."""
    trainer = config.get("trainer", {}) or {}
    if str(trainer.get("device", "cuda")) != "cuda" or _cluster_to_join(config):
        return
    import torch

    wanted, here = int(trainer.get("n_gpus_per_node", 1)), torch.cuda.device_count()
    if wanted > here and dry_run:
        r.notes.append(
            f"trainer.n_gpus_per_node={wanted}: this machine has {here or 'no'} CUDA GPU{'s' * (here != 1)}; "
            "not checked in a dry run (the run needs them on its node, or a Ray cluster to join)"
        )
    elif wanted > here:
        fewer = f"set trainer.n_gpus_per_node<={here}, " if here else ""
        r.problem(
            "trainer.n_gpus_per_node", wanted, f"this node has {here or 'no'} CUDA GPU{'s' * (here != 1)} and no "
            f"Ray cluster to join: {fewer}add local=cpu for the CPU mode (a tiny model, a few steps), or join a "
            "Ray cluster with GPUs (RAY_ADDRESS)"
        )  # fmt: skip


def mode(config) -> str:
    value = (config.get("maspo", {}) or {}).get("preflight", "refuse")
    check_choice("maspo.preflight", value, MODES)
    return value


def collect(config, local: bool, dry_run: bool = False) -> Report:
    """Every problem and note of the config on this machine (paths left unset are the local mode's to fill)."""
    r = Report()
    if not local:  # first: without the GPUs nothing else matters on this node (a dry run: a note)
        check_gpus(r, config, dry_run)
    model = config.actor_rollout_ref.model
    for key in ("path", "tokenizer_path"):
        if not _unset(model.get(key)):
            check_model(r, f"actor_rollout_ref.model.{key}", model.get(key))
    reward = config.get("reward", {}) or {}
    reward_model = reward.get("reward_model", {}) or {}
    if reward_model.get("enable") and not _unset(reward_model.get("model_path")):
        check_model(r, "reward.reward_model.model_path", reward_model.get("model_path"))
    data = config.get("data", {}) or {}
    prompt_key = str(data.get("prompt_key", "prompt"))
    custom = not _unset((data.get("custom_cls", {}) or {}).get("path"))
    for key in ("train_files", "val_files"):
        check_data(r, f"data.{key}", data.get(key), prompt_key, custom)
    section, function = reward_function_section(config)
    check_function(r, section, function.get("path"), function.get("name"))
    return r


def preflight(config, local: bool) -> list[str]:
    """Check the config on this machine; returns the lines printed. Raises ``FieldError`` naming the first
    problem's field (every problem listed) unless ``maspo.preflight`` is ``warn`` or ``off``."""
    how = mode(config)
    if how == "off":
        return []
    r = collect(config, local, dry_run=bool((config.get("maspo", {}) or {}).get("dry_run")))
    lines = [f"maspo_verl preflight: {note}" for note in r.notes]
    if r.problems and how == "refuse":
        first, message = r.problems[0]
        more = "".join(f"\n- {m}" for _, m in r.problems[1:])
        raise FieldError(first, message + (f"\n{len(r.problems) - 1} more:{more}" if more else ""))
    lines += [f"{UNREFUSED} {m}" for _, m in r.problems]
    for line in lines:
        print(line, flush=True)
    return lines


UNREFUSED = "maspo_verl preflight (not refused, maspo.preflight=warn):"


def unrefused(lines: list[str]) -> int:
    """How many of ``preflight``'s lines are problems printed instead of refused."""
    return sum(line.startswith(UNREFUSED) for line in lines)
