# Shared by the recipes/speech/run*.sh scripts (sourced, not run): environment variables -> Hydra
# overrides for `python -m maspo_verl.main`. Loss hyperparameters live in hydra_configs/loss/<LOSS>.yaml;
# reward settings are SpeechRewardConfig fields (maspo_verl/speech/reward.py). Extra arguments are
# appended as further Hydra overrides (they win).

# ---- what to train ---------------------------------------------------------------------------
MODEL_PATH=${MODEL_PATH:-HKUSTAudio/Llasa-1B}          # local folder recommended (see README, "Stop token")
LOSS=${LOSS:-maspo_fixed}                             # maspo_fixed maspo_logprob maspo_tokenval grpo gspo
SEGMENT_WINDOW=${SEGMENT_WINDOW:-15}                  # maspo_fixed: 5 phoneme / 15 syllable / 50 phrase (50 tokens/s)
CONFIG_NAME=${CONFIG_NAME:-maspo_trainer}
DATA_DIR=${DATA_DIR:-$HOME/data/maspo_speech}         # written by python -m maspo_verl.speech.prepare data
TRAIN_FILES=${TRAIN_FILES:-"['$DATA_DIR/train.parquet']"}
VAL_FILES=${VAL_FILES:-"['$DATA_DIR/test.parquet']"}
# <|SPEECH_GENERATION_START|> must end every prompt: auto = derive the template from MODEL_PATH's
# tokenizer (python -m maspo_verl.speech.prepare chat-template); a file path = use that template;
# none = leave the model's template alone (only if it already adds the speech-start token).
SPEECH_CHAT_TEMPLATE=${SPEECH_CHAT_TEMPLATE:-auto}

# ---- cluster shape ---------------------------------------------------------------------------
NNODES=${NNODES:-1}
N_GPUS_PER_NODE=${N_GPUS_PER_NODE:-8}

# ---- batch, lengths, optimiser ---------------------------------------------------------------
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-64}              # prompts per step
ROLLOUT_N=${ROLLOUT_N:-8}                             # responses per prompt (the GRPO group)
PPO_MINI_BATCH_SIZE=${PPO_MINI_BATCH_SIZE:-16}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-256}           # Llasa prompt: ~30 tokens + the text
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-2048}      # 50 codec tokens/s -> ~40 s of speech
PPO_MAX_TOKEN_LEN_PER_GPU=${PPO_MAX_TOKEN_LEN_PER_GPU:-$(( (MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH) * 4 ))}
ACTOR_LR=${ACTOR_LR:-1e-6}
PARAM_OFFLOAD=${PARAM_OFFLOAD:-False}

# ---- rollout (vLLM) --------------------------------------------------------------------------
ROLLOUT_TP=${ROLLOUT_TP:-1}
ROLLOUT_GPU_MEM_UTIL=${ROLLOUT_GPU_MEM_UTIL:-0.5}     # leaves room for the reward models (README, "Memory")
TEMPERATURE=${TEMPERATURE:-1.0}
TOP_P=${TOP_P:-1.0}
VAL_N=${VAL_N:-1}
VAL_TEMPERATURE=${VAL_TEMPERATURE:-0.8}
if [ -z "${BYPASS_MODE:-}" ]; then                   # vLLM log-probs as old log-probs for segment/sequence losses
    case "$LOSS" in grpo) BYPASS_MODE=False ;; *) BYPASS_MODE=True ;; esac
fi

# ---- reward: XCodec2 decode -> faster-whisper -> WER -> 1 - tanh(3 WER) ----------------------
REWARD_WORKERS=${REWARD_WORKERS:-$N_GPUS_PER_NODE}  # Ray reward-loop actors; each loads codec + ASR once
CODEC=${CODEC:-xcodec2}
CODEC_MODEL=${CODEC_MODEL:-HKUSTAudio/xcodec2}
ASR_MODEL=${ASR_MODEL:-large-v3}                      # bundled:tiny.en = offline tiny model (tests)
ASR_COMPUTE_TYPE=${ASR_COMPUTE_TYPE:-float16}         # int8 / float32 on CPU
REWARD_DEVICE=${REWARD_DEVICE:-auto}                  # auto: GPU (worker i -> cuda:i mod n) else CPU
W_SPK=${W_SPK:-0.0}                                   # speaker-similarity weight (needs ref_audio)
W_DUR=${W_DUR:-0.0}                                   # duration-term weight

# ---- schedule, logging, checkpoints ----------------------------------------------------------
TOTAL_EPOCHS=${TOTAL_EPOCHS:-5}
TOTAL_TRAINING_STEPS=${TOTAL_TRAINING_STEPS:-null}
TEST_FREQ=${TEST_FREQ:-10}
SAVE_FREQ=${SAVE_FREQ:-50}
MODEL_SLUG=$(basename "$MODEL_PATH" | tr '[:upper:]' '[:lower:]')
LOSS_TAG=$LOSS; [ "$LOSS" = maspo_fixed ] && LOSS_TAG=maspo_fixed_w$SEGMENT_WINDOW
PROJECT_NAME=${PROJECT_NAME:-maspo-speech-$MODEL_SLUG}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-$LOSS_TAG-$MODEL_SLUG-${NNODES}x$N_GPUS_PER_NODE}
LOGGER=${LOGGER:-'["console","wandb"]'}
CKPT_DIR=${CKPT_DIR:-checkpoints/$PROJECT_NAME/$EXPERIMENT_NAME}
RESUME_MODE=${RESUME_MODE:-auto}

RK=+reward.custom_reward_function.reward_kwargs
SPEECH_OVERRIDES=(
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
    "actor_rollout_ref.rollout.top_p=$TOP_P"
    "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP"
    "actor_rollout_ref.rollout.gpu_memory_utilization=$ROLLOUT_GPU_MEM_UTIL"
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$PPO_MAX_TOKEN_LEN_PER_GPU"
    "actor_rollout_ref.rollout.val_kwargs.n=$VAL_N"
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    "actor_rollout_ref.rollout.val_kwargs.temperature=$VAL_TEMPERATURE"
    reward.reward_manager.source=importlib
    reward.reward_manager.name=SpeechRewardManager
    reward.reward_manager.module.path=pkg://maspo_verl.speech.reward_manager
    "reward.num_workers=$REWARD_WORKERS"
    "$RK.codec=$CODEC"
    "$RK.codec_model=$CODEC_MODEL"
    "$RK.codec_device=$REWARD_DEVICE"
    "$RK.asr_model=$ASR_MODEL"
    "$RK.asr_device=$REWARD_DEVICE"
    "$RK.asr_compute_type=$ASR_COMPUTE_TYPE"
    "$RK.w_spk=$W_SPK"
    "$RK.w_dur=$W_DUR"
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
[ "$LOSS" = maspo_fixed ] && SPEECH_OVERRIDES+=("actor_rollout_ref.actor.policy_loss.segment_window=$SEGMENT_WINDOW")

# speech_chat_template_override: prints the custom_chat_template override (or nothing).
speech_chat_template_override() {
    local py=${PYTHON:-python3}
    case "$SPEECH_CHAT_TEMPLATE" in
        none) ;;
        auto)
            if [ "${DRY_RUN:-0}" = 1 ]; then
                echo "DRY_RUN=1: SPEECH_CHAT_TEMPLATE=auto is not derived (MODEL_PATH is not opened)" >&2
            else
                "$py" -m maspo_verl.speech.prepare chat-template --tokenizer "$MODEL_PATH" --hydra
            fi ;;
        *)
            # same quoting as maspo_verl.speech.tokens.hydra_quote (kept import-free: no torch/verl start-up)
            "$py" -c 'import re, sys
v = open(sys.argv[1]).read()
assert "${" not in v, "template contains ${ (OmegaConf interpolation)"
v = re.sub(r"(\\*)'"'"'", lambda m: m.group(1) * 2 + "\\'"'"'", v)
v = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, v)
print("+actor_rollout_ref.model.custom_chat_template='"'"'" + v + "'"'"'")' "$SPEECH_CHAT_TEMPLATE" ;;
    esac
}

# maspo_speech_launch [overrides...]: run python -m maspo_verl.main with everything above.
#   DRY_RUN=1    compose, validate with verl's validate_config, print the loss section; no Ray, no GPU,
#                MODEL_PATH, the data files and the reward models are not opened.
#   PRINT_CMD=1  print the command (one shell-quoted line) and exit.
maspo_speech_launch() {
    local ct
    ct=$(speech_chat_template_override)
    local cmd=("${PYTHON:-python3}" -m maspo_verl.main --config-name "$CONFIG_NAME" "${SPEECH_OVERRIDES[@]}")
    [ -n "$ct" ] && cmd+=("$ct")
    cmd+=("$@")
    if [ "${PRINT_CMD:-0}" = 1 ]; then
        printf '%q ' "${cmd[@]}"; printf '\n'
        return 0
    fi
    if [ "${DRY_RUN:-0}" = 1 ]; then
        cmd+=(maspo.dry_run=true)
        echo "DRY_RUN=1: composing and validating only; MODEL_PATH, data files and reward models are not opened."
        printf 'command:'; printf ' %q' "${cmd[@]}"; printf '\n'
    fi
    "${cmd[@]}"
}
