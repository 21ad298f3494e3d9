#!/usr/bin/env bash
# MASPO, one ratio per reasoning step or sentence (segments end after line breaks and sentence ends,
# resolved against MODEL_PATH's tokenizer at start-up; vLLM log-probs as old log-probs).
# Same knobs as run.sh (MODEL_PATH, N_GPUS_PER_NODE, NNODES, TRAIN_BATCH_SIZE, ..., DRY_RUN=1).
set -euo pipefail
LOSS=${LOSS:-maspo_steps} exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh" "$@"
