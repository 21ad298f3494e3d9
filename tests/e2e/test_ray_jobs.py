"""`ray job submit` against a live Ray head: the cluster launcher and the local mode inside a job.

One head for the module, started the way recipes/cluster/README.md says (token authentication,
``--num-cpus=16 --num-gpus=1``), on the loopback interface with its own temp dir and ports, from a
fresh venv in which maspo-verl is installed from its built wheel (not editable): the normal cluster
set-up, where the job's uploaded working dir shadows the installed package. Stopped by PID at the end.

- ``recipes/cluster/ray_submit.sh`` of the math recipe with the local-mode knobs and the repository as
  ``working_dir``: the job SUCCEEDS with 2 training steps, the local mode joins the head (no private
  cluster), and the recipes' default logger writes our metrics into an offline wandb run, read back
  with wandb's own reader (``wandb leet inspect --json``) and equal to the console's.
- ``ray job submit -- python -m maspo_verl.main local=cpu loss=maspo_fixed``, no overrides: the same.
- Two short probe jobs show which copy of the package a job imports, with and without ``--working-dir``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from maspo_verl.lab.engine.runs import ANSI, parse_steps, stop_run
from tests.helpers import REPO
from tests.math.fixtures import LOCAL_SPECS

pytestmark = pytest.mark.e2e

MAIN_BIN = Path(sys.executable).parent  # the client side: `ray job submit` of the test's own venv
JOB_TIMEOUT_S = 540
HEAD_RESOURCES = ["--num-cpus=16", "--num-gpus=1"]  # what the local mode's private cluster gets


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _clean_env() -> dict[str, str]:
    """The test's environment without anything that would steer Ray, the venv or our package."""
    drop = ("RAY_", "MASPO_", "VIRTUAL_ENV", "PYTHONPATH", "WANDB_", "DRY_RUN", "PRINT_")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


@pytest.fixture(scope="module")
def wheel_venv(built_wheel, tmp_path_factory) -> Path:
    """A fresh venv holding maspo-verl from its wheel (built once per session, ``built_wheel``); every
    dependency from the test's venv via a .pth line."""
    root = tmp_path_factory.mktemp("wheel_venv")
    wheel = built_wheel
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    # a plain path line: the test venv's own .pth files (the editable install's finder) are not run
    (site / "zz_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        env=_clean_env(),  # a checkout on PYTHONPATH would be an installed maspo-verl to pip: nothing installed
    )
    probe = (
        "import json, maspo_verl, maspo_verl.util as u, importlib.metadata as md\n"
        "d = md.distribution('maspo-verl')\n"
        "print(json.dumps([maspo_verl.__file__, str(u.config_dir()), d.read_text('direct_url.json')]))\n"
    )
    out = subprocess.run([python, "-c", probe], cwd=root, env=_clean_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    package, configs, direct_url = json.loads(out.stdout.strip().splitlines()[-1])
    assert package.startswith(str(site)) and configs.startswith(str(site)), (package, configs)
    assert not json.loads(direct_url or "{}").get("dir_info", {}).get("editable"), direct_url
    return venv


class Head:
    def __init__(self, venv: Path, root: Path, cache_dir: str):
        self.temp_dir = tempfile.mkdtemp(prefix="mvh_", dir="/tmp")  # short: Ray's socket paths are length-limited
        ports = _free_ports(9)
        self.gcs_port = ports[0]
        self.address = f"http://127.0.0.1:{ports[1]}"
        token = root / "auth_token"
        token.write_text(secrets.token_hex(32))
        # The node's environment (what `ray start` runs with): the venv first on PATH, and a token,
        # which makes `ray start` turn token authentication on (RAY_AUTH_MODE unset, as in the README).
        self.env = _clean_env()
        self.env.update(
            PATH=f"{venv / 'bin'}{os.pathsep}{self.env.get('PATH', '')}",
            VIRTUAL_ENV=str(venv),
            RAY_AUTH_TOKEN_PATH=str(token),
            MASPO_VERL_CACHE=cache_dir,
            PYTHONUNBUFFERED="1",
        )
        cmd = [
            str(venv / "bin" / "python"), "-m", "ray.scripts.scripts", "start", "--head", "--block",
            "--node-ip-address=127.0.0.1", f"--port={ports[0]}",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={ports[1]}",
            f"--ray-client-server-port={ports[2]}", f"--node-manager-port={ports[3]}",
            f"--object-manager-port={ports[4]}", f"--dashboard-agent-listen-port={ports[5]}",
            f"--dashboard-agent-grpc-port={ports[6]}", f"--metrics-export-port={ports[7]}",
            f"--runtime-env-agent-port={ports[8]}",
            f"--temp-dir={self.temp_dir}", "--disable-usage-stats", *HEAD_RESOURCES,
        ]  # fmt: skip
        self.log = root / "head.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=root, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def client_env(self, **extra: str) -> dict[str, str]:
        """A submitting shell: the test venv's `ray` CLI, the head's token file (no RAY_AUTH_MODE)."""
        env = _clean_env()
        env.update(
            PATH=f"{MAIN_BIN}{os.pathsep}{env.get('PATH', '')}",
            RAY_AUTH_TOKEN_PATH=self.env["RAY_AUTH_TOKEN_PATH"],
            RAY_ADDRESS=self.address,
        )
        env.update(extra)
        return env

    def ray(self, *args: str, timeout: float = 60, auth: bool = True) -> subprocess.CompletedProcess:
        """`ray ARGS` from a submitting shell, with RAY_AUTH_MODE=token (auth) or without it."""
        return subprocess.run(
            [str(MAIN_BIN / "ray"), *args],
            env=self.client_env(RAY_AUTH_MODE="token") if auth else self.client_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"ray start exited {self.proc.returncode}:\n{self.log.read_text()[-4000:]}"
            if self.ray("job", "list", timeout=30).returncode == 0:
                # token authentication is on: without RAY_AUTH_MODE=token the job CLI is refused
                refused = self.ray("job", "list", timeout=30, auth=False)
                assert refused.returncode != 0 and "AuthenticationError" in refused.stdout + refused.stderr, refused
                return
            time.sleep(2)
        raise AssertionError(f"Ray head not ready in {timeout_s}s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        stop_run(self.proc, self.temp_dir)  # the `ray start --block` group, then every process of this head
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def status(self, job_id: str) -> str:
        """The job's status as `ray job status` words it (SUCCEEDED, FAILED, ...)."""
        out = self.ray("job", "status", job_id)
        text = ANSI.sub("", out.stdout)
        found = re.search(rf"Job '{re.escape(job_id)}' (succeeded|failed|stopped)|Status for job .*: (\w+)", text)
        return (found.group(1) or found.group(2)).upper() if found else f"unknown: {text}{out.stderr}"

    def logs(self, job_id: str) -> str:
        return self.ray("job", "logs", job_id, timeout=120).stdout


@pytest.fixture(scope="module")
def head(wheel_venv, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray_head")
    head = Head(wheel_venv, root, str(tmp_path_factory.mktemp("maspo_cache")))
    try:
        head.wait_ready()
        yield head
    finally:
        head.stop()


def _submit(head: Head, cmd: list[str], job_id: str, env: dict[str, str], log: Path) -> tuple[str, str]:
    """Run a blocking submission; (final status, the job's logs)."""
    try:
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        log.write_text(out.stdout + out.stderr)
    except subprocess.TimeoutExpired:
        head.ray("job", "stop", job_id)
        raise
    logs = head.logs(job_id)
    return head.status(job_id), logs


def _check_two_steps(status: str, logs: str, head: Head, submit_log: Path) -> dict[int, dict[str, float]]:
    ours = [line for line in logs.splitlines() if "maspo_verl local=" in line or "ray init kwargs" in line]
    tail = "\n".join(logs.splitlines()[-80:])
    context = (
        f"\n--- ours ---\n{chr(10).join(ours)}\n--- job logs tail ---\n{tail}"
        f"\n--- submit ---\n{submit_log.read_text()[-3000:]}"
    )
    assert status == "SUCCEEDED", f"job status {status}{context}"
    steps = parse_steps(logs)
    assert sorted(steps) == [1, 2], f"logged steps {sorted(steps)}{context}"
    # the local mode joined the head (Ray names it by the host's address) rather than starting its own
    assert re.search(rf"ray_address=\S+:{head.gcs_port}\s", logs), context
    assert "Started a local Ray instance" not in logs, context
    return steps


def _wandb_history(run_file: Path) -> dict[int, dict]:
    """The run's history rows by step, read with wandb's own reader of .wandb transaction logs."""
    out = subprocess.run(
        [str(MAIN_BIN / "wandb"), "leet", "inspect", "--json", str(run_file)],
        env={**_clean_env(), "WANDB_MODE": "offline"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {}
    for line in out.stdout.splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            item = record["history"]["item"]
            rows[int(item["_step"])] = item
    return rows


def test_ray_submit_recipe_local_mode(head, tmp_path):
    """The math recipe through recipes/cluster/ray_submit.sh, shrunk to the local mode by its knobs."""
    from maspo_verl.local import assets
    from maspo_verl.math import prepare

    data = tmp_path / "data"
    argv = ["--out-dir", str(data), "--only-local"]
    for spec in LOCAL_SPECS:
        argv += ["--local", spec]
    assert prepare.main(argv) == 0
    model = assets.ensure_assets(seed=0, cache_dir=head.env["MASPO_VERL_CACHE"])["model"]
    job_id = f"maspo-recipe-{secrets.token_hex(3)}"
    knobs = dict(
        RECIPE="recipes/math/run.sh",
        LOSS="maspo_fixed",
        PIP_SPEC="",  # the nodes' venv has the package (from its wheel)
        SUBMISSION_ID=job_id,
        WANDB_MODE="offline",  # forwarded by ray_submit.sh; the recipe's default logger has wandb
        MODEL_PATH=model,
        TRAIN_FILES=f"['{data / 'gsm8k_train.parquet'}','{data / 'math_train.parquet'}']",
        VAL_FILES=f"['{data / 'math500_test.parquet'}']",
        NNODES="1",
        N_GPUS_PER_NODE="1",
        TRAIN_BATCH_SIZE="4",
        ROLLOUT_N="4",
        PPO_MINI_BATCH_SIZE="2",
        MAX_PROMPT_LENGTH="384",
        MAX_RESPONSE_LENGTH="32",
        TOTAL_EPOCHS="2",  # 6 training prompts: one batch of 4 per epoch
        TOTAL_TRAINING_STEPS="2",
        TEST_FREQ="-1",
        SAVE_FREQ="-1",
    )
    cmd = [
        "bash",
        str(REPO / "recipes/cluster/ray_submit.sh"),
        "local=cpu",
        "maspo.quiet=false",  # verl's own console line, every metric, to compare with wandb's
        "actor_rollout_ref.actor.policy_loss.segment_window=4",
        "actor_rollout_ref.rollout.ignore_eos=true",
    ]
    submit_log = tmp_path / "submit.log"
    status, logs = _submit(head, cmd, job_id, head.client_env(**knobs), submit_log)
    steps = _check_two_steps(status, logs, head, submit_log)
    # the job ran the uploaded checkout, whose package shadows the venv's wheel
    for step, metrics in steps.items():
        assert metrics["actor/ratio/segments_per_seq"] == pytest.approx(32 / 4, abs=1e-4), f"step {step}"

    # the recipes' default logger: an offline wandb run in the job's working dir on the node
    runs = {p.resolve() for p in Path(head.temp_dir).glob("session_*/runtime_resources/**/offline-run-*/run-*.wandb")}
    (run_file,) = runs  # session_latest links the session dir: one run, found twice
    history = _wandb_history(run_file)
    assert sorted(history) == [1, 2], sorted(history)
    for step, metrics in steps.items():
        ours = {k: v for k, v in metrics.items() if k.startswith("actor/ratio/")}
        assert {"actor/ratio/segments_per_seq", "actor/ratio/clipfrac_pos1of4", "actor/ratio/clipfrac_pos4of4"} <= set(
            ours
        ), sorted(ours)
        for key, value in ours.items():
            assert history[step][key] == pytest.approx(value, rel=1e-3, abs=1e-6), (step, key)


@pytest.mark.slow
def test_plain_submit_local_mode_no_overrides(head, tmp_path):
    """The README's command as is: no working dir, no Ray overrides; the venv's wheel runs it."""
    job_id = f"maspo-plain-{secrets.token_hex(3)}"
    cmd = [
        str(MAIN_BIN / "ray"), "job", "submit", "--address", head.address, "--submission-id", job_id,
        "--", "python", "-m", "maspo_verl.main", "local=cpu", "loss=maspo_fixed",
    ]  # fmt: skip
    submit_log = tmp_path / "submit.log"
    status, logs = _submit(head, cmd, job_id, head.client_env(RAY_AUTH_MODE="token"), submit_log)
    _check_two_steps(status, logs, head, submit_log)


@pytest.mark.parametrize("working_dir", [False, True])
def test_which_package_a_job_imports(head, wheel_venv, working_dir):
    """Without a working dir a job imports the venv's wheel; with one, the uploaded copy, which has its configs."""
    probe = "import maspo_verl.util as u; print('CONFIGS_' 'AT=' + str(u.config_dir()))"  # not in the echoed command
    cmd = [str(MAIN_BIN / "ray"), "job", "submit", "--address", head.address]
    if working_dir:
        cmd += ["--working-dir", str(REPO), "--runtime-env-json", json.dumps({"excludes": [".git", ".venv", "tests"]})]
    out = subprocess.run(
        [*cmd, "--", "python", "-c", probe],
        env=head.client_env(RAY_AUTH_MODE="token"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    path = next(line for line in out.stdout.splitlines() if line.startswith("CONFIGS_AT="))[len("CONFIGS_AT=") :]
    if working_dir:
        assert path.startswith(head.temp_dir) and "runtime_resources" in path, path
    else:
        assert path.startswith(str(wheel_venv)), path
