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
RESUME_MODE=${RESUME_MODE:-auto}                      # auto | disable | resume_path

MATH_OVERRIDES=(
    "loss=$LOSS"
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    "algorithm.rollout_correction.bypass_mode=$BYPASS_MODE"
    "data.train_files=$TRAIN_FILES"
    "data.val_files=$VAL_FILES"
    "data.train_batch_size=$TRAIN_BATCH_SIZE"
    "data.max_prompt_length=$MAX_PROMPT_LENGTH"
    "data.max_response_length=$MAX_RESPONSE_LENGTH"
    data.filter_overlong_prompts=True
    data.truncation=error
    "actor_rollout_ref.model.path=$MODEL_PATH"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.model.enable_gradient_checkpointing=True
    "actor_rollout_ref.actor.optim.lr=$ACTOR_LR"
    "actor_rollout_ref.actor.ppo_mini_batch_size=$PPO_MINI_BATCH_SIZE"
    actor_rollout_ref.actor.use_dynamic_bsz=True
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$PPO_MAX_TOKEN_LEN_PER_GPU"
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.calculate_log_probs=True
    "actor_rollout_ref.rollout.n=$ROLLOUT_N"
    "actor_rollout_ref.rollout.temperature=$TEMPERATURE"
    "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP"
    "actor_rollout_ref.rollout.gpu_memory_utilization=$ROLLOUT_GPU_MEM_UTIL"
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$PPO_MAX_TOKEN_LEN_PER_GPU"
    "actor_rollout_ref.rollout.val_kwargs.n=$VAL_N"
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    "actor_rollout_ref.rollout.val_kwargs.temperature=$VAL_TEMPERATURE"
    actor_rollout_ref.rollout.val_kwargs.top_p=0.95
    reward.custom_reward_function.path=pkg://maspo_verl.math.reward
    reward.custom_reward_function.name=compute_score
    "trainer.logger=$LOGGER"
    "trainer.project_name=$PROJECT_NAME"
    "trainer.experiment_name=$EXPERIMENT_NAME"
    "trainer.nnodes=$NNODES"
    "trainer.n_gpus_per_node=$N_GPUS_PER_NODE"
    "trainer.total_epochs=$TOTAL_EPOCHS"
    "trainer.total_training_steps=$TOTAL_TRAINING_STEPS"
    "trainer.test_freq=$TEST_FREQ"
    "trainer.save_freq=$SAVE_FREQ"
    trainer.val_before_train=True
    "trainer.default_local_dir=$CKPT_DIR"
    "trainer.resume_mode=$RESUME_MODE"
)

# maspo_math_launch [overrides...]: run python -m maspo_verl.main with everything above.
#   DRY_RUN=1    compose, validate with verl's validate_config, print the loss section; no Ray, no GPU,
#                MODEL_PATH and the data files are not opened.
#   PRINT_CMD=1  print the command (one shell-quoted line) and exit; recipes/cluster/ray_submit.sh
#                uses it as the job's entrypoint.
maspo_math_launch() {
    local cmd=("${PYTHON:-python3}" -m maspo_verl.main --config-name "$CONFIG_NAME" "${MATH_OVERRIDES[@]}" "$@")
    if [ "${PRINT_CMD:-0}" = 1 ]; then
        printf '%q' "${cmd[0]}"; printf ' %q' "${cmd[@]:1}"; printf '\n'
        return 0
    fi
    if [ "${DRY_RUN:-0}" = 1 ]; then
        cmd+=(maspo.dry_run=true)
        echo "DRY_RUN=1: composing and validating only; MODEL_PATH and data files are not opened."
        printf 'command:'; printf ' %q' "${cmd[@]}"; printf '\n'
    fi
    "${cmd[@]}"
}
