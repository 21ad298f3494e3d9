#!/usr/bin/env bash
# CTPO-LA (cumulative prefix ratio, length-adaptive log-space clip; vLLM log-probs as old log-probs).
# Same knobs as run.sh (MODEL_PATH, N_GPUS_PER_NODE, NNODES, TRAIN_BATCH_SIZE, ..., DRY_RUN=1).
set -euo pipefail
LOSS=${LOSS:-ctpo} exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh" "$@"
