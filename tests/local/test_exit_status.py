"""How the command line ends a local run a signal stopped (``maspo_verl.main.cli``): the session's clean-up and
closing block, whose error line names the signal, then exit status 128 + the signal's number (130 for Ctrl-C,
143 for SIGTERM) and no traceback. A fresh interpreter each (~10 s): the real signal handlers, no Ray."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

# the run itself replaced by one that is stopped by `signal` inside the local mode's session
STOPPED_RUN = """
import os, signal, sys, time
from maspo_verl import local, main

sig, run_dir = signal.Signals[sys.argv[1]], sys.argv[2]

def run(config):
    with local.session(config):
        os.kill(os.getpid(), sig)
        time.sleep(60)

main.run = run
sys.argv = ["maspo_verl.main", "local=cpu", "hydra.run.dir=" + run_dir]
main.cli()
"""


@pytest.mark.parametrize("sig, said", [(signal.SIGINT, "SIGINT (Ctrl-C)"), (signal.SIGTERM, "SIGTERM")])
def test_a_run_stopped_by_a_signal_exits_128_plus_its_number_without_a_traceback(tmp_path, sig, said):
    # SIGINT as a terminal delivers it (a shell without job control starts background jobs ignoring it)
    out = subprocess.run(
        [sys.executable, "-c", STOPPED_RUN, sig.name, str(tmp_path / "run")],
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
