#!/usr/bin/env bash
# MASPO log-prob-drop segments (per-sample z-score, 3..50 tokens).
# Same knobs as run.sh (MODEL_PATH, DATA_DIR, N_GPUS_PER_NODE, NNODES, ..., DRY_RUN=1).
set -euo pipefail
LOSS=${LOSS:-maspo_logprob} exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh" "$@"
