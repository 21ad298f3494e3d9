#!/usr/bin/env bash
# GSPO baseline (verl gspo, sequence ratio, clip 3e-4/4e-4).
# Same knobs as run.sh (MODEL_PATH, DATA_DIR, N_GPUS_PER_NODE, NNODES, ..., DRY_RUN=1).
set -euo pipefail
LOSS=${LOSS:-gspo} exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh" "$@"
