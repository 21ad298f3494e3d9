"""A lab command stopped by SIGTERM stops the trainer run it started: nothing is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# ``lab learn`` with its trainer replaced by a process that writes its pid and sleeps
DRIVER = """
import runpy, sys
from maspo_verl.lab.engine import runs
child = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(300)"
pid_file = sys.argv[1]
runs.local_command = lambda overrides, run_dir, ray_dir=None: [sys.executable, "-c", child, pid_file]
sys.argv = [sys.argv[0], *sys.argv[2:]]
runpy.run_module("maspo_verl.lab", run_name="__main__", alter_sys=True)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_stops_the_trainer_run_and_its_folders(tmp_path):
    pid_file, tmp = tmp_path / "child.pid", tmp_path / "tmp"
    tmp.mkdir()
    argv = ["learn", "--out", str(tmp_path / "out"), "--tasks", "text", "--seeds", "1", "--losses", "grpo"]
    lab = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(pid_file), *argv],
        env=os.environ | {"TMPDIR": str(tmp)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert lab.poll() is None, lab.stdout.read()
            assert time.monotonic() < deadline, "the trainer stand-in never started"
            time.sleep(0.2)
        child = int(pid_file.read_text())
        assert _alive(child)
        lab.send_signal(signal.SIGTERM)
        out, _ = lab.communicate(timeout=60)
        assert lab.returncode == 128 + signal.SIGTERM, out
        assert out.rstrip().endswith("python -m maspo_verl.lab: stopped by SIGTERM"), out
        assert not _alive(child), "the trainer run outlived the lab command"
        assert not [p.name for p in Path(tmp).iterdir() if p.name.startswith("maspo_learn_logs_")]
    finally:  # a failed run leaves nothing behind either
        lab.kill()
        if pid_file.exists() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_stop_as_the_trainer_starts_leaves_nothing_running(tmp_path, monkeypatch):
    """A SIGTERM or Ctrl-C that lands between the trainer's start and the wait for it (planted: the CPU poller's
    start raises) still stops the trainer and removes its Ray temp dir."""
    import pytest

    from maspo_verl.lab.engine import runs

    started, made, real_popen, real_mkdtemp = [], [], subprocess.Popen, runs.tempfile.mkdtemp

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    def stop(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(
        runs, "local_command", lambda o, d, r=None: [sys.executable, "-c", "import time; time.sleep(300)"]
    )
    monkeypatch.setattr(runs.subprocess, "Popen", popen)
    monkeypatch.setattr(runs.tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(dir=tmp_path)) or made[-1])
    monkeypatch.setattr(runs._RunCPU, "start", stop)
    with pytest.raises(KeyboardInterrupt):
        runs.run_local([], tmp_path / "run")
    (proc,) = started
    assert proc.poll() is not None and not _alive(proc.pid)
    assert made and not Path(made[0]).exists()
