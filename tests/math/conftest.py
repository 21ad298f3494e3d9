"""Shared helpers for the math recipe tests: fixture files, prepared data, running the shell scripts."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from tests.helpers import compose_config
from tests.math.fixtures import LOCAL_SPECS


def require_math_verify() -> None:
    """math-verify is a hard requirement of the math tests (installed by the `math` extra): fail, never skip."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        pytest.fail("math-verify is not installed: pip install -e '.[math]' (or 'math-verify[antlr4_9_3]')")


@pytest.fixture(scope="session")
def prepared_dir(tmp_path_factory) -> Path:
    """Every dataset of the recipe, prepared from the local fixture files (no hub access)."""
    from maspo_verl.math import prepare

    out = tmp_path_factory.mktemp("maspo_math")
    argv = ["--out-dir", str(out), "--only-local"]
    for spec in LOCAL_SPECS:
        argv += ["--local", spec]
    assert prepare.main(argv) == 0
    return out


def loss_section(stdout: str) -> dict:
    """The YAML that ``maspo.dry_run=true`` prints after 'loss section:'."""
    marker = "loss section:"
    assert marker in stdout, f"no loss section in output:\n{stdout[-3000:]}"
    return yaml.safe_load(stdout.split(marker, 1)[1])


def dry_run_command(stdout: str) -> tuple[str, list[str]]:
    """(config name, overrides) of the ``command:`` line a recipe prints under DRY_RUN=1."""
    lines = stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("command:"))
    words, i = lines[first][len("command:") :], first
    while words.endswith(" \\"):  # one override per line, each line but the last ended by " \\"
        i += 1
        words = words[:-2] + " " + lines[i].strip()
    argv = shlex.split(words)
    assert argv[1:3] == ["-m", "maspo_verl.main"], argv[:3]
    assert argv[3] == "--config-name"
    return argv[4], [a for a in argv[5:] if a != "maspo.dry_run=true"]


def compose(config_name: str, overrides: list[str]):
    return compose_config(*overrides, config_name=config_name)
