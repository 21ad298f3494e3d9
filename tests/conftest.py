import os
import subprocess
import sys

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=os.environ.get("MASPO_RUN_SLOW") == "1",
        help="also run the tests marked slow (more trainer runs; CI and .ci/test leave them out)",
    )


def pytest_configure(config):
    if config.getoption("--run-slow"):
        os.environ["MASPO_RUN_SLOW"] = "1"  # read at import (the fuzz test's number of cases)


def pytest_collection_modifyitems(config, items):
    gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    slow = pytest.mark.skip(reason="slow: pytest --run-slow runs it")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(gpu)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(slow)


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Each test leaves the process environment as it found it: the local mode's driver sets variables (the
    platform, the run folder's tracking paths) that later tests' subprocesses would inherit."""
    saved = dict(os.environ)
    yield
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    os.environ.update(saved)


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory):
    """maspo-verl's wheel, built once per test session (the packaging and Ray-job tests share it)."""
    from tests.helpers import REPO

    out = tmp_path_factory.mktemp("wheel_build")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("maspo_verl-*.whl")
    return wheel
