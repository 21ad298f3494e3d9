"""Exit 0 when this interpreter already has what a pip install would bring, so .ci/setup can skip it.

    python .ci/satisfied.py REQUIREMENT...          each requirement and its installed dependencies
    python .ci/satisfied.py --no-deps REQUIREMENT   that distribution only (REQUIREMENT may be a wheel
                                                    file: then it must be installed from that very file)
    python .ci/satisfied.py --project EXTRAS STAMP  this checkout, installed editable, with pyproject.toml's
                                                    dependencies and EXTRAS (a,b,c), and pyproject.toml
                                                    unchanged since STAMP was written (its sha256)

Requirements are checked against the installed distributions' metadata, recursively (extras and
environment markers included); nothing is imported, downloaded or installed. Prints why on a miss.
"""

from __future__ import annotations

import hashlib
import json
import sys
from importlib import metadata
from pathlib import Path

import tomllib

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def _missing(requirements: list[str], recursive: bool = True) -> str | None:
    """The first requirement (or dependency of one) that is not installed at a matching version."""
    todo = [(Requirement(r), "") for r in requirements]
    seen = set()
    while todo:
        req, ctx = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ctx}):
            continue
        key = (req.name.lower().replace("_", "-"), tuple(sorted(req.extras)), str(req.specifier))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            return f"{req.name} is not installed"
        if not req.specifier.contains(dist.version, prereleases=True):
            return f"needs {req}, {req.name} {dist.version} is here"
        for dep in dist.requires if recursive and dist.requires else []:
            todo += [(Requirement(dep), e) for e in ("", *req.extras)]
    return None


def _top_level(requirement: str) -> str | None:
    """Only the named distribution (a ``pip install --no-deps``); a wheel file by its sha256."""
    wheel = Path(requirement)
    if wheel.suffix != ".whl":
        return _missing([requirement], recursive=False)
    name = wheel.name.split("-")[0]
    try:
        url = json.loads(metadata.distribution(name).read_text("direct_url.json") or "{}")
    except metadata.PackageNotFoundError:
        return f"{name} is not installed"
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if url.get("archive_info", {}).get("hashes", {}).get("sha256") != digest:
        return f"{name} is not installed from {wheel}"
    return None


def _project(extras: str, stamp: Path) -> str | None:
    pyproject = (ROOT / "pyproject.toml").read_bytes()
    if not stamp.is_file():
        return f"no install of this checkout recorded in {stamp}"
    if stamp.read_text().strip() != hashlib.sha256(pyproject).hexdigest():
        return "pyproject.toml changed since the last install"
    project = tomllib.loads(pyproject.decode())["project"]
    try:
        dist = metadata.distribution(project["name"])
    except metadata.PackageNotFoundError:
        return f"{project['name']} is not installed"
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    if not url.get("dir_info", {}).get("editable") or url.get("url") != ROOT.as_uri():
        return f"{project['name']} is not installed editable from {ROOT}"
    if dist.version != project["version"]:
        return f"{project['name']} {dist.version} is installed, pyproject.toml says {project['version']}"
    wanted = list(project["dependencies"])
    for extra in filter(None, extras.split(",")):
        wanted += project["optional-dependencies"][extra]
    return _missing(wanted)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--project"]:
        why = _project(argv[1], Path(argv[2]))
    elif argv[:1] == ["--no-deps"]:
        why = next(filter(None, map(_top_level, argv[1:])), None)
    else:
        why = _missing(argv)
    if why:  # what set-up installs next, and why: a plan, not an error
        target = "this checkout" if argv[:1] == ["--project"] else " ".join(a for a in argv if a != "--no-deps")
        why = why.removeprefix(f"needs {target}, ")  # the requirement itself: its found version is enough
        where = f" into {Path(sys.prefix).name}" if argv[:1] == ["--no-deps"] else ""  # an overlay venv
        print(f"set-up: installing {target}{where} ({why})")
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
