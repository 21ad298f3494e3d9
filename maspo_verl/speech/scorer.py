"""The speech scorer: codec codes -> waveform -> ASR -> WER -> reward, one batch at a time.

    reward = w_wer * (1 - tanh(3 * WER)) + w_spk * speaker_sim + w_dur * duration_score

with weights (1, 0, 0) by default, i.e. verl's CosyVoice2 recipe's 1 - tanh(3 WER). Terms:

- WER: jiwer on normalised texts (``maspo_verl.speech.text``), transcript from faster-whisper.
- speaker similarity (optional, ``w_spk > 0``): cosine similarity, clamped to [0, 1], between an
  embedding of the output and of a reference clip (``extra_info['ref_audio']`` path, else
  ``SpeechRewardConfig.ref_audio``). The embedder is pluggable (``speaker_embedder``:
  ``module:function`` taking (wave, sample_rate) -> 1-D vector); the built-in ``logmel`` embedder
  (mean/std of the log-mel spectrum) is a crude placeholder, not a speaker-verification model.
- duration (optional, ``w_dur > 0``): exp(-max(0, |ln(duration / expected)| - ln(tolerance)))
  with expected = characters / ``chars_per_second`` (English read speech: ~14 chars/s).

Span credit (``token_scores=True``): the ASR also returns word times, ``maspo_verl.speech.spans``
turns the word errors into codec-token spans, and each result gets ``code_penalties`` (one value per
code, each error's ``span_penalty`` spread over its span) for the reward manager to turn into
per-token scores. Transcripts without word times (an ASR that gives none) get no penalties and count in
``untimed``; ``error_spans`` counts the located errors.

Word ids (``word_ids=True``, MASPO's ``segment_rule=words``; the speech reward manager sets it when the
policy loss uses that rule): each result gets ``code_words``, the index of the recognised word each
code belongs to (-1 between words and for every code of a sample without word times).

Long clips (beyond Whisper's 30 s window) are cut at pauses and transcribed in full
(``maspo_verl.speech.asr``).

Failures never raise and score 0, each counted in a metric (``invalid_reference``: the ground truth
is missing, not a string, or has no words - never scored against the text "None";
``invalid_ref_audio``: ``w_spk > 0`` and the sample has no speaker reference clip, or it cannot be
read; ``invalid_empty``: no codec codes; ``invalid_decode``: the codec failed; ``invalid_nonspeech``:
silent audio (RMS below ``min_rms``), every Whisper window silent (no-speech probability above
``no_speech_threshold`` with an average log-prob below -1, Whisper's own rule) or an empty
transcript; ``error``: anything else, including a non-finite score). Every sample returns the same
keys (verl stacks them into arrays and averages them into metrics); terms that are disabled or never
computed (no transcript) are 0, never NaN.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from maspo_verl.speech.codec import SAMPLE_RATE, CodecDecoder, build_decoder
from maspo_verl.speech.settings import SpeechRewardConfig
from maspo_verl.speech.spans import error_spans, token_penalties, word_token_ids
from maspo_verl.speech.text import normalize_text, word_error_rate

logger = logging.getLogger(__name__)

METRIC_KEYS = (
    "score",
    "wer",
    "wer_reward",
    "spk_sim",
    "dur_score",
    "duration_s",
    "n_codes",
    "no_speech_prob",
    "error_spans",
    "untimed",
    "invalid_reference",
    "invalid_ref_audio",
    "invalid_empty",
    "invalid_decode",
    "invalid_nonspeech",
    "error",
)
INVALID_KEYS = tuple(k for k in METRIC_KEYS if k.startswith("invalid_"))


def wer_reward(wer: float, scale: float = 3.0) -> float:
    return float(1.0 - math.tanh(scale * max(0.0, wer)))


def duration_score(duration_s: float, text: str, chars_per_second: float, tolerance: float) -> float:
    n = len(normalize_text(text))
    if n == 0 or duration_s <= 0:
        return 0.0
    ratio = duration_s / (n / chars_per_second)
    return float(math.exp(-max(0.0, abs(math.log(ratio)) - math.log(tolerance))))


def logmel_embedding(wave: np.ndarray, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Placeholder speaker embedding: mean and std of an 64-band log-mel spectrum (numpy only)."""
    n_fft, hop, n_mels = 400, 160, 64
    wave = np.asarray(wave, dtype=np.float32)
    if len(wave) < n_fft:
        wave = np.pad(wave, (0, n_fft - len(wave)))
    frames = np.lib.stride_tricks.sliding_window_view(wave, n_fft)[::hop] * np.hanning(n_fft)
    power = np.abs(np.fft.rfft(frames, axis=-1)) ** 2
    mel = lambda f: 2595 * np.log10(1 + f / 700)  # noqa: E731
    edges = 700 * (10 ** (np.linspace(mel(0), mel(sample_rate / 2), n_mels + 2) / 2595) - 1)
    bins = np.fft.rfftfreq(n_fft, 1 / sample_rate)
    fb = np.maximum(
        0,
        np.minimum(
            (bins[None] - edges[:-2, None]) / (edges[1:-1, None] - edges[:-2, None]),
            (edges[2:, None] - bins[None]) / (edges[2:, None] - edges[1:-1, None]),
        ),
    )
    logmel = np.log(power @ fb.T + 1e-8)
    return np.concatenate([logmel.mean(0), logmel.std(0)])


def load_object(spec: str):
    import importlib

    mod, _, name = spec.partition(":")
    return getattr(importlib.import_module(mod), name)


def load_wave(path: str, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A sound file as mono float32 at ``sample_rate`` (linear resampling)."""
    import soundfile as sf

    wave, sr = sf.read(path, dtype="float32", always_2d=True)
    wave = wave.mean(1)
    if sr != sample_rate:
        t = np.arange(int(len(wave) * sample_rate / sr)) * sr / sample_rate
        wave = np.interp(t, np.arange(len(wave)), wave).astype(np.float32)
    return wave


def reference_text(ground_truth: Any) -> str | None:
    """The ground truth if it is a string with words in it, else None (scored 0 as ``invalid_reference``)."""
    if isinstance(ground_truth, str) and normalize_text(ground_truth):
        return ground_truth
    return None


class SpeechScorer:
    """Holds the codec and the ASR model (loaded once per process) and scores batches."""

    def __init__(self, config: SpeechRewardConfig, decoder: CodecDecoder | None = None, asr=None):
        self.config = config
        self._decoder = decoder
        self._asr = asr
        self._embedder = None
        self._ref_cache: dict[str, np.ndarray | None] = {}
        self.lock = threading.Lock()

    @property
    def decoder(self) -> CodecDecoder:
        if self._decoder is None:
            c = self.config
            kw = {"model_path": c.codec_model, "device": c.codec_device, "max_batch": c.codec_batch}
            self._decoder = build_decoder(c.codec, **(kw if c.codec == "xcodec2" else {}))
            logger.warning("maspo_verl.speech: codec %s loaded (pid %d)", c.codec, os.getpid())
        return self._decoder

    @property
    def asr(self):
        if self._asr is None:
            from maspo_verl.speech.asr import WhisperASR

            c = self.config
            self._asr = WhisperASR(
                c.asr_model,
                device=c.asr_device,
                compute_type=c.asr_compute_type,
                batch_size=c.asr_batch,
                beam_size=c.asr_beam,
                language=c.language,
                no_speech_threshold=c.no_speech_threshold,
                min_rms=c.min_rms,
            )
            logger.warning("maspo_verl.speech: ASR %s on %s (pid %d)", c.asr_model, self._asr.device, os.getpid())
        return self._asr

    def _embed(self, wave: np.ndarray) -> np.ndarray:
        if self._embedder is None:
            spec = self.config.speaker_embedder
            self._embedder = logmel_embedding if spec == "logmel" else load_object(spec)
        return np.asarray(self._embedder(wave, SAMPLE_RATE), dtype=np.float64).reshape(-1)

    def _speaker_sim(self, wave: np.ndarray, ref: np.ndarray) -> float:
        a = self._embed(wave)
        cos = float(a @ ref / (np.linalg.norm(a) * np.linalg.norm(ref) + 1e-12))
        if not math.isfinite(cos):
            raise ValueError(f"speaker embedding gave a non-finite similarity {cos}")
        return max(0.0, cos)

    def score_codes(
        self, codes: Sequence[Sequence[int]], texts: Sequence[Any], extra_infos: Sequence[dict | None] | None = None
    ) -> list[dict[str, float]]:
        """One metrics dict (``METRIC_KEYS``, plus ``code_penalties`` with span credit) per sample;
        never raises. ``texts`` are the ground truths as the dataset holds them (checked here)."""
        n = len(codes)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        res = [dict.fromkeys(METRIC_KEYS, 0.0) for _ in range(n)]
        for r, c in zip(res, codes, strict=True):
            r["n_codes"] = float(len(c))
            r["wer"] = 1.0
            if self.config.token_scores:
                r["code_penalties"] = [0.0] * len(c)
            if self.config.word_ids:
                r["code_words"] = [-1] * len(c)
        try:
            with self.lock:
                self._score_into(res, codes, texts, extra_infos)
        except Exception:
            logger.exception("speech reward: batch failed; scoring the batch 0")
            for r in res:
                if not any(r[k] for k in INVALID_KEYS):
                    r["error"] = 1.0
                r["score"] = 0.0
        return res

    def _reference_embedding(self, extra_info: dict | None) -> np.ndarray | None:
        """The speaker reference's embedding (cached per path); None if there is none or it cannot be read."""
        ref = (extra_info if isinstance(extra_info, dict) else {}).get("ref_audio") or self.config.ref_audio
        if not isinstance(ref, str) or not ref:
            return None
        if ref not in self._ref_cache:  # failures cached too: one warning per path
            try:
                self._ref_cache[ref] = self._embed(load_wave(ref))
            except Exception:
                logger.warning("speech reward: cannot read speaker reference %r", ref, exc_info=True)
                self._ref_cache[ref] = None
        return self._ref_cache[ref]

    def _score_into(self, res, codes, texts, extra_infos) -> None:
        c = self.config
        todo, refs = [], {}
        for i, seq in enumerate(codes):
            if reference_text(texts[i]) is None:
                res[i]["invalid_reference"] = 1.0
            elif c.w_spk > 0 and (ref := self._reference_embedding(extra_infos[i])) is None:
                res[i]["invalid_ref_audio"] = 1.0
            elif len(seq) < c.min_codes:
                res[i]["invalid_empty"] = 1.0
            else:
                todo.append(i)
                if c.w_spk > 0:
                    refs[i] = ref
        waves: dict[int, np.ndarray] = {}
        if todo:
            try:
                decoded = self.decoder.decode_batch([codes[i] for i in todo])
                waves = dict(zip(todo, decoded, strict=True))
            except Exception:
                logger.warning("speech reward: batch decode failed; decoding one by one", exc_info=True)
                for i in todo:
                    try:
                        waves[i] = self.decoder.decode_batch([codes[i]])[0]
                    except Exception:
                        res[i]["invalid_decode"] = 1.0
        speech = []
        for i, w in waves.items():
            w = np.nan_to_num(np.asarray(w, dtype=np.float32).reshape(-1))
            waves[i] = w
            res[i]["duration_s"] = len(w) / SAMPLE_RATE
            if len(w) == 0 or float(np.sqrt(np.mean(w**2))) < c.min_rms:
                res[i]["invalid_nonspeech"] = 1.0
            else:
                speech.append(i)
        if not speech:
            return
        if c.token_scores or c.word_ids:
            transcripts = self.asr.transcribe_batch([waves[i] for i in speech], word_timestamps=True)
        else:
            transcripts = self.asr.transcribe_batch([waves[i] for i in speech])
        for i, tr in zip(speech, transcripts, strict=True):
            r = res[i]
            r["no_speech_prob"] = tr.no_speech_prob
            if tr.silent or not normalize_text(tr.text):
                r["invalid_nonspeech"] = 1.0
                continue
            try:
                r["wer"] = word_error_rate(texts[i], tr.text)
                r["wer_reward"] = wer_reward(r["wer"], c.wer_scale)
                score = c.w_wer * r["wer_reward"]
                if c.w_dur > 0:
                    r["dur_score"] = duration_score(r["duration_s"], texts[i], c.chars_per_second, c.duration_tolerance)
                    score += c.w_dur * r["dur_score"]
                if c.w_spk > 0:
                    r["spk_sim"] = self._speaker_sim(waves[i], refs[i])
                    score += c.w_spk * r["spk_sim"]
                if not math.isfinite(score):
                    raise ValueError(f"non-finite score {score}")
                r["score"] = float(score)
                if c.token_scores:
                    self._locate_errors(r, texts[i], tr.words, len(codes[i]))
                if c.word_ids:
                    r["code_words"] = word_token_ids(tr.words or [], len(codes[i]))
            except Exception:
                logger.warning("speech reward: scoring sample failed", exc_info=True)
                r["error"] = 1.0
                r["score"] = 0.0

    def _locate_errors(self, r: dict, text: str, words, n_codes: int) -> None:
        if words is None:
            r["untimed"] = 1.0
            return
        spans = error_spans(text, words, n_codes)
        r["error_spans"] = float(len(spans))
        r["code_penalties"] = token_penalties(spans, n_codes, self.config.span_penalty)
