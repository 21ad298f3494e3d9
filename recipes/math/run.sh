#!/usr/bin/env bash
# One node, FSDP2 training + vLLM rollout, any loss preset: LOSS=<preset> bash recipes/math/run.sh [overrides]
# Knobs (environment): see recipes/math/common.sh and recipes/math/README.md. DRY_RUN=1 composes only.
set -euo pipefail
# shellcheck source=recipes/math/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

maspo_math_launch \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.ref.strategy=fsdp2 \
    "actor_rollout_ref.actor.fsdp_config.param_offload=$PARAM_OFFLOAD" \
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=$PARAM_OFFLOAD" \
    "$@"
