"""The worked example (``docs/examples/spike_rule.py``) is all a new segment rule takes.

In a copy of the repository, the example renamed to a name the code has never seen is dropped into the rules folder
with one preset YAML, and ``python -m maspo_verl generate`` is run; nothing else is edited. The rule is then
registered, its field is validated at start-up naming it, the generated README documents it, the discovered tests
cover it (at least five test cases name it, and pass) and, end to end, the local trainer trains with it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from maspo_verl.lab.engine.runs import run_local
from tests.helpers import REPO

NAME = "zqx_probe"  # the example's "spike", renamed
FIELD = f"{NAME}_threshold"
PRESET = f"maspo_{NAME}"
# the discovered tests that take every rule or preset (they select by the rule's or preset's name)
DISCOVERED = [
    "tests/core/test_worked_examples.py",
    "tests/core/test_rule_references.py",
    "tests/core/test_reference_loss.py",
    "tests/core/test_limits.py",
    "tests/core/test_config.py",
    "tests/core/test_no_scalar_tensors.py",
    "tests/core/test_data_parallel.py",
]


def tracked_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return [name for name in listed.stdout.split("\0") if name and (REPO / name).is_file()]


def renamed_example() -> str:
    text = (REPO / "docs" / "examples" / "spike_rule.py").read_text()
    return text.replace("SpikeRule", "ZqxProbeRule").replace("spike", NAME)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the repository with the renamed rule, its preset and the generated files: nothing else."""
    root = tmp_path_factory.mktemp("example") / "repo"
    for name in tracked_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    (root / "maspo_verl" / "core" / "segments" / "rules" / f"{NAME}.py").write_text(renamed_example())
    (root / "hydra_configs" / "loss" / f"{PRESET}.yaml").write_text(
        "# @package _global_\n"
        f"# MASPO, {NAME} segments: a segment ends after a surprising token\n"
        "actor_rollout_ref:\n  actor:\n    loss_agg_mode: seq-mean-token-mean\n    policy_loss:\n"
        f"      loss_mode: maspo\n      segment_rule: {NAME}\n      {FIELD}: 2.0\n"
    )
    out = run(root, "-m", "maspo_verl", "generate")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "docs/configuration.md" in out.stdout and "maspo_base.yaml" in out.stdout
    return root


def run(root: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    env["PYTHONPATH"] = str(root)  # the copy's package, not the installed one
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_example_is_a_complete_rule_the_code_has_never_seen():
    text = renamed_example()
    assert NAME not in (REPO / "docs" / "configuration.md").read_text()
    assert f'name = "{NAME}"' in text and FIELD in text


def test_it_is_registered_and_documented_by_the_generator(checkout):
    code = f"from maspo_verl.core.segments import SEGMENT_RULES; print(SEGMENT_RULES['{NAME}'].settings[0].name)"
    out = run(checkout, "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == FIELD, out.stderr
    reference = (checkout / "docs" / "configuration.md").read_text()
    assert f"| `{NAME}` |" in reference and f"| `{FIELD}` | rule `{NAME}` |" in reference
    assert f"| `{PRESET}` |" in reference and f"| `{PRESET}` |" in (checkout / "README.md").read_text()
    assert f"{FIELD}: 2.0" in (checkout / "hydra_configs" / "maspo_base.yaml").read_text()


def test_a_bad_value_of_its_field_is_refused_at_start_up(checkout):
    out = run(
        checkout, "-m", "maspo_verl.main", f"loss={PRESET}", f"actor_rollout_ref.actor.policy_loss.{FIELD}=abc",
        "maspo.dry_run=true",
    )  # fmt: skip
    assert out.returncode != 0
    assert f"policy_loss.{FIELD}='abc' is invalid: allowed a finite number" in out.stdout + out.stderr


def test_its_worked_examples_and_plain_reference_pass(checkout):
    """The example's own tests, in the suite: its worked examples and its vectorised code against its plain loop on
    random rows, with cutoffs drawn where float32 rounding of a float setting would show (1 - 2^-30)."""
    files = ["tests/core/test_worked_examples.py", "tests/core/test_rule_references.py"]
    out = run(checkout, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rule", NAME, "-rA", *files)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    passed = [line for line in out.stdout.splitlines() if line.startswith("PASSED") and NAME in line]
    assert len(passed) >= 100, out.stdout[-4000:]


@pytest.mark.slow  # (the discovered tests run on every shipped rule in the suite itself)
def test_the_discovered_tests_cover_it(checkout):
    out = run(checkout, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rule", NAME, "-rA", *DISCOVERED)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    passed = [line for line in out.stdout.splitlines() if line.startswith("PASSED") and NAME in line]
    assert len(passed) >= 5, out.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.e2e
def test_it_trains_in_the_local_mode(checkout):
    run_dir = checkout / "outputs" / "example_run"
    done = run_local([f"loss={PRESET}"], run_dir, env={"PYTHONPATH": str(checkout)}, cwd=checkout)
    assert done.returncode == 0, done.tail()
    assert sorted(done.steps) == [1, 2], done.tail()
    assert f"segment_rule: {NAME}" in done.config_text
    assert all(m["actor/ratio/segments_per_seq"] >= 1 for m in done.steps.values()), done.steps
