"""``python -m maspo_verl check``: import, register and report, without relying on verl's plugin loader."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys


def check() -> int:
    """Report whether verl auto-loads the plugin, what is registered, and the two hooks."""
    report: dict = {"python": sys.executable}
    try:
        import verl

        report["verl"] = verl.__version__
    except Exception as exc:  # noqa: BLE001 - reported to the user
        print(json.dumps({**report, "ok": False, "error": f"import verl failed: {exc!r}"}, indent=2))
        return 1
    eps = [ep for ep in importlib.metadata.entry_points(group="verl.plugins") if ep.value.startswith("maspo_verl")]
    report["entry_point"] = [f"{ep.name} = {ep.value}" for ep in eps] or None
    report["plugins_policy"] = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto")
    # Would a fresh `import verl` (as in a Ray worker) register our losses by itself?
    probe = (
        "import verl, json; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R, "
        "ADV_ESTIMATOR_REGISTRY as A; "
        "print(json.dumps([n for n in ('maspo', 'ctpo', 'pgspo') if n in R] + "
        "[n for n in ('maspo_span_grpo',) if n in A]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    report["autoload_registers"] = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    try:
        import maspo_verl
        from maspo_verl.verl_glue import hook_problem, token_scores_problem, verl_version_problem

        report["registered"] = list(maspo_verl.REGISTERED_LOSSES)
        report["verl_version_ok"] = verl_version_problem() is None
        report["token_id_hook"] = hook_problem() or "installed"
        report["token_scores_hook"] = token_scores_problem() or "installed"
    except Exception as exc:  # noqa: BLE001 - reported to the user
        report["error"] = f"import maspo_verl failed: {exc!r}"
    report["ok"] = (
        "error" not in report
        and report.get("autoload_registers") == ["maspo", "ctpo", "pgspo", "maspo_span_grpo"]
        and report.get("token_id_hook") == "installed"
        and report.get("token_scores_hook") == "installed"
    )
    print(json.dumps(report, indent=2))
    if not report["ok"]:
        print(
            "maspo_verl check FAILED: verl will not find our losses or estimator (or a hook is missing) "
            "in a run started with plain `import verl`.",
            file=sys.stderr,
        )
    return 0 if report["ok"] else 1


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maspo_verl")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="import, register and report the plugin's state")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check()
    return 2


if __name__ == "__main__":
    sys.exit(cli())
