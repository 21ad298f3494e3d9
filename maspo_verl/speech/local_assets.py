"""Assets for a local CPU smoke run of the speech recipe (``local=cpu``, maspo_verl/local/):
a tiny random Llama with Llasa-1B's vocabulary layout, toy TTS data, and the Hydra overrides.

    python -m maspo_verl.speech.local_assets --out /tmp/maspo_speech_local > /tmp/overrides.txt
    python -m maspo_verl.main local=cpu loss=maspo_tokenval $(cat /tmp/overrides.txt)

The reward uses the stand-in codec (``frame_table``: unknown codes decode to noise, so a random
model scores 0 - it checks the plumbing, not learning) and the bundled Whisper tiny.en on CPU.
"""

from __future__ import annotations

import argparse
import json
import os

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "I would like a cup of hot tea with milk.",
    "Please call Stella and ask her to bring these.",
    "She sells sea shells by the sea shore.",
    "A rainbow is a division of white light.",
    "The bus is late again this morning.",
    "We walked home along the quiet river.",
    "Open the window and let the air in.",
]


def build(out: str, hidden: int = 32, layers: int = 2) -> dict[str, str]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from maspo_verl.speech.prepare import make_rows
    from maspo_verl.speech.testing import build_llasa_tokenizer
    from maspo_verl.speech.tokens import LlasaTokenMap, hydra_quote, speech_chat_template
    from maspo_verl.util import write_parquet

    model_dir = os.path.join(out, "tiny-llasa")
    tok = build_llasa_tokenizer(model_dir)
    m = LlasaTokenMap.from_tokenizer(tok)
    if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=[tok.eos_token_id, m.speech_end_id],
            pad_token_id=tok.pad_token_id,
        )
        LlamaForCausalLM(cfg).save_pretrained(model_dir)
    with open(os.path.join(model_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tok.bos_token_id, "eos_token_id": [tok.eos_token_id, m.speech_end_id]}, f)
    train, val = os.path.join(out, "train.parquet"), os.path.join(out, "test.parquet")
    write_parquet(make_rows(TEXTS, "train", "tts/local"), train)
    write_parquet(make_rows(TEXTS[:4], "test", "tts/local"), val)
    rk = "+reward.custom_reward_function.reward_kwargs"
    return {
        "actor_rollout_ref.model.path": model_dir,
        "data.train_files": train,
        "data.val_files": val,
        "data.max_prompt_length": "160",
        "+actor_rollout_ref.model.custom_chat_template": hydra_quote(speech_chat_template(tok)),
        "reward.reward_manager.source": "importlib",
        "reward.reward_manager.name": "SpeechRewardManager",
        "reward.reward_manager.module.path": "pkg://maspo_verl.speech.reward_manager",
        f"{rk}.codec": "frame_table",
        f"{rk}.asr_model": "bundled:tiny.en",
        f"{rk}.asr_device": "cpu",
        f"{rk}.asr_compute_type": "int8",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    for k, v in build(args.out).items():
        print(f"{k}={v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
