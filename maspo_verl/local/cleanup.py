"""What a local run leaves behind, removed when it ends however it ends (``run_log.session``): the driver's
connection to Ray, the private cluster's processes and temp dirs, the shared memory of its killed processes."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

SHM = Path("/dev/shm")
# what a run's processes leave in /dev/shm when they are killed: Python's shared memory (vLLM's engine and
# workers), verl's weight-sync buffer (its naive checkpoint engine), multiprocessing's semaphores
SHM_PREFIXES = ("psm_", "verl_weights_", "sem.mp-")


def shm_names() -> set[str]:
    with contextlib.suppress(OSError):
        return {p.name for p in SHM.iterdir()}
    return set()


def held_shm() -> set[str]:
    """/dev/shm names some live process has open or mapped, matched by inode: a process maps a POSIX semaphore
    (multiprocessing's ``sem.mp-*``) under the temporary name glibc created it with, since deleted, so its
    mapping never shows the name another process opens it by."""
    inodes = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd).startswith("/dev/shm/"):
                        inodes.add(os.stat(fd).st_ino)
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    inodes.add(int(fields[4]))
    held = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir(SHM):
            with contextlib.suppress(OSError):
                if entry.inode() in inodes:
                    held.add(entry.name)
    return held


def remove_shm_leftovers(before: set[str]) -> list[str]:
    """Remove the shared-memory files of ``SHM_PREFIXES`` that appeared since ``before`` and that no live process
    holds (this run's processes are gone; another job's files stay: they are held or were there before)."""
    new = [n for n in shm_names() - before if n.startswith(SHM_PREFIXES)]
    if not new:
        return []
    held = held_shm()
    removed = []
    for name in new:
        if name in held:
            continue
        with contextlib.suppress(FileNotFoundError):
            (SHM / name).unlink()
            removed.append(name)
    return removed


def stop_ray(temp_dirs: list[str]) -> None:
    """Disconnect the driver from Ray, still inside the session: Ray prints the worker lines its log
    de-duplication held back then, so they reach run.log before the closing block. Shut down the
    cluster this driver started, end the processes of it that outlive that (Ray's workers and vLLM's
    processes, which name its temp dir in their command line or environment) and remove its temp dirs (none
    when it joined one)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    for folder in list(temp_dirs):
        end_processes_naming(folder)
        for _ in range(10):  # the cluster's processes may still be writing their last logs
            shutil.rmtree(folder, ignore_errors=True)
            if not os.path.exists(folder):
                break
            time.sleep(0.5)
        temp_dirs.remove(folder)


def processes_naming(text: str) -> list[int]:
    """Other processes whose command line or environment contains ``text``."""
    found, needle = [], text.encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "cmdline").read_bytes() or needle in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def end_processes_naming(folder: str, grace_s: float = 10.0) -> None:
    """SIGTERM, then after ``grace_s`` SIGKILL, the processes of the private cluster in ``folder``; returns once they
    are gone (their shared memory is then free to remove) or 5 s after the SIGKILL."""
    deadline = time.monotonic() + grace_s
    sig = signal.SIGTERM
    while True:
        left = processes_naming(folder)
        if not left or time.monotonic() > deadline + 5:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        time.sleep(0.5)
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
