# shellcheck shell=bash
# Shared by recipes/*/common.sh (sourced after they set their variables): the Hydra overrides that
# every recipe derives from the same environment variables, and the launcher. Settings that are
# not knobs live in the Hydra presets (hydra_configs/recipe/, hydra_configs/loss/).

RESUME_MODE=${RESUME_MODE:-auto}                      # auto | disable | resume_path

# The interpreter: PYTHON, else `python` from PATH (the activated project venv), else `python3`.
if [ -z "${PYTHON:-}" ]; then
    if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi

# Stop at once, saying what to do, when that interpreter lacks the package or what it needs (not for
# PRINT_CMD / PRINT_ARGV, which only print the command for another machine).
maspo_require_python() {
    local missing
    missing=$("$PYTHON" -c 'import importlib.util as u
print(" ".join(m for m in ("maspo_verl", "hydra", "verl") if u.find_spec(m) is None))' 2>&1) || missing="a working $PYTHON"
    if [ -n "$missing" ]; then
        echo "error: $PYTHON ($(command -v "$PYTHON" || echo 'not on PATH')) lacks $missing: activate the project venv" \
            "(source .venv/bin/activate, after bash .ci/setup), or install maspo-verl (pip install -e . in the checkout)," \
            "or set PYTHON=/path/to/python" >&2
        exit 1
    fi
}
[ "${PRINT_CMD:-0}" = 1 ] || [ "${PRINT_ARGV:-0}" = 1 ] || maspo_require_python

# recipe_overrides PRESET: the recipe preset plus the knobs shared by every recipe.
recipe_overrides() {
    RECIPE_OVERRIDES=(
        "recipe=$1"
        "loss=$LOSS"
        "algorithm.rollout_correction.bypass_mode=$BYPASS_MODE"
        "data.train_files=$TRAIN_FILES"
        "data.val_files=$VAL_FILES"
        "data.train_batch_size=$TRAIN_BATCH_SIZE"
        "data.max_prompt_length=$MAX_PROMPT_LENGTH"
        "data.max_response_length=$MAX_RESPONSE_LENGTH"
        "actor_rollout_ref.model.path=$MODEL_PATH"
        "actor_rollout_ref.actor.optim.lr=$ACTOR_LR"
        "actor_rollout_ref.actor.ppo_mini_batch_size=$PPO_MINI_BATCH_SIZE"
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$PPO_MAX_TOKEN_LEN_PER_GPU"
        "actor_rollout_ref.rollout.n=$ROLLOUT_N"
        "actor_rollout_ref.rollout.temperature=$TEMPERATURE"
        "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP"
        "actor_rollout_ref.rollout.gpu_memory_utilization=$ROLLOUT_GPU_MEM_UTIL"
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$PPO_MAX_TOKEN_LEN_PER_GPU"
        "actor_rollout_ref.rollout.val_kwargs.n=$VAL_N"
        "actor_rollout_ref.rollout.val_kwargs.temperature=$VAL_TEMPERATURE"
        "trainer.logger=$LOGGER"
        "trainer.project_name=$PROJECT_NAME"
        "trainer.experiment_name=$EXPERIMENT_NAME"
        "trainer.nnodes=$NNODES"
        "trainer.n_gpus_per_node=$N_GPUS_PER_NODE"
        "trainer.total_epochs=$TOTAL_EPOCHS"
        "trainer.total_training_steps=$TOTAL_TRAINING_STEPS"
        "trainer.test_freq=$TEST_FREQ"
        "trainer.save_freq=$SAVE_FREQ"
        "trainer.default_local_dir=$CKPT_DIR"
        "trainer.resume_mode=$RESUME_MODE"
    )
}

# maspo_launch [overrides...]: $PYTHON -m maspo_verl.main --config-name $CONFIG_NAME with them.
#   DRY_RUN=1    compose, validate with verl's validate_config, print the loss section; no Ray, no GPU;
#                what MODEL_PATH, the data files and the reward name that this machine lacks is listed,
#                not refused (maspo.preflight=warn: the run may be meant for another machine).
#   PRINT_CMD=1  print the command (one shell-quoted line) and exit.
#   PRINT_ARGV=1 print the command's words, each ended by a NUL byte, and exit;
#                recipes/cluster/ray_submit.sh passes them to `ray job submit` as the entrypoint.
maspo_launch() {
    local cmd=("$PYTHON" -m maspo_verl.main --config-name "$CONFIG_NAME" "$@")
    if [ "${PRINT_ARGV:-0}" = 1 ]; then
        printf '%s\0' "${cmd[@]}"
        return 0
    fi
    if [ "${PRINT_CMD:-0}" = 1 ]; then
        printf '%q' "${cmd[0]}"; printf ' %q' "${cmd[@]:1}"; printf '\n'
        return 0
    fi
    if [ "${DRY_RUN:-0}" = 1 ]; then
        cmd+=(maspo.dry_run=true maspo.preflight=warn)
        echo "DRY_RUN=1: composing and validating only; paths and GPUs this machine lacks are listed, not refused."
        printf 'command: %q' "${cmd[0]}"; printf ' %q' "${cmd[@]:1:4}"   # python -m maspo_verl.main --config-name X
        printf ' \\\n    %q' "${cmd[@]:5}"; printf '\n'                   # then one override per line
    fi
    "${cmd[@]}"
}
