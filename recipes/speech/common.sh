# Shared by the recipes/speech/run*.sh scripts (sourced, not run): environment variables -> Hydra
# overrides for `python -m maspo_verl.main`. Loss hyperparameters live in hydra_configs/loss/<LOSS>.yaml;
# reward settings are SpeechRewardConfig fields (maspo_verl/speech/reward.py). Extra arguments are
# appended as further Hydra overrides (they win).

# ---- what to train ---------------------------------------------------------------------------
MODEL_PATH=${MODEL_PATH:-HKUSTAudio/Llasa-1B}          # local folder recommended (see README, "Stop token")
LOSS=${LOSS:-maspo_fixed}                             # maspo_fixed maspo_logprob maspo_tokenval maspo_words grpo gspo
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

# shellcheck source=recipes/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/../launch.sh"
recipe_overrides speech
RK=+reward.custom_reward_function.reward_kwargs
SPEECH_OVERRIDES=(
    "${RECIPE_OVERRIDES[@]}"
    "actor_rollout_ref.rollout.top_p=$TOP_P"
    "reward.num_workers=$REWARD_WORKERS"
    "$RK.codec=$CODEC"
    "$RK.codec_model=$CODEC_MODEL"
    "$RK.codec_device=$REWARD_DEVICE"
    "$RK.asr_model=$ASR_MODEL"
    "$RK.asr_device=$REWARD_DEVICE"
    "$RK.asr_compute_type=$ASR_COMPUTE_TYPE"
    "$RK.w_spk=$W_SPK"
    "$RK.w_dur=$W_DUR"
)
[ "$LOSS" = maspo_fixed ] && SPEECH_OVERRIDES+=("actor_rollout_ref.actor.policy_loss.segment_window=$SEGMENT_WINDOW")

# speech_chat_template_override: prints the custom_chat_template override (or nothing).
speech_chat_template_override() {
    case "$SPEECH_CHAT_TEMPLATE" in
        none) ;;
        auto)
            if [ "${DRY_RUN:-0}" = 1 ]; then
                echo "DRY_RUN=1: SPEECH_CHAT_TEMPLATE=auto is not derived (MODEL_PATH is not opened)" >&2
            else
                maspo_require_python
                "$PYTHON" -m maspo_verl.speech.prepare chat-template --tokenizer "$MODEL_PATH" --hydra
            fi ;;
        *)
            maspo_require_python
            "$PYTHON" -m maspo_verl.speech.prepare chat-template --template-file "$SPEECH_CHAT_TEMPLATE" --hydra ;;
    esac
}

# maspo_speech_launch [overrides...]: maspo_launch (recipes/launch.sh) with the overrides above and the
# speech chat template.
maspo_speech_launch() {
    local ct
    ct=$(speech_chat_template_override)
    maspo_launch "${SPEECH_OVERRIDES[@]}" ${ct:+"$ct"} "$@"
}
