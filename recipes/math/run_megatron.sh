#!/usr/bin/env bash
# Megatron (megatron-core) training + vLLM rollout for a larger model, any loss preset.
# Composes hydra_configs/maspo_megatron_trainer.yaml (verl's ppo_megatron_trainer + our presets).
set -euo pipefail
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-8B}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-7168}
ROLLOUT_TP=${ROLLOUT_TP:-2}
CONFIG_NAME=maspo_megatron_trainer
# shellcheck source=recipes/math/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ACTOR_TP=${ACTOR_TP:-2}
ACTOR_PP=${ACTOR_PP:-1}
ACTOR_CP=${ACTOR_CP:-1}

maspo_math_launch \
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=$ACTOR_TP" \
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=$ACTOR_PP" \
    "actor_rollout_ref.actor.megatron.context_parallel_size=$ACTOR_CP" \
    "actor_rollout_ref.actor.megatron.param_offload=$PARAM_OFFLOAD" \
    "actor_rollout_ref.actor.megatron.optimizer_offload=$PARAM_OFFLOAD" \
    "$@"
