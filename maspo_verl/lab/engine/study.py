"""What a study declares, and where the lab finds the studies: every module of ``maspo_verl.lab.studies`` with a
``STUDY`` is one; those with a command are the CLI's commands (``python -m maspo_verl.lab --help``), the table of
docs/lab.md (``python -m maspo_verl generate``) and the folders tests/lab/test_regenerate.py regenerates."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
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


def add_sections(out, folder: str, title: str = "") -> None:
    """The README of a folder that several studies write: each study of ``folder`` with a ``readme_section(out)``
    (the section under its ``SECTION`` header, or "" where it has nothing yet) replaces its earlier section, at
    the end; ``title``: the README's first line where there is none yet."""
    path = Path(out) / "README.md"
    for m in studies().values():
        if m.STUDY.folder == folder and hasattr(m, "readme_section"):
            text = path.read_text() if path.exists() else f"{title}\n"
            section = m.readme_section(out)
            path.write_text(text.split(m.SECTION)[0].rstrip() + "\n" + ("\n" + section if section else ""))


def run_command(argv: list[str]) -> None:
    """One lab command (``<command> --out DIR [options]``) as the CLI parses and runs it: a study that runs another
    command in pieces (a renamed flag fails here)."""
    args = parse(argv)
    args.module.run(args, argv)


def parse(argv: list[str], description: str = "") -> argparse.Namespace:
    """The lab CLI's arguments of ``argv`` (``<command> [options]``): the command's module (a mode's, where one is
    on), its folder and ``out`` resolved. A study that runs another command in pieces parses each piece here."""
    from maspo_verl.lab.engine import common

    parser = argparse.ArgumentParser(
        prog="python -m maspo_verl.lab", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, study in commands().items():
        folder = study.STUDY.folder
        p = sub.add_parser(name, help=study.STUDY.summary)
        where = p.add_mutually_exclusive_group()
        where.add_argument("--out", default=None, help=f"output folder (default {common.default_out(folder)})")
        where.add_argument(
            "--update-docs",
            action="store_true",
            help=f"write the committed {common.default_out(folder, update_docs=True)} (run from the repository root)",
        )
        study.add_arguments(p)
        p.set_defaults(module=study, folder=folder)
    args = parser.parse_args(argv)
    # a mode in a module of its own (its run and folder): the study's modes map a flag (or its values) to the module
    for flag, mode in args.module.STUDY.modes.items():
        value = getattr(args, flag)
        name = mode.get(value) if isinstance(mode, dict) else mode if value else None
        if name:
            args.module = module(name)
            args.folder = args.module.STUDY.folder
    if hasattr(args.module, "folder_of"):  # a mode with a folder of its own (bench --mode update)
        args.folder = args.module.folder_of(args)
    if args.update_docs and not common.default_out(args.folder, update_docs=True).parent.is_dir():
        parser.error(f"--update-docs writes docs/results/{args.folder}/ of a checkout: run it from the repository root")
    args.out = str(args.out or common.default_out(args.folder, update_docs=args.update_docs))
    return args
