"""What a study declares, and where the lab finds the studies: every module of ``maspo_verl.lab.studies`` with a
``STUDY`` is one; those with a command are the CLI's commands (``python -m maspo_verl.lab --help``), the table of
docs/lab.md (``python -m maspo_verl generate``) and the folders tests/lab/test_regenerate.py regenerates."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from types import ModuleType

from maspo_verl.lab.engine.cells import parse_cell

PACKAGE = "maspo_verl.lab.studies"


@dataclass(frozen=True)
class Study:
    """A study module's declaration. ``command``: its lab command (None: a mode another command's ``modes`` run);
    ``summary``: what it measures, one line; ``folder``: its results folder (docs/results/<folder>/, default the
    command); ``writes``: the files its report-only path writes (``--report``, or with ``reads_only`` the command
    as it was run: a report of other folders); ``modes``: a flag -> the module that runs it (or the flag's values ->
    modules). A study with a registered design declares it here, and its code reads it from here: ``arms`` (loss
    presets or variants), ``cells`` (``engine.cells``' grammar), ``tune_seeds`` (that choose each arm's setting)
    and ``held_seeds`` (fresh seeds that judge it)."""

    command: str | None
    summary: str
    folder: str = ""
    writes: tuple[str, ...] = ()
    reads_only: bool = False
    modes: dict = field(default_factory=dict)
    arms: tuple[str, ...] = ()
    cells: tuple[str, ...] = ()
    tune_seeds: tuple[int, ...] = ()
    held_seeds: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.folder:
            object.__setattr__(self, "folder", self.command)
        for cell in self.cells:
            parse_cell(cell)
        if set(self.tune_seeds) & set(self.held_seeds):
            raise ValueError(f"study {self.folder}: its tuning seeds and held-out seeds overlap")


def module(name: str) -> ModuleType:
    """The study module ``name`` (of ``maspo_verl.lab.studies``)."""
    return importlib.import_module(f"{PACKAGE}.{name}")


def studies() -> dict[str, ModuleType]:
    """Every study module that declares a ``STUDY``, by module name."""
    package = importlib.import_module(PACKAGE)
    found = {info.name: module(info.name) for info in pkgutil.iter_modules(package.__path__)}
    return {name: m for name, m in sorted(found.items()) if isinstance(getattr(m, "STUDY", None), Study)}


def commands() -> dict[str, ModuleType]:
    """The lab's commands: the study modules that declare one, by command."""
    return {m.STUDY.command: m for m in studies().values() if m.STUDY.command}
