#!/usr/bin/env bash
# MASPO fixed windows, SEGMENT_WINDOW=5 (phoneme) / 15 (syllable, default) / 50 (phrase).
# Same knobs as run.sh (MODEL_PATH, DATA_DIR, N_GPUS_PER_NODE, NNODES, ..., DRY_RUN=1).
set -euo pipefail
LOSS=${LOSS:-maspo_fixed} exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh" "$@"
