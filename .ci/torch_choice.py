"""Which torch build .ci/setup installs, and what it installed (standard library only).

    python .ci/torch_choice.py VERSION      the pip arguments to install torch VERSION, one a line; the
                                            reason on stderr, in one line
    python .ci/torch_choice.py --report     one line: the torch now installed, its build, its size

On a machine with an NVIDIA GPU: torch VERSION from the configured index (PyPI's Linux wheel is the
CUDA build). Without one: the CPU build, whichever way comes first -
1. pip's own configuration already resolves torch VERSION to a CPU build (a local wheel folder or
   mirror): that, as it is;
2. PyTorch's CPU wheel index (``MASPO_TORCH_CPU_INDEX``, default https://download.pytorch.org/whl/cpu)
   answers: ``torch==VERSION+cpu`` from it, the other packages from the configured index;
3. otherwise: torch VERSION from the configured index, i.e. on PyPI the CUDA build (it runs on CPU,
   but weighs about 6 GB with its NVIDIA packages), said in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from importlib import metadata
from pathlib import Path

CPU_INDEX = os.environ.get("MASPO_TORCH_CPU_INDEX", "https://download.pytorch.org/whl/cpu")


def has_nvidia_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia/version").exists()


def reachable(url: str, timeout_s: float = 5.0) -> bool:
    """Whether ``url`` answers at all (an HTTP error status counts: the server is there)."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s).close()
        return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def configured_pick(version: str) -> str | None:
    """The torch version pip's configuration would install for ``torch==version`` (e.g. ``2.13.0+cpu``
    from a local wheel folder); None if pip cannot tell."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "-q"]
        cmd += ["--report", str(report), f"torch=={version}"]
        if subprocess.run(cmd, capture_output=True, text=True).returncode != 0 or not report.is_file():
            return None
        picks = json.loads(report.read_text()).get("install", [])
    return picks[0]["metadata"]["version"] if picks else None


def choose(version: str, gpu: bool, pick: str | None, cpu_index_up: bool) -> tuple[list[str], str]:
    """The pip arguments and the reason, from what was found (a pure function: tested on its own)."""
    plain = [f"torch=={version}"]
    if gpu:
        return plain, f"torch {version}: an NVIDIA GPU is present, so the configured index's build (CUDA on PyPI)"
    if pick is not None and pick.endswith("+cpu"):
        return plain, f"torch {pick}: the CPU build, from pip's configuration"
    if cpu_index_up:
        return [f"torch=={version}+cpu", "--extra-index-url", CPU_INDEX], f"torch {version}+cpu from {CPU_INDEX}"
    return plain, (
        f"torch {version}: no GPU here, but PyTorch's CPU index ({CPU_INDEX}) is not reachable, so the "
        f"configured index's build ({pick or 'unknown'}; on PyPI the CUDA build, about 6 GB with its NVIDIA "
        "packages; it runs on CPU)"
    )


def report() -> str:
    """One line: the installed torch, its build, and the size of torch with its NVIDIA packages."""
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return "torch: not installed"
    site = Path(dist.locate_file(""))
    names = ["torch", "triton", *(p.name for p in site.glob("nvidia*"))]
    size = sum(f.stat().st_size for name in names for f in (site / name).rglob("*") if f.is_file())
    nvidia = [d.metadata["Name"] for d in metadata.distributions() if d.metadata["Name"].startswith("nvidia-")]
    build = "CPU build" if dist.version.endswith("+cpu") else f"CUDA build, with {len(nvidia)} NVIDIA packages"
    if not nvidia and not dist.version.endswith("+cpu"):
        build = "build without NVIDIA packages"
    return f"installed torch {dist.version} ({build}): {size / 1e9:.1f} GB with its packages"


def main(argv: list[str]) -> int:
    if argv == ["--report"]:
        print(report())
        return 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    (version,) = argv
    gpu = has_nvidia_gpu()
    pick = None if gpu else configured_pick(version)
    up = not gpu and not (pick or "").endswith("+cpu") and reachable(CPU_INDEX + "/torch/")
    args, why = choose(version, gpu, pick, up)
    print("\n".join(args))
    print(why, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
