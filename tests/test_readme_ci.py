"""The README's two commands stay true: CI runs the README's test command verbatim."""

import re

from tests.helpers import REPO


def readme_commands():
    return re.findall(r"```bash\n(.*?)\n```", (REPO / "README.md").read_text(), flags=re.S)[:2]


def test_readme_opens_with_run_and_test_commands():
    run, test = readme_commands()
    assert run.startswith("bash .ci/setup && ") and "python -m maspo_verl.main local=cpu" in run
    assert test == "bash .ci/setup && bash .ci/test"
    assert ".venv/bin/python -m pytest -q" in (REPO / ".ci" / "test").read_text()


def test_ci_runs_the_readme_test_command():
    _, test = readme_commands()
    lines = (REPO / ".ci" / "run").read_text().strip().splitlines()
    assert lines[-1] == test


def test_setup_pins_cpu_torch_before_the_package():
    setup = (REPO / ".ci" / "setup").read_text()
    assert setup.index('"torch==2.13.0"') < setup.index("pip install -q -e")
