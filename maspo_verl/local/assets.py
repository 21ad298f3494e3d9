"""The embedded default of the local mode: a tiny random Qwen2-shaped causal LM, a byte-level
tokenizer with a chat template, and a toy dataset in verl's parquet schema.

Everything is generated on first use into a cache folder (no download) and is a pure function of
the seed: the same seed gives the same files (tokenizer JSON, model weights, parquet rows).

Token ids: id ``b`` (0..255) is the raw byte ``b`` (byte-level, no merges), then the specials, then reserved
tokens up to the model's vocabulary size.
So every id < 256 is a "code" for the local ``tokenval`` rule (codec_offset=0, codec_size=256).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

from maspo_verl.util import atomic_build, default_cache_dir

ASSET_VERSION = 2  # bump when the generated files change, so stale caches are not reused
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_BYTES = 256
# Model vocabulary: bytes + specials, rounded up to a multiple of 8.
MODEL_VOCAB = 264
# The tokenizer names every id of the model's vocabulary: an inference engine samples from ids < len(tokenizer)
# only (verl's vLLM rollout masks the rest), and a model whose softmax also covers unnamed ids would differ from
# it by their probability mass (~2 % of a random model's: a constant -0.02 nats per token)
RESERVED_TOKENS = tuple(f"<|reserved_{i}|>" for i in range(MODEL_VOCAB - NUM_BYTES - len(SPECIAL_TOKENS)))

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MODEL_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 1024,
}

# Toy task: "repeat these letters"; the reward (maspo_verl.local.reward) is dense.
LETTERS = "abcdefgh"
DATA_SOURCE = "maspo_local_toy"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (the alphabet of a ByteLevel tokenizer)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in codes), strict=True))


def build_tokenizer_json() -> str:
    """The ``tokenizer.json`` text of the byte-level tokenizer (id b = byte b, then specials)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    mapping = _bytes_to_unicode()
    vocab = {mapping[b]: b for b in range(NUM_BYTES)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + RESERVED_TOKENS])
    return tok.to_str(pretty=True)


def write_tokenizer(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(build_tokenizer_json())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MODEL_SHAPE["max_position_embeddings"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )


def write_model(path: Path, seed: int) -> None:
    """A random-init Qwen2 causal LM, saved with ``save_pretrained`` (fp32 safetensors)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos = NUM_BYTES + SPECIAL_TOKENS.index("<|im_end|>")
    pad = NUM_BYTES + SPECIAL_TOKENS.index("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=MODEL_VOCAB,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="float32",
        **MODEL_SHAPE,
    )
    config._attn_implementation = "sdpa"
    cpu_rng = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(cpu_rng)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(path, safe_serialization=True)


def _rows(n: int, rng: random.Random, split: str) -> list[dict]:
    rows = []
    for i in range(n):
        target = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"Repeat: {target}"}],
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": target},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def write_dataset(path: Path, seed: int, n_train: int = 64, n_val: int = 16) -> tuple[Path, Path]:
    import pandas as pd

    path.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    out = []
    for split, n in (("train", n_train), ("test", n_val)):
        file = path / f"{split}.parquet"
        pd.DataFrame(_rows(n, rng, split)).to_parquet(file, index=False)
        out.append(file)
    return out[0], out[1]


def ensure_assets(seed: int = 0, cache_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Paths of the embedded model (with tokenizer), train and val parquet; built on first use."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    key = hashlib.sha1(json.dumps([ASSET_VERSION, seed, MODEL_SHAPE, MODEL_VOCAB]).encode()).hexdigest()[:10]
    base = cache / f"local-v{ASSET_VERSION}-seed{seed}-{key}"

    def build_model(tmp: Path) -> None:
        write_model(tmp, seed)
        write_tokenizer(tmp)

    model = atomic_build(base / "model", build_model)
    data = atomic_build(base / "data", lambda tmp: write_dataset(tmp, seed))
    return {
        "model": str(model),
        "train": str(data / "train.parquet"),
        "val": str(data / "test.parquet"),
    }
