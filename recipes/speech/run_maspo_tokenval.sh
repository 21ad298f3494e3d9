#!/usr/bin/env bash
# MASPO codec-token segments (FSQ digit L1 distance between neighbouring XCodec2 codes).
# Same knobs as run.sh (MODEL_PATH, DATA_DIR, N_GPUS_PER_NODE, NNODES, ..., DRY_RUN=1).
set -euo pipefail
LOSS=${LOSS:-maspo_tokenval} exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh" "$@"
