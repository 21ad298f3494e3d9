#!/usr/bin/env bash
# GRPO baseline (verl vanilla, token ratios, clip 0.2; old log-probs recomputed, no bypass).
# Same knobs as run.sh (MODEL_PATH, DATA_DIR, N_GPUS_PER_NODE, NNODES, ..., DRY_RUN=1).
set -euo pipefail
LOSS=${LOSS:-grpo} exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh" "$@"
