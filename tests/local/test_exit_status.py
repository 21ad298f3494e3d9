"""How the command line ends a local run a signal stopped (``maspo_verl.main.cli``): the session's clean-up and
closing block, whose error line names the signal, then exit status 128 + the signal's number (130 for Ctrl-C,
143 for SIGTERM), no traceback and nothing left (the run's temp dir, a process of its cluster, its shared
memory). A fresh interpreter each (~10 s): the real signal handlers, no Ray (a trainer run stopped by each signal:
tests/e2e/test_local_vllm.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from maspo_verl.local.cleanup import SHM, processes_naming

# the run itself replaced by one that is stopped by `signal` inside the local mode's session
STOPPED_RUN = """
import os, signal, subprocess, sys, time
from maspo_verl import main
from maspo_verl.local.mode import LocalMode
from maspo_verl.local.ray_cluster import CREATED_TEMP_DIRS

sig, run_dir, temp, shm = signal.Signals[sys.argv[1]], sys.argv[2], sys.argv[3], sys.argv[4]

def run(config):
    with LocalMode(config).session():
        # what a run leaves while it runs: its private cluster's temp dir, a process of it, shared memory
        os.makedirs(temp)
        CREATED_TEMP_DIRS.append(temp)
        subprocess.Popen(["sleep", "600"], env={**os.environ, "TMPDIR": temp}, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        open(shm, "w").close()
        os.kill(os.getpid(), sig)
        time.sleep(60)

main.run = run
sys.argv = ["maspo_verl.main", "local=cpu", "hydra.run.dir=" + run_dir]
main.cli()
"""


@pytest.mark.parametrize("sig, said", [(signal.SIGINT, "SIGINT (Ctrl-C)"), (signal.SIGTERM, "SIGTERM")])
def test_a_run_stopped_by_a_signal_exits_128_plus_its_number_without_a_traceback(tmp_path, sig, said):
    # SIGINT as a terminal delivers it (a shell without job control starts background jobs ignoring it)
    temp = tempfile.mkdtemp(prefix="maspo_ray_test_", dir="/tmp")  # as the local mode names its cluster's
    os.rmdir(temp)
    shm = SHM / f"psm_maspo_test_{os.getpid()}_{sig.name}"
    out = subprocess.run(
        [sys.executable, "-c", STOPPED_RUN, sig.name, str(tmp_path / "run"), temp, str(shm)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    console = out.stdout + out.stderr
    assert out.returncode == 128 + sig, console[-3000:]
    assert {130: signal.SIGINT, 143: signal.SIGTERM}[out.returncode] == sig  # what a shell reports for it
    assert "Traceback" not in console, console[-3000:]
    block = out.stdout[out.stdout.index("==== maspo_verl local run FAILED") :].splitlines()
    assert block[1] == f"error        KeyboardInterrupt: the run was stopped by {said}", block
    assert block[-1].startswith("checkpoints  ") and not out.stderr.strip(), console[-3000:]  # the block is last
    left = (processes_naming(temp), os.path.exists(temp), shm.exists())
    for pid in left[0]:  # not to disturb other tests; the assertion below still sees them
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(temp, ignore_errors=True)
    shm.unlink(missing_ok=True)
    assert left == ([], False, False)
