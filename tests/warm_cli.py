"""``python -m maspo_verl.main ARGS`` for the tests of what the command line refuses or says at start-up, each in a
fresh process forked from one that has imported the command already: importing verl takes ~12 CPU-seconds, a
refusal well under one. The child runs the module as ``python -m`` does (``runpy``, as ``__main__``, its exit
handlers at the end) in the given folder and environment, with its own stdout and stderr; its exit status is the
command's. One warm process per test process, made with the environment of its first command; a command whose
environment differs in anything but ``READ_WHEN_RUN`` (verl, Hugging Face and Ray read some variables on import)
runs as a plain subprocess, as does every command where the warm process cannot start."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

MODULE = "maspo_verl.main"
# read when a command runs, never on import: our cache folder, and pytest's name of the test (set for each test)
READ_WHEN_RUN = {"MASPO_VERL_CACHE", "PYTEST_CURRENT_TEST"}

WARM = r"""
import atexit, json, os, runpy, sys
import maspo_verl.main  # noqa: F401  (what every command imports first)
del sys.modules["maspo_verl.main"]  # its imports stay; the module itself runs as __main__, as with python -m
reply = os.fdopen(os.dup(1), "w")
reply.write(json.dumps({"ready": True}) + "\n"); reply.flush()
for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
                out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(out, fd)
                os.close(out)
            os.chdir(job["cwd"])
            os.environ.clear()
            os.environ.update(job["env"])
            sys.argv = [job["module"], *job["args"]]
            try:
                runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as exc:
                if exc.code is None or isinstance(exc.code, int):
                    code = exc.code or 0
                else:
                    print(exc.code, file=sys.stderr)
            except BaseException:
                import traceback
                traceback.print_exc()
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    reply.write(json.dumps({"pid": pid}) + "\n"); reply.flush()
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n"); reply.flush()
"""


class _Warm:
    def __init__(self, env: dict[str, str]):
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-c", WARM], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, text=True)  # fmt: skip
        self.ok = self._reply(600).get("ready", False)

    def _reply(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        return json.loads(line) if line else {}

    def takes(self, env: dict[str, str]) -> bool:
        def key(e):
            return {k: v for k, v in e.items() if k not in READ_WHEN_RUN}

        return self.ok and self.proc.poll() is None and key(env) == key(self.env)

    def run(self, args, cwd, env, timeout) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            job = {"module": MODULE, "args": list(args), "cwd": str(cwd), "env": env, "stdout": str(out),
                   "stderr": str(err)}  # fmt: skip
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            pid = self._reply(60)["pid"]
            done = self._reply(timeout)
            if "status" not in done:
                os.kill(pid, signal.SIGKILL)
                self._reply(60)
                raise subprocess.TimeoutExpired([MODULE, *args], timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess([MODULE, *args], done["status"], out.read_text(), err.read_text())

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


_warm: _Warm | None = None


def run_main(args, cwd, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m maspo_verl.main ARGS`` in ``cwd`` with ``env`` (default: this process's), captured as text."""
    global _warm
    env = dict(os.environ if env is None else env)
    if _warm is None:
        _warm = _Warm(env)
        atexit.register(_warm.close)
    if _warm.takes(env):
        return _warm.run(args, cwd, env, timeout)
    return subprocess.run([sys.executable, "-m", MODULE, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
