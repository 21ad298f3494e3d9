# shellcheck shell=bash
# Shared by the recipes/math/run*.sh scripts (sourced, not run): environment variables -> Hydra
# overrides for `python -m maspo_verl.main`. Loss hyperparameters live in hydra_configs/loss/<LOSS>.yaml;
# everything here is a knob you can set in the environment. Extra arguments are appended as
# further Hydra overrides (they win).

# ---- what to train ---------------------------------------------------------------------------
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-Math-1.5B}
LOSS=${LOSS:-gspo}                                    # grpo gspo ctpo pgspo maspo_fixed maspo_logprob ...
CONFIG_NAME=${CONFIG_NAME:-maspo_trainer}             # maspo_megatron_trainer for Megatron
DATA_DIR=${DATA_DIR:-$HOME/data/maspo_math}           # written by python -m maspo_verl.math.prepare
TRAIN_FILES=${TRAIN_FILES:-"['$DATA_DIR/math_train.parquet']"}
VAL_FILES=${VAL_FILES:-"['$DATA_DIR/math500_test.parquet','$DATA_DIR/aime24_test.parquet','$DATA_DIR/aime25_test.parquet']"}

# ---- cluster shape ---------------------------------------------------------------------------
NNODES=${NNODES:-1}
N_GPUS_PER_NODE=${N_GPUS_PER_NODE:-8}

# ---- batch, lengths, optimiser ---------------------------------------------------------------
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-128}             # prompts per step
ROLLOUT_N=${ROLLOUT_N:-8}                             # responses per prompt (the GRPO group)
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-32}        # prompts per optimiser step
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-1024}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-3072}      # Qwen2.5-Math has a 4k context
PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-$(( (MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH) * 4 ))}
ACTOR_LR=${ACTOR_LR:-1e-6}
PARAM_OFFLOAD=${PARAM_OFFLOAD:-False}                 # True for FSDP param/optimizer CPU offload

# ---- rollout (vLLM) --------------------------------------------------------------------------
ROLLOUT_TP=${ROLLOUT_TP:-1}
ROLLOUT_GPU_MEM_UTIL=${ROLLOUT_GPU_MEM_UTIL:-0.6}
TEMPERATURE=${TEMPERATURE:-1.0}
VAL_N=${VAL_N:-4}                                     # samples per validation prompt (mean@N)
VAL_TEMPERATURE=${VAL_TEMPERATURE:-0.6}
# Sequence/segment losses use the engine's log-probs as old log-probs (no recompute pass);
# the token-level GRPO baseline recomputes them with the trainer.
if [ -z "${BYPASS_MODE:-}" ]; then
    case "$LOSS" in grpo) BYPASS_MODE=False ;; *) BYPASS_MODE=True ;; esac
fi

# ---- schedule, logging, checkpoints ----------------------------------------------------------
TOTAL_EPOCHS=${TOTAL_EPOCHS:-10}
TOTAL_TRAINING_STEPS=${TOTAL_TRAINING_STEPS:-null}
TEST_FREQ=${TEST_FREQ:-10}
SAVE_FREQ=${SAVE_FREQ:-50}
MODEL_SLUG=$(basename "$MODEL_PATH" | tr '[:upper:]' '[:lower:]')
PROJECT_NAME=${PROJECT_NAME:-maspo-math-$MODEL_SLUG}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-$LOSS-$MODEL_SLUG-${NNODES}x$N_GPUS_PER_NODE}
LOGGER=${LOGGER:-'["console","wandb"]'}               # WANDB_MODE=offline keeps wandb local
CKPT_DIR=${CKPT_DIR:-checkpoints/$PROJECT_NAME/$EXPERIMENT_NAME}

# shellcheck source=recipes/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/../launch.sh"
recipe_overrides math
MATH_OVERRIDES=("${RECIPE_OVERRIDES[@]}")

maspo_math_launch() { maspo_launch "${MATH_OVERRIDES[@]}" "$@"; }
