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


def satisfied(*args, site=None):
    """.ci/satisfied.py (set-up skips an install when it exits 0), optionally with a fake site dir first."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if site:
        env["PYTHONPATH"] = str(site)
    cmd = [sys.executable, str(REPO / ".ci" / "satisfied.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def fake_dist(site, name, requires=(), direct_url=None):
    import json

    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    if direct_url:
        (info / "direct_url.json").write_text(json.dumps(direct_url))


def test_setup_skips_only_what_is_installed(tmp_path):
    import hashlib
    from importlib.metadata import version

    site = tmp_path / "site"
    fake_dist(site, "maspo-probe-a", ["maspo-probe-b>=1", "maspo-probe-missing; extra == 'x'"])
    fake_dist(site, "maspo-probe-b", ["maspo-probe-missing>2; python_version < '3'"])
    fake_dist(site, "maspo-probe-c", ["maspo-probe-missing"])
    ok = satisfied(f"torch=={version('torch')}", "maspo-probe-a", site=site)
    assert (ok.returncode, ok.stdout) == (0, "")  # a re-run of set-up stays quiet
    assert satisfied("torch==0.0.1").stdout == f"installing: torch {version('torch')} does not match torch==0.0.1\n"
    # through dependencies and requested extras, never through markers that do not apply
    assert "maspo-probe-missing is not installed" in satisfied("maspo-probe-c", site=site).stdout
    assert "maspo-probe-missing is not installed" in satisfied("maspo-probe-a[x]", site=site).stdout
    assert "maspo-probe-b 1.0 does not match maspo-probe-b>=2" in satisfied("maspo-probe-b>=2", site=site).stdout
    assert satisfied("--no-deps", "maspo-probe-c", site=site).returncode == 0
    # a wheel file: installed from that very file (its sha256, as pip records it)
    wheel = tmp_path / "maspo_probe_w-1.0-py3-none-any.whl"
    wheel.write_bytes(b"first build")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    fake_dist(site, "maspo-probe-w", direct_url={"url": wheel.as_uri(), "archive_info": {"hashes": {"sha256": digest}}})
    assert satisfied("--no-deps", str(wheel), site=site).returncode == 0
    wheel.write_bytes(b"a rebuilt wheel, same version")
    assert satisfied("--no-deps", str(wheel), site=site).stdout.startswith("installing: maspo_probe_w is not installed")
    # the package itself: reinstalled whenever pyproject.toml changed since the stamp
    stamp = tmp_path / "stamp"
    stamp.write_text("0" * 64)
    assert "pyproject.toml changed" in satisfied("--project", "test", str(stamp)).stdout
