"""``python -m maspo_verl.lab {estimators,race,credit,bench,steptime,learn,segments} [--out DIR] [options]``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m maspo_verl.lab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from maspo_verl.lab import bench, credit, estimators, learn, race, segments, steptime

    for name, module, help_ in [
        ("estimators", estimators, "exact bias/variance of each ratio estimator by enumeration"),
        ("race", race, "toy GRPO race of verl's and our losses (speech-like vs text-like task)"),
        ("credit", credit, "span credit vs GRPO advantages: gradient variance and a race on per-span-error tasks"),
        ("bench", bench, "forward+backward time, peak memory and host syncs of each loss"),
        ("steptime", steptime, "local trainer step time of each loss preset vs grpo (writes next to bench)"),
        ("learn", learn, "each loss preset on verl's real trainer (local CPU mode): reward per step on toy tasks"),
        (
            "segments",
            segments,
            "see and calibrate the segmentation (inspect files or code sequences): plots, "
            "word-boundary F1, suggested thresholds",
        ),
    ]:
        p = sub.add_parser(name, help=help_)
        default = getattr(module, "OUT", name)
        p.add_argument("--out", default=None, help=f"output folder (default docs/results/{default})")
        module.add_arguments(p)
        p.set_defaults(module=module)
    args = parser.parse_args(argv)
    args.module.run(args, argv)


if __name__ == "__main__":
    main()
