"""Small helpers shared across layers (no verl, no torch): the config folder, verl's metrics file,
one-time warnings, parquet files."""

from __future__ import annotations

import importlib
import json
import logging
import os
import warnings
from pathlib import Path

_warned: set[str] = set()


def import_extra(module: str, requirement: str, extra: str, needed_by: str):
    """Import ``module`` of an optional dependency, or fail saying how to install it (the package's extra)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{needed_by} needs {requirement.split('[')[0]}: pip install '{requirement}' "
            f"(or the `{extra}` extra: pip install -e '.[{extra}]' in the maspo-verl checkout)"
        ) from exc


def config_dir() -> Path:
    """The Hydra config folder: ``maspo_verl/hydra_configs`` in an installed wheel, else ``hydra_configs/``
    beside the package (a checkout, an editable install, or a checkout uploaded as a Ray job's
    ``working_dir``, whose package shadows an installed one)."""
    package = Path(__file__).resolve().parent
    for folder in (package / "hydra_configs", package.parent / "hydra_configs"):
        if (folder / "maspo_trainer.yaml").is_file():
            return folder
    raise FileNotFoundError(
        f"no hydra_configs/ beside {package}: reinstall maspo-verl (the wheel ships maspo_verl/hydra_configs)"
    )


def preset_names(group: str = "loss") -> list[str]:
    """The presets of a config group (``loss=<name>``): the YAML files of ``hydra_configs/<group>/``."""
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def read_step_metrics(path: Path | None) -> dict[int, dict]:
    """step -> metrics of verl's ``file`` logger (one JSON object ``{"step", "data"}`` a line); lines
    cut short by a failure are skipped."""
    steps: dict[int, dict] = {}
    if path is None or not Path(path).is_file():
        return steps
    for raw in Path(path).read_text(errors="replace").splitlines():
        try:
            record = json.loads(raw)
            steps.setdefault(int(record["step"]), {}).update(record["data"])
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def warn_once(
    message: str,
    category: type[Warning] = UserWarning,
    logger: logging.Logger | None = None,
    python_warning: bool = True,
) -> None:
    """``warnings.warn`` (and ``logger.warning``) the first time ``message`` comes up in this process;
    ``python_warning=False``: the log line only (said once on the console, without a source line)."""
    if message in _warned:
        return
    _warned.add(message)
    if python_warning or logger is None:
        warnings.warn(message, category, stacklevel=3)
    if logger is not None:
        logger.warning(message)


def registrar(table: dict):
    """A class decorator that puts an instance of the class in ``table`` under the class's ``name``."""

    def register(cls):
        table[cls.name] = cls()
        return cls

    return register


def write_parquet(rows: list[dict], path: str, schema=None) -> None:
    """``rows`` as a parquet file (a pyarrow ``schema`` fixes the column types), creating its folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


HUB_PROBE_TIMEOUT_S = 3.0
_hub_reachable: dict[str, str | None] = {}


def hub_unreachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the Hugging Face Hub cannot be reached from here (None: it can), found in at most ``timeout``
    seconds: a TCP connection to ``HF_ENDPOINT`` (default https://huggingface.co), or to the HTTPS proxy
    when one is set. Checked once per process. A machine without the Hub otherwise learns it from the Hub
    clients' retries (a minute or more)."""
    import socket
    from urllib.parse import urlsplit

    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    proxies = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    proxy = next((os.environ[k] for k in proxies if os.environ.get(k)), "")
    target = urlsplit(proxy if "://" in proxy else f"http://{proxy}") if proxy else urlsplit(endpoint)
    host, port = target.hostname or "", target.port or (443 if target.scheme == "https" else 80)
    key = f"{host}:{port}"
    if key not in _hub_reachable:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            _hub_reachable[key] = None
        except OSError as exc:
            via = f" through the proxy {key}" if proxy else ""
            _hub_reachable[key] = f"{endpoint} is not reachable{via} ({type(exc).__name__}: {exc})"
    return _hub_reachable[key]


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` is set (the Hub clients then read their local cache only)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def default_cache_dir() -> Path:
    """``$MASPO_VERL_CACHE``, else ``$XDG_CACHE_HOME/maspo_verl`` (``~/.cache/maspo_verl``): what the local mode
    and the prepared models generate, once."""
    root = os.environ.get("MASPO_VERL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "maspo_verl"
    )
    return Path(root)


def atomic_build(target: Path, build) -> Path:
    """``build(tmp)`` into a temp folder next to ``target``, then rename it there (safe against a concurrent first
    use); nothing to do where ``target`` is complete."""
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp{os.getpid()}"
    build(tmp)
    (tmp / ".complete").write_text("ok\n")
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target
