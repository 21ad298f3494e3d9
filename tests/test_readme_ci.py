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
    assert satisfied("torch==0.0.1").stdout == (f"set-up: installing torch==0.0.1 (torch {version('torch')} is here)\n")
    # through dependencies and requested extras, never through markers that do not apply
    assert "maspo-probe-missing is not installed" in satisfied("maspo-probe-c", site=site).stdout
    assert "maspo-probe-missing is not installed" in satisfied("maspo-probe-a[x]", site=site).stdout
    assert "installing maspo-probe-b>=2 (maspo-probe-b 1.0 is here)" in satisfied("maspo-probe-b>=2", site=site).stdout
    assert satisfied("--no-deps", "maspo-probe-c", site=site).returncode == 0
    # a wheel file: installed from that very file (its sha256, as pip records it)
    wheel = tmp_path / "maspo_probe_w-1.0-py3-none-any.whl"
    wheel.write_bytes(b"first build")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    fake_dist(site, "maspo-probe-w", direct_url={"url": wheel.as_uri(), "archive_info": {"hashes": {"sha256": digest}}})
    assert satisfied("--no-deps", str(wheel), site=site).returncode == 0
    wheel.write_bytes(b"a rebuilt wheel, same version")
    out = satisfied("--no-deps", str(wheel), site=site).stdout
    # an overlay venv's install names the venv it goes into
    assert re.match(rf"set-up: installing {re.escape(str(wheel))} into \S+ \(maspo_probe_w is not installed", out), out
    # the package itself: reinstalled whenever pyproject.toml changed since the stamp
    stamp = tmp_path / "stamp"
    stamp.write_text("0" * 64)
    assert "pyproject.toml changed" in satisfied("--project", "test", str(stamp)).stdout


def torch_choice():
    import importlib.util

    spec = importlib.util.spec_from_file_location("torch_choice", REPO / ".ci" / "torch_choice.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setup_chooses_the_cpu_torch_build_without_a_gpu():
    """.ci/setup's torch choice (``.ci/torch_choice.py:choose``) for each case it can meet."""
    tc = torch_choice()
    assert tc.choose("2.13.0", gpu=True, pick=None, cpu_index_up=True)[0] == ["torch==2.13.0"]
    args, why = tc.choose("2.13.0", gpu=False, pick="2.13.0+cpu", cpu_index_up=False)
    assert args == ["torch==2.13.0"] and "CPU build, from pip's configuration" in why
    args, _ = tc.choose("2.13.0", gpu=False, pick="2.13.0", cpu_index_up=True)
    assert args == ["torch==2.13.0+cpu", "--extra-index-url", tc.CPU_INDEX]
    args, why = tc.choose("2.13.0", gpu=False, pick="2.13.0", cpu_index_up=False)
    assert args == ["torch==2.13.0"] and "not reachable" in why and "CUDA build" in why and "\n" not in why


def test_setup_falls_back_and_says_so_with_an_empty_home(tmp_path):
    """The path a fresh clone with an empty HOME takes here: no pip configuration that finds a CPU wheel
    and PyTorch's CPU index unreachable. The script (run as .ci/setup runs it) falls back to the plain
    pin and says so in one line."""
    import os
    import subprocess
    import sys

    import pytest

    tc = torch_choice()
    if tc.has_nvidia_gpu():
        pytest.skip("an NVIDIA GPU is present: the CUDA build is the choice")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_FIND_LINKS") and k != "PIP_EXTRA_INDEX_URL"}
    env.update(HOME=str(tmp_path), MASPO_TORCH_CPU_INDEX="http://127.0.0.1:9/whl/cpu")
    out = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "torch_choice.py"), "2.13.0"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout == "torch==2.13.0\n", out
    (why,) = out.stderr.strip().splitlines()
    assert "PyTorch's CPU index (http://127.0.0.1:9/whl/cpu) is not reachable" in why, why
    report = subprocess.run([sys.executable, str(REPO / ".ci" / "torch_choice.py"), "--report"], capture_output=True)
    line = rb"installed torch \S+ \((CPU build|CUDA build, .*)\): \d+\.\d GB with its packages\n"
    assert re.fullmatch(line, report.stdout), report


def test_readme_says_where_cpu_torch_comes_from():
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "https://download.pytorch.org/whl/cpu" in readme
    assert "not reachable" in readme and "CUDA build" in readme


def test_setup_builds_only_what_the_first_command_needs_and_the_test_command_the_rest():
    """The README's first command builds `.venv` alone; the venvs only the tests use (other verl versions, a
    plain verl environment) are built by the test command, before its verl passes."""
    setup = (REPO / ".ci" / "setup").read_text()
    assert ".venv-" not in setup and "test_venvs" in setup  # (its header says where they are built)
    test = (REPO / ".ci" / "test").read_text()
    venvs = (REPO / ".ci" / "test_venvs").read_text()
    assert all(f"{v}" in venvs for v in (".venv-verl090", ".venv-verlmain", ".venv-plainverl"))
    assert test.index("bash .ci/test_venvs") < test.index('for venv in "${VENVS[@]}"')
    assert venvs.index('[ "${1:-}" = "--plain" ] || exit 0') < venvs.index("PLAIN=.venv-plainverl")


def test_ci_test_help_prints_usage_and_runs_nothing(tmp_path):
    """`bash .ci/test --help` in a checkout without any venv: the usage, exit 0, no venv built, no test run
    (without --help the same copy fails at once: nothing is set up there)."""
    import shutil
    import subprocess

    shutil.copytree(REPO / ".ci", tmp_path / ".ci")
    out = subprocess.run(["bash", ".ci/test", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out
    assert out.stdout.startswith("usage: bash .ci/test [PYTEST_ARGS...]\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ci"]
    bare = subprocess.run(["bash", ".ci/test"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0


def readme_learning_command() -> str:
    (command,) = [c for c in re.findall(r"```bash\n(.*?)\n```", (REPO / "README.md").read_text(), flags=re.S)
                  if c.startswith("python -m maspo_verl.lab learn ")]  # fmt: skip
    return command


def test_readme_says_the_first_run_is_a_plumbing_check_with_measured_times_and_points_to_one_that_learns():
    """The first command's 2 steps learn nothing: the README says so, gives measured times (no estimate), and
    shows a CPU run that learns, whose arguments the lab accepts (tests/e2e/test_learning_demo.py runs it)."""
    import argparse

    from maspo_verl.lab.studies import learn
    from maspo_verl.local import learn_tasks

    text = " ".join((REPO / "README.md").read_text().split())
    first = text.split("The first sets up `.venv`", 1)[1].split("source .venv/bin/activate", 1)[0]
    assert "a plumbing check" in first and "2 steps learn nothing" in first
    assert re.search(r"Measured .*: set-up [\d.]+-[\d.]+ min, the run [\d.]+-[\d.]+ min", first), first
    parser = argparse.ArgumentParser()
    learn.add_arguments(parser)
    args = parser.parse_args(readme_learning_command().split()[4:])
    learn.check_losses(args.losses)
    assert all(learn_tasks.known(t) for t in args.tasks) and args.seeds == 1 and args.steps >= 10
    assert "`reward.png` beside its `metrics.jsonl`" in text


def test_readme_says_what_ran_on_a_gpu_and_what_only_by_dry_run():
    """The recipes' READMEs say their GPU paths were checked by dry run only; the top-level README says it too."""
    text = " ".join((REPO / "README.md").read_text().split())
    sentence = text.split("What ran where: ", 1)[1].split(". ", 1)[0]
    assert "CUDA tests ran on an H100" in sentence and "checked by dry run only" in sentence
    assert all(path in sentence for path in ("vLLM", "FSDP2 on NCCL", "Megatron", "Docker", "SLURM"))
    ran = sentence.split("the other GPU paths", 1)[0]  # what did run names its results, which exist
    assert "Megatron engine" in ran and (REPO / "docs/results/megatron_update/megatron_update.json").exists()
    for recipe in ("math", "speech"):
        assert "dry run" in (REPO / "recipes" / recipe / "README.md").read_text()
