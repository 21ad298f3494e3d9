#!/usr/bin/env bash
# MASPO at forking tokens (the 20 % most surprising tokens under the old policy start segments;
# vLLM log-probs as old log-probs). Same knobs as run.sh (MODEL_PATH, ..., DRY_RUN=1).
set -euo pipefail
LOSS=${LOSS:-maspo_surprisal} exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh" "$@"
