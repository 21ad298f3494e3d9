#!/usr/bin/env bash
# GSPO (verl's gspo, clip 3e-4 / 4e-4, sequence-mean; vLLM log-probs as old log-probs).
# Same knobs as run.sh (MODEL_PATH, N_GPUS_PER_NODE, NNODES, TRAIN_BATCH_SIZE, ..., DRY_RUN=1).
set -euo pipefail
LOSS=${LOSS:-gspo} exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh" "$@"
