#!/usr/bin/env bash
# MASPO word segments: one ratio per word the reward's ASR recognised (tokenval for samples without
# word times). Add `credit=span` for the full setting. Same knobs as run.sh (DRY_RUN=1 included).
set -euo pipefail
LOSS=${LOSS:-maspo_words} exec bash "$(dirname "${BASH_SOURCE[0]}")/run.sh" "$@"
