"""Offline fixtures for the speech recipe: espeak-ng speech and a Llasa-shaped tokenizer.

- ``espeak(text)``: real speech (16 kHz float32) from the Debian package ``espeak-ng``.
- ``build_llasa_tokenizer(path)``: a fast tokenizer with Llasa-1B's id layout - a base vocabulary
  padded to ``base_size`` ids (128256 by default, like Llama-3.2), the 8 Llasa specials
  (128256..128263), then ``<|s_0|>..<|s_65535|>`` (128264..193799) - and a Llama-3-style chat
  template. Text is tokenised per character. Built with the ``tokenizers`` library in ~1-2 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import numpy as np

from maspo_verl.speech.tokens import CODE_TOKEN, SPECIALS

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def require_espeak() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("espeak-ng not found: apt-get install -y espeak-ng (Debian package espeak-ng)")
    return exe


def espeak(text: str, voice: str = "en-us", rate: int = 160, sample_rate: int = 16000) -> np.ndarray:
    """Synthesise ``text`` with espeak-ng; returns mono float32 at ``sample_rate``."""
    from maspo_verl.speech.scorer import load_wave

    exe = require_espeak()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "out.wav")
        subprocess.run([exe, "-v", voice, "-s", str(rate), "-w", path, text], check=True, capture_output=True)
        return load_wave(path, sample_rate)


def build_llasa_tokenizer(path: str, base_size: int = 128256, codec_size: int = 65536):
    """Write a Llasa-shaped ``PreTrainedTokenizerFast`` to ``path`` and return it."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    base = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab_list = base + chars
    if len(vocab_list) > base_size:
        raise ValueError(f"base_size={base_size} is smaller than the {len(vocab_list)} base tokens")
    vocab_list += [f"<|reserved_{i}|>" for i in range(base_size - len(vocab_list))]
    vocab_list += list(SPECIALS) + [CODE_TOKEN.format(i) for i in range(codec_size)]
    vocab = {t: i for i, t in enumerate(vocab_list)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(base[:6] + list(SPECIALS))
    tok.add_tokens([CODE_TOKEN.format(i) for i in range(codec_size)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        unk_token="<unk>",
        pad_token="<|end_of_text|>",
    )
    fast.chat_template = LLAMA3_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    fast.name_or_path = path
    return fast
