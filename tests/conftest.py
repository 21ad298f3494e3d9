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
    parser.addoption(
        "--rule",
        metavar="NAME",
        default=None,
        help="run only the tests that take the segment rule NAME (its own name, a preset or case of it, as a "
        "parameter): e.g. pytest tests/core --rule fixed",
    )


def pytest_configure(config):
    if config.getoption("--run-slow"):
        os.environ["MASPO_RUN_SLOW"] = "1"  # read at import (the fuzz test's number of cases)


def rule_of(value, presets: dict[str, str]) -> str | None:
    """The segment rule a test parameter names: the rule itself, ``rule=NAME``, a preset of ours (its
    ``segment_rule``), a case with ``settings["segment_rule"]``, or a tuple holding one of these."""
    if isinstance(value, str):
        return presets.get(value, value.removeprefix("rule="))
    if isinstance(value, tuple):
        return next((rule for rule in (rule_of(v, presets) for v in value) if rule is not None), None)
    settings = getattr(value, "settings", None)
    return settings.get("segment_rule") if isinstance(settings, dict) else None


def select_rule(config, items) -> None:
    """``--rule NAME``: keep the parametrized tests one of whose parameters names the rule; deselect the rest."""
    from maspo_verl.core.segments import SEGMENT_RULES
    from maspo_verl.util import preset_names
    from tests.helpers import preset_fields

    name = config.getoption("--rule")
    if name not in SEGMENT_RULES:
        raise pytest.UsageError(f"--rule {name!r} is not a segment rule: allowed {', '.join(SEGMENT_RULES)}")
    presets = {}
    for preset in preset_names():
        fields = preset_fields(preset)[1]
        if fields.get("loss_mode") == "maspo":
            presets[preset] = fields.get("segment_rule")
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        takes = any(rule_of(value, presets) == name for value in params.values())
        (keep if takes else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_modifyitems(config, items):
    if config.getoption("--rule") is not None:
        select_rule(config, items)
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
