"""recipes/cluster/: the `ray job submit` launcher and the SLURM script, by their dry runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers import REPO, run_script, script_env


def _field(stdout: str, name: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith(f"{name}: "))[len(name) + 2 :]


def test_ray_submit_dry_run():
    out = run_script(
        "recipes/cluster/ray_submit.sh",
        "trainer.total_training_steps=3",
        DRY_RUN="1",
        RAY_ADDRESS="http://head:8265",
        RECIPE="recipes/math/run_ctpo_la.sh",
        MODEL_PATH="/shared/models/Qwen3-4B",
        DATA_DIR="/shared/data",
        NNODES="2",
        SUBMISSION_ID="maspo-ctpo-1",
        WANDB_MODE="offline",
    )
    assert out.returncode == 0, out.stderr
    command = shlex.split(out.stdout.splitlines()[1])
    assert command[:5] == ["ray", "job", "submit", "--address", "http://head:8265"]
    assert command[command.index("--submission-id") + 1] == "maspo-ctpo-1"
    runtime_env = json.loads(command[command.index("--runtime-env-json") + 1])
    assert runtime_env == json.loads(_field(out.stdout, "runtime_env"))
    assert runtime_env["working_dir"] == str(REPO)
    assert runtime_env["pip"] == ["${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}[math]"]  # our package, every node
    assert ".venv*" in runtime_env["excludes"] and ".git" in runtime_env["excludes"]  # every venv, git data
    assert runtime_env["env_vars"]["WANDB_MODE"] == "offline"
    # nothing verl or the local mode sets itself: Ray refuses a ray.init naming a job's variable
    assert not {"TOKENIZERS_PARALLELISM", "NCCL_DEBUG"} & set(runtime_env["env_vars"])
    # the entrypoint: separate words after `--` (Ray's CLI shell-quotes each word with shlex.join)
    entry = command[command.index("--") + 1 :]
    assert entry == shlex.split(_field(out.stdout, "entrypoint"))
    assert entry[:5] == ["python3", "-m", "maspo_verl.main", "--config-name", "maspo_trainer"]
    assert "loss=ctpo" in entry
    assert "algorithm.rollout_correction.bypass_mode=True" in entry
    assert "actor_rollout_ref.model.path=/shared/models/Qwen3-4B" in entry
    assert "data.train_files=['/shared/data/math_train.parquet']" in entry
    assert "trainer.nnodes=2" in entry
    assert entry[-1] == "trainer.total_training_steps=3"


def test_ray_submit_entrypoint_survives_rays_quoting():
    """The line Ray's job manager runs in a shell (the entrypoint words joined with shlex.join, as its
    CLI does) is exactly the recipe's command: each override one argument, brackets and quotes intact."""
    out = run_script("recipes/cluster/ray_submit.sh", "trainer.logger=['console','wandb']", DRY_RUN="1")
    assert out.returncode == 0, out.stderr
    command = shlex.split(out.stdout.splitlines()[1])
    line = shlex.join(command[command.index("--") + 1 :])
    argv = subprocess.run(
        ["sh", "-c", line.replace("python3", 'python3 -c "import sys, json; print(json.dumps(sys.argv[1:]))"', 1)],
        capture_output=True,
        text=True,
        env=script_env(),
    )
    assert argv.returncode == 0, argv.stderr
    logger = "trainer.logger=['console','wandb']"
    recipe = run_script("recipes/math/run_gspo.sh", logger, PRINT_CMD="1", PYTHON="python3")
    assert json.loads(argv.stdout) == shlex.split(recipe.stdout)[1:]


def test_ray_submit_hands_ray_the_entrypoint_and_leaves_no_temp_file(tmp_path):
    """The real path (no dry run) ends in `exec ray job submit ...`: a `ray` first on PATH records what
    it is given; the submitting shell's temp files are gone once ray has them."""
    bin_dir, tmp = tmp_path / "bin", tmp_path / "tmp"
    bin_dir.mkdir(), tmp.mkdir()
    record = tmp_path / "ray_argv.json"
    fake = bin_dir / "ray"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    fake.chmod(0o755)
    out = run_script(
        "recipes/cluster/ray_submit.sh",
        "loss=ctpo",
        PATH=f"{bin_dir}{os.pathsep}{script_env()['PATH']}",
        TMPDIR=str(tmp),
    )
    assert out.returncode == 0, out.stderr
    argv = json.loads(record.read_text())
    assert argv[:2] == ["job", "submit"] and argv[argv.index("--") + 1 :][:3] == ["python3", "-m", "maspo_verl.main"]
    assert "loss=ctpo" in argv
    assert not list(tmp.iterdir()), list(tmp.iterdir())


def test_ray_submit_pip_spec_empty_installs_nothing():
    out = run_script("recipes/cluster/ray_submit.sh", DRY_RUN="1", PIP_SPEC="")
    assert out.returncode == 0, out.stderr
    assert "pip" not in json.loads(_field(out.stdout, "runtime_env"))


def test_ray_submit_pip_spec_override():
    out = run_script("recipes/cluster/ray_submit.sh", DRY_RUN="1", PIP_SPEC="maspo-verl[math]==0.1.0", NO_WAIT="1")
    assert out.returncode == 0, out.stderr
    assert json.loads(_field(out.stdout, "runtime_env"))["pip"] == ["maspo-verl[math]==0.1.0"]
    assert "--no-wait" in shlex.split(out.stdout.splitlines()[1])


def test_slurm_dry_run():
    out = run_script(
        "recipes/cluster/slurm_ray.sbatch",
        "trainer.save_freq=9",
        DRY_RUN="1",
        NODES="gpu-a gpu-b gpu-c",
        HEAD_IP="10.0.0.1",
        GPUS_PER_NODE="4",
        RECIPE="recipes/math/run_grpo.sh",
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = [line for line in lines if "ray start --head" in line]
    assert len(head) == 1 and "-w gpu-a" in head[0] and "--node-ip-address=10.0.0.1" in head[0]
    assert "--num-gpus=4" in head[0] and head[0].rstrip().endswith("&")
    workers = [line for line in lines if "ray start --address=10.0.0.1:6379" in line]
    assert [w.split("-w ")[1].split()[0] for w in workers] == ["gpu-b", "gpu-c"]
    submit = next(line for line in lines if line.startswith("ray job submit"))
    assert "--address http://10.0.0.1:8265" in submit
    entry = shlex.split(_field(out.stdout, "entrypoint"))
    assert "loss=grpo" in entry and "algorithm.rollout_correction.bypass_mode=False" in entry
    assert "trainer.nnodes=3" in entry and "trainer.n_gpus_per_node=4" in entry
    assert entry[-1] == "trainer.save_freq=9"


def test_slurm_needs_nodes_outside_an_allocation():
    out = run_script("recipes/cluster/slurm_ray.sbatch", DRY_RUN="1", SLURM_JOB_NODELIST="")
    assert out.returncode != 0 and "NODES" in out.stderr


@pytest.mark.parametrize("doc", ["docs/cluster.md", "recipes/cluster/README.md"])
def test_cluster_docs_give_the_commands_ci_runs(doc):
    """The commands tests/e2e/test_ray_jobs.py runs against its live head, token authentication included
    (with a token present, Ray's job CLI is refused unless RAY_AUTH_MODE=token)."""
    text = (REPO / doc).read_text()
    order = [
        "ray get-auth-token --generate",
        "ray start --head --num-cpus=16 --num-gpus=1",
        "export RAY_AUTH_MODE=token",
        "ray job submit -- python -m maspo_verl.main local=cpu loss=maspo_fixed",
        "bash recipes/cluster/ray_submit.sh local=cpu",
    ]
    if doc == "docs/cluster.md":  # the full ray_submit.sh command (the knobs that shrink it): the cluster README
        order[-1] = "ray_submit.sh: recipes/cluster/README.md"
    # the head has a temp dir of its own, and only its processes are stopped
    order[1] += ' --temp-dir="$RAY_TMP"'
    order.append('pkill -TERM -f -- "$RAY_TMP"')
    assert not re.search(r"^ray stop\b", text, re.M), "`ray stop` stops every Ray instance of the machine"
    positions = [text.find(command) for command in order]
    assert -1 not in positions, [c for c, p in zip(order, positions, strict=True) if p == -1]
    assert positions == sorted(positions), positions


def test_ray_submit_without_ray_says_what_to_do(tmp_path):
    """No `ray` on PATH (the venv not activated): a clear message instead of `command not found`."""
    (tmp_path / "python3").symlink_to(sys.executable)  # the script's own python3 (stdlib only), and no ray
    out = run_script("recipes/cluster/ray_submit.sh", PATH=f"{tmp_path}:/usr/bin:/bin", PIP_SPEC="")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no `ray` on PATH" in out.stderr and "source .venv/bin/activate" in out.stderr, out.stderr
