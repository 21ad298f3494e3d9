"""The speech reward's settings: ``SpeechRewardConfig``, its checks and the ``MASPO_SPEECH_*`` variables.

Each field is declared once, with its check (``_setting(default, check)``). Settings are checked when the
config is built (``SpeechRewardConfig(...)``, ``from_dict``, ``from_env``; the trainer's start-up checks
build it from ``reward.custom_reward_function.reward_kwargs``): every field's type and range, each error
naming ``reward.custom_reward_function.reward_kwargs.<field>`` (and the ``MASPO_SPEECH_<FIELD>`` variable
it came from) with the allowed values. A configured ``ref_audio`` must be an existing file. With
``w_spk > 0`` and no ``ref_audio``, every sample needs its own ``extra_info['ref_audio']``: the dataset is
not visible at start-up, so that is checked per sample. Whether the models these settings name can be
loaded is checked by ``maspo_verl.speech.preflight``.

Plain Python (no verl, no torch): runs in the driver at start-up, before any model loads.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from maspo_verl.validation import FieldError, check_bool, check_choice, check_float, check_int, fail, reject_unknown

PREFIX = "reward.custom_reward_function.reward_kwargs."
CODECS = ("xcodec2", "frame_table")
COMPUTE_TYPES = (  # CTranslate2's compute types
    "default",
    "auto",
    "int8",
    "int8_float32",
    "int8_float16",
    "int8_bfloat16",
    "int16",
    "float16",
    "bfloat16",
    "float32",
)
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
OBJECT_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # module:function


def env_name(name: str) -> str:
    return "MASPO_SPEECH_" + name.upper()


def field_path(name: str, overrides: dict[str, Any] | None = None) -> str:
    """``reward.custom_reward_function.reward_kwargs.<name>``, plus the variable when the value came from one."""
    path = PREFIX + name
    if name not in (overrides or {}) and env_name(name) in os.environ:
        return f"{path} (set by {env_name(name)})"
    return path


def _bad(name: str, value: Any, allowed: str):
    fail(PREFIX + name, value, allowed)


def _number(lo: float, hi: float = math.inf, lo_open: bool = False):
    return lambda name, value: check_float(PREFIX + name, value, lo, hi, lo_open) or float(value)


def _integer(lo: int):
    return lambda name, value: check_int(PREFIX + name, value, lo) or value


def _boolean(name: str, value: Any) -> bool:
    check_bool(PREFIX + name, value)
    return value


def _choice(choices: tuple[str, ...]):
    return lambda name, value: check_choice(PREFIX + name, value, choices) or value


def _pattern(regex: re.Pattern, allowed: str):
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or not regex.fullmatch(value):
            _bad(name, value, allowed)
        return value

    return check


def _codec(name: str, value: Any) -> str:
    if not isinstance(value, str) or not (value in CODECS or OBJECT_SPEC.fullmatch(value)):
        _bad(name, value, f"{', '.join(CODECS)} or module:function (a factory of a CodecDecoder)")
    return value


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        _bad(name, value, "a non-empty string")
    return value


def _language(name: str, value: Any) -> str:
    try:  # Whisper's language codes, as faster-whisper lists them
        from faster_whisper.tokenizer import _LANGUAGE_CODES as codes
    except ImportError:  # not installed here (e.g. the driver): the shape only
        codes = None
    ok = isinstance(value, str) and (value in codes if codes else re.fullmatch(r"[a-z]{2,3}", value) is not None)
    if not ok:
        _bad(name, value, "a Whisper language code (en, de, fr, zh, ...)")
    return value


def _ref_audio(name: str, value: Any) -> str:
    if not isinstance(value, str) or (value and not os.path.isfile(value)):
        _bad(name, value, "'' (per-sample extra_info['ref_audio']) or the path of an existing sound file")
    return value


_DEVICE = _pattern(DEVICE, "auto, cpu, cuda or cuda:<index>")
_EMBEDDER = _pattern(re.compile(f"logmel|{OBJECT_SPEC.pattern}"), "logmel or module:function")


def _setting(default: Any, check):
    """A field and its check, declared together."""
    return field(default=default, metadata={"check": check})


@dataclass
class SpeechRewardConfig:
    # codec: xcodec2 (real), frame_table (stand-in), or module:function(model_path=, device=, max_batch=)
    codec: str = _setting("xcodec2", _codec)
    codec_model: str = _setting("HKUSTAudio/xcodec2", _text)
    codec_device: str = _setting("auto", _DEVICE)
    codec_batch: int = _setting(16, _integer(1))
    # ASR: a faster-whisper size, a Hub id, a local CTranslate2 folder, or "bundled:tiny.en"
    asr_model: str = _setting("large-v3", _text)
    asr_device: str = _setting("auto", _DEVICE)
    asr_compute_type: str = _setting("default", _choice(COMPUTE_TYPES))
    asr_batch: int = _setting(16, _integer(1))
    asr_beam: int = _setting(1, _integer(1))
    language: str = _setting("en", _language)
    # reward = w_wer (1 - tanh(wer_scale WER)) + w_spk speaker_sim + w_dur duration_score
    wer_scale: float = _setting(3.0, _number(0.0, lo_open=True))
    w_wer: float = _setting(1.0, _number(0.0))
    w_spk: float = _setting(0.0, _number(0.0))
    w_dur: float = _setting(0.0, _number(0.0))
    speaker_embedder: str = _setting("logmel", _EMBEDDER)
    ref_audio: str = _setting("", _ref_audio)
    chars_per_second: float = _setting(14.0, _number(0.0, lo_open=True))
    duration_tolerance: float = _setting(1.5, _number(1.0))
    # span credit: per-code penalties located by the ASR's word times (maspo_verl.speech.spans)
    token_scores: bool = _setting(False, _boolean)
    span_penalty: float = _setting(1.0, _number(0.0))
    # MASPO segment_rule=words: per-code word ids from the ASR's word times (maspo_verl.speech.spans)
    word_ids: bool = _setting(False, _boolean)
    # non-speech detection
    min_rms: float = _setting(1e-3, _number(0.0))
    no_speech_threshold: float = _setting(0.6, _number(0.0, 1.0))
    min_codes: int = _setting(5, _integer(1))
    # batching of concurrent async calls (verl's reward loop scores samples as concurrent tasks)
    batch_window_s: float = _setting(0.05, _number(0.0, 60.0))
    max_batch: int = _setting(64, _integer(1))
    # more failed samples (error, invalid_decode) than this fraction of the recent ones stops the run; 1.0: never
    max_failed_frac: float = _setting(0.5, _number(0.0, 1.0))

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))
        if self.w_wer + self.w_spk + self.w_dur <= 0:
            raise FieldError(
                PREFIX + "w_wer",
                f"{PREFIX}w_wer/w_spk/w_dur are all 0: every sample would score 0; "
                "allowed: non-negative weights, at least one > 0",
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SpeechRewardConfig:
        d = dict(d or {})
        reject_unknown(PREFIX.rstrip("."), d, sorted(f.name for f in fields(cls)))
        return cls(**d)

    @classmethod
    def from_env(cls, overrides: dict[str, Any] | None = None) -> SpeechRewardConfig:
        """Defaults, then ``MASPO_SPEECH_<FIELD>`` environment variables, then ``overrides``."""
        vals: dict[str, Any] = {}
        for f in fields(cls):
            raw = os.environ.get(env_name(f.name))
            if raw is not None:
                vals[f.name] = _parse_env(f.name, raw, f.default)
        vals.update(overrides or {})
        try:
            return cls.from_dict(vals)
        except FieldError as exc:
            name = exc.field.removeprefix(PREFIX)
            if field_path(name, overrides) != exc.field:
                raise FieldError(exc.field, f"{exc} (set by {env_name(name)})") from None
            raise


def _parse_env(name: str, raw: str, default):
    where = f"{env_name(name)}={raw!r} ({PREFIX}{name})"
    if isinstance(default, bool):
        if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise FieldError(PREFIX + name, f"{where} is invalid: allowed true/false/1/0/yes/no")
        return raw.lower() in ("1", "true", "yes")
    if isinstance(default, str):
        return raw
    try:
        return type(default)(raw)
    except ValueError:
        kind = "an integer" if isinstance(default, int) else "a number"
        raise FieldError(PREFIX + name, f"{where} is invalid: allowed {kind}") from None


def settings_from_config(config: Any) -> dict[str, Any]:
    """``reward.custom_reward_function.reward_kwargs`` of a trainer config (SpeechRewardConfig fields).

    That dict is where verl keeps free-form reward settings (it is not a typed dataclass field); the
    reward manager reads it itself because no custom reward *function* is involved.
    """
    try:
        speech = config.reward.custom_reward_function.get("reward_kwargs")
    except Exception:
        return {}
    if speech is None:
        return {}
    try:
        from omegaconf import OmegaConf

        return dict(OmegaConf.to_container(speech, resolve=True))
    except Exception:
        return dict(speech)
