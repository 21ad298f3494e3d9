"""The configs and every subpackage ship in the wheel, and compose from an installed copy."""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib

from maspo_verl.util import preset_names
from tests.helpers import REPO


def test_every_folder_that_ships_is_listed_in_pyproject():
    """Every folder of the package and of hydra_configs/, data folders included: setuptools warns about an
    unlisted folder holding package data ("Package would be ignored") on every install."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for prefix, top in (("maspo_verl", REPO / "maspo_verl"), ("maspo_verl.hydra_configs", REPO / "hydra_configs")):
        for folder in [top, *top.rglob("*")]:
            if folder.is_dir() and "__pycache__" not in folder.parts:
                found.add(".".join([prefix, *folder.relative_to(top).parts]))
    assert found == listed, f"add to / remove from [tool.setuptools] packages: {sorted(found ^ listed)}"


@pytest.fixture(scope="module")
def installed_wheel(built_wheel, tmp_path_factory):
    target = tmp_path_factory.mktemp("wheel") / "site"
    with zipfile.ZipFile(built_wheel) as zf:
        zf.extractall(target)
        names = zf.namelist()
    return target, names


def test_wheel_holds_configs_and_entry_point(installed_wheel):
    _, names = installed_wheel
    for preset in preset_names():
        assert f"maspo_verl/hydra_configs/loss/{preset}.yaml" in names
    assert "maspo_verl/hydra_configs/maspo_trainer.yaml" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert entry_points


def test_installed_copy_composes_without_the_checkout(installed_wheel, tmp_path):
    target, _ = installed_wheel
    probe = (
        "import maspo_verl\n"
        "from hydra import compose, initialize_config_dir\n"
        "from maspo_verl.util import config_dir\n"
        f"assert maspo_verl.__file__.startswith({str(target)!r}), maspo_verl.__file__\n"
        f"assert str(config_dir()).startswith({str(target)!r}), config_dir()\n"
        "with initialize_config_dir(str(config_dir()), version_base=None):\n"
        "    cfg = compose(config_name='maspo_trainer', overrides=['loss=ctpo'])\n"
        "print(cfg.actor_rollout_ref.actor.policy_loss.loss_mode)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ctpo"


@pytest.mark.parametrize("recipe", ["math", "speech"])
def test_recipes_install_line_brings_their_default_logger(recipe):
    """A recipe that logs to wandb by default names, in its README's install line, an extra that has wandb."""
    common = (REPO / "recipes" / recipe / "common.sh").read_text()
    logger = re.search(r"^LOGGER=\$\{LOGGER:-'(.*)'\}", common, re.M).group(1)
    assert "wandb" in logger  # what makes the extra necessary
    readme = (REPO / "recipes" / recipe / "README.md").read_text()
    extras = re.search(r"pip install [^\n]*\[([\w,]+)\]", readme).group(1).split(",")
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.split(">")[0].split("=")[0].strip() == "wandb" for e in extras for dep in declared[e]), extras


@pytest.fixture(scope="module")
def uploaded_checkout(tmp_path_factory):
    """What `ray job submit --working-dir` of the repository unpacks on a node: the checkout minus the
    excludes of recipes/cluster/ray_submit.sh (a job's driver runs in it, so its `maspo_verl/` is the one
    imported)."""
    copy = tmp_path_factory.mktemp("uploaded") / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(*ray_submit_excludes()))
    return copy


def ray_submit_excludes() -> list[str]:
    """The default EXCLUDES of recipes/cluster/ray_submit.sh (what a job upload leaves out)."""
    script = (REPO / "recipes" / "cluster" / "ray_submit.sh").read_text()
    return re.search(r"^EXCLUDES=\$\{EXCLUDES:-(.*)\}$", script, re.M).group(1).split(",")


def test_ray_submit_uploads_no_venv():
    """No venv of any name goes up with a job: the ones .ci/setup makes and any other `.venv*`."""
    import fnmatch

    excludes = ray_submit_excludes()
    for name in (".venv", ".venv-verl090", ".venv-verlmain", ".venv-mine"):
        assert any(fnmatch.fnmatch(name, pattern) for pattern in excludes), (name, excludes)
    assert not any(fnmatch.fnmatch(name, pattern) for pattern in excludes for name in ("maspo_verl", "hydra_configs"))


@pytest.mark.parametrize("install", ["wheel", "editable"])
def test_uploaded_checkout_shadowing_an_install_composes(install, installed_wheel, uploaded_checkout):
    """The uploaded copy that shadows the installed package composes from its own configs (`hydra_configs/`
    beside its package). `wheel`: the wheel's files on a plain sys.path (python -S: no .pth files, so the test venv's
    editable finder cannot supply what the copy lacks); `editable`: this venv as it is."""
    target, _ = installed_wheel
    probe = (
        "import maspo_verl\n"
        "from hydra import compose, initialize_config_dir\n"
        "from maspo_verl.util import config_dir\n"
        "with initialize_config_dir(str(config_dir()), version_base=None):\n"
        "    cfg = compose(config_name='maspo_trainer', overrides=['loss=pgspo', 'local=cpu'])\n"
        "print(maspo_verl.__file__, config_dir(), cfg.actor_rollout_ref.actor.policy_loss.loss_mode)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, "-c", probe]
    if install == "wheel":
        cmd.insert(1, "-S")
        env["PYTHONPATH"] = os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]])
    out = subprocess.run(cmd, cwd=uploaded_checkout, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    package, configs, loss_mode = out.stdout.strip().splitlines()[-1].split()
    assert package.startswith(str(uploaded_checkout)) and configs.startswith(str(uploaded_checkout))
    assert loss_mode == "pgspo"


DEV_VENV = REPO / ".venv-verlmain"


@pytest.mark.skipif(not (DEV_VENV / "bin" / "python").exists(), reason=".venv-verlmain not set up (bash .ci/setup)")
def test_pip_keeps_a_development_verl(built_wheel, tmp_path):
    """pip's plan for our wheel in a venv holding verl's development branch: install maspo-verl alone.

    ``--no-index``: a requirement that excluded the installed verl would need another verl and fail."""
    wheel = built_wheel
    python = str(DEV_VENV / "bin" / "python")
    version = subprocess.run([python, "-c", "import verl; print(verl.__version__)"], capture_output=True, text=True)
    assert version.stdout.strip().startswith("0.10.0.dev"), version.stdout + version.stderr
    report = tmp_path / "plan.json"
    cmd = [python, "-m", "pip", "install", "--dry-run", "--no-index", "-q", "--report", str(report), str(wheel)]
    # a PYTHONPATH naming a checkout shows pip its egg-info as maspo-verl installed already
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(report.read_text())["install"]
    assert [(p["metadata"]["name"], p["metadata"]["version"]) for p in plan] == [("maspo-verl", "0.1.0")]


def test_the_tests_build_the_wheel_in_one_place_and_share_one_manager_base():
    """CI time: the wheel is built once per session (``tests/conftest.py:built_wheel``), not per test
    module; every reward manager, the package's and the tests', derives from one base with verl's constructor
    (``maspo_verl.plugin.rewards``)."""
    sources = {p: p.read_text() for p in (REPO / "tests").rglob("*.py")}
    builds = [p.relative_to(REPO) for p, text in sources.items() if re.search(r'"pip",\s*"wheel"', text)]
    assert builds == [Path("tests/conftest.py")], builds
    sources |= {p: p.read_text() for p in (REPO / "maspo_verl").rglob("*.py")}
    base = re.compile(r"^class \w+\(RewardManagerBase\)", re.M)
    inits = [p.relative_to(REPO) for p, text in sources.items() if base.search(text)]
    assert inits == [Path("maspo_verl/plugin/rewards.py")], inits
    assert "def __init__" not in sources[REPO / "tests/e2e/reward_managers.py"]


PLAIN_VENV = REPO / ".venv-plainverl"


@pytest.mark.slow  # the test takes ~30 s, building its venv 4-8 min (bash .ci/test --run-slow builds it)
def test_check_passes_in_a_plain_verl_env(built_wheel, tmp_path):
    """A user's verl environment (torch, verl 0.9.1 from the index; none of the modules verl's trainer imports
    but does not require, as cachetools and uvicorn) with the wheel and its `math` extra: `check` exits 0,
    the hooks whose verl module cannot import there skipped in one note line after the report."""
    python = PLAIN_VENV / "bin" / "python"
    if not python.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{PLAIN_VENV.name} is missing: bash .ci/test --run-slow builds it (.ci/test_venvs --plain)")
        pytest.skip(f"{PLAIN_VENV.name} not set up: bash .ci/test_venvs --plain")
    probe = "import importlib.util as u, verl; print(verl.__version__, [m for m in ('cachetools', 'uvicorn') if u.find_spec(m)])"  # noqa: E501
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    plain = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert plain.stdout.strip() == "0.9.1 []", plain.stdout + plain.stderr[-2000:]
    install = [python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(built_wheel)]
    out = subprocess.run(install, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    # what `pip install maspo-verl[math]` would bring is there (the wheel's requirements and the extra's)
    deps = subprocess.run([python, REPO / ".ci" / "satisfied.py", "maspo-verl[math]"], capture_output=True, text=True)
    assert deps.returncode == 0, deps.stdout + deps.stderr
    out = subprocess.run([python, "-m", "maspo_verl", "check"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["ok"] and report["python"] == str(python)
    assert report["autoload_registers"] == ["maspo", "ctpo", "pgspo", "maspo_span_grpo", "maspo_turn_grpo"]
    hooks = report["hooks"]
    assert hooks["ppo_loss"] == "installed" and hooks["verl_losses"] == "installed"
    assert hooks["token_scores"].startswith("skipped: verl.experimental.agent_loop cannot be imported here: no module")
    (note,) = out.stderr.strip().splitlines()
    assert note.startswith("maspo_verl check: note: hooks token_scores, update_step skipped: ")
    assert note.endswith("pip install cachetools uvicorn, or maspo-verl's `local` extra)")
