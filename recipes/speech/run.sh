#!/usr/bin/env bash
# Llasa TTS RL, one or more nodes, FSDP2 training + vLLM rollout + XCodec2/Whisper reward, any loss preset:
#   LOSS=<maspo_fixed|maspo_logprob|maspo_tokenval|maspo_words|grpo|gspo> bash recipes/speech/run.sh [hydra overrides]
# Knobs (environment): see recipes/speech/common.sh and README.md. DRY_RUN=1 composes and validates only.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

maspo_speech_launch \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.ref.strategy=fsdp2 \
    "actor_rollout_ref.actor.fsdp_config.param_offload=$PARAM_OFFLOAD" \
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=$PARAM_OFFLOAD" \
    "$@"
