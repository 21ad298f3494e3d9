"""The configs and every subpackage ship in the wheel, and compose from an installed copy."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "maspo_verl").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("maspo_verl-*.whl")
    target = out / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
        names = zf.namelist()
    return target, names


def test_wheel_holds_configs_and_entry_point(installed_wheel):
    _, names = installed_wheel
    for preset in ("grpo", "gspo", "maspo_fixed", "maspo_logprob", "maspo_tokenval", "ctpo", "pgspo"):
        assert f"maspo_verl/hydra_configs/loss/{preset}.yaml" in names
    assert "maspo_verl/hydra_configs/maspo_trainer.yaml" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert entry_points


def test_installed_copy_composes_without_the_checkout(installed_wheel, tmp_path):
    target, _ = installed_wheel
    probe = (
        "import maspo_verl\n"
        "from hydra import compose, initialize_config_module\n"
        f"assert maspo_verl.__file__.startswith({str(target)!r}), maspo_verl.__file__\n"
        "with initialize_config_module(config_module='maspo_verl.hydra_configs', version_base=None):\n"
        "    cfg = compose(config_name='maspo_trainer', overrides=['loss=ctpo'])\n"
        "print(cfg.actor_rollout_ref.actor.policy_loss.loss_mode)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ctpo"
