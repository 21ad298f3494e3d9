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

Per-sample outcomes score 0 and are counted, each in a metric: ``invalid_reference`` (the ground truth
is missing, not a string, or has no words - never scored against the text "None"), ``invalid_ref_audio``
(``w_spk > 0`` and the sample has no speaker reference clip, or it cannot be read), ``invalid_empty`` (no
codec codes), ``invalid_nonspeech`` (silent audio: RMS below ``min_rms``; every Whisper window silent: a
no-speech probability above ``no_speech_threshold`` with an average log-prob below -1, Whisper's own
rule; or an empty transcript), ``invalid_decode`` (the codec failed on the sample) and ``error``
(anything else failed on it, a non-finite score included). ``failed`` marks the last two: a component
failing rather than the sample's content. ``score_s`` is the batch's scoring time over its size (summed
over a step: the reward's time).

A failure that hits every sample raises ``SpeechRewardFailure``, so that the run stops with its cause: a
model that does not load (codec, ASR, speaker embedder), or more failed samples than ``max_failed_frac``
(default 0.5; 1.0 turns it off) of the last ``max_batch`` scored in this process, judged from
``MIN_JUDGED`` samples on (verl's streaming reward sends samples in small batches as they finish). The
error gives the counts and the first distinct messages. Every sample returns the same keys (verl stacks
them into arrays); terms that are disabled or never computed (no transcript) are 0, never NaN.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from maspo_verl.speech.codec import SAMPLE_RATE, CodecDecoder, build_decoder
from maspo_verl.speech.settings import PREFIX, SpeechRewardConfig
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
    "failed",
    "score_s",
)
INVALID_KEYS = tuple(k for k in METRIC_KEYS if k.startswith("invalid_"))
FAILED_KEYS = ("invalid_decode", "error")  # outcomes of a component failing, not of the sample's content
MIN_JUDGED = 8  # max_failed_frac is judged once this many samples (or max_batch) have been scored


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


class SpeechRewardFailure(RuntimeError):
    """A failure that hits every sample: a model that does not load, or more failed samples than
    ``max_failed_frac`` allows. Raised so that the run stops with its cause."""


class SpeechScorer:
    """Holds the codec and the ASR model (loaded once per process) and scores batches."""

    def __init__(self, config: SpeechRewardConfig, decoder: CodecDecoder | None = None, asr=None):
        self.config = config
        self._decoder = decoder
        self._asr = asr
        self._embedder = None
        self._ref_cache: dict[str, np.ndarray | None] = {}
        self._recent: list[str | None] = []  # the last samples' outcomes: None, or why the sample failed
        self.lock = threading.Lock()

    def _load(self, what: str, names: tuple[str, ...], build):
        """``build()``, or a SpeechRewardFailure naming the settings and where it failed."""
        try:
            return build()
        except Exception as exc:
            named = ", ".join(f"{PREFIX}{n}={getattr(self.config, n)!r}" for n in names)
            raise SpeechRewardFailure(
                f"speech reward: the {what} failed to load in the reward worker (pid {os.getpid()} on "
                f"{socket.gethostname()}): {type(exc).__name__}: {exc} [{named}]"
            ) from exc

    @property
    def decoder(self) -> CodecDecoder:
        if self._decoder is None:
            c = self.config
            self._decoder = self._load(
                "codec",
                ("codec", "codec_model", "codec_device"),
                lambda: build_decoder(c.codec, c.codec_model, c.codec_device, c.codec_batch),
            )
            logger.warning("maspo_verl.speech: codec %s loaded (pid %d)", c.codec, os.getpid())
        return self._decoder

    @property
    def asr(self):
        if self._asr is None:
            from maspo_verl.speech.asr import WhisperASR

            c = self.config
            self._asr = self._load(
                "ASR model",
                ("asr_model", "asr_device", "asr_compute_type"),
                lambda: WhisperASR(
                    c.asr_model,
                    device=c.asr_device,
                    compute_type=c.asr_compute_type,
                    batch_size=c.asr_batch,
                    beam_size=c.asr_beam,
                    language=c.language,
                    no_speech_threshold=c.no_speech_threshold,
                    min_rms=c.min_rms,
                ),
            )
            logger.warning("maspo_verl.speech: ASR %s on %s (pid %d)", c.asr_model, self._asr.device, os.getpid())
        return self._asr

    @property
    def embedder(self):
        if self._embedder is None:
            spec = self.config.speaker_embedder
            load = (lambda: logmel_embedding) if spec == "logmel" else (lambda: load_object(spec))
            self._embedder = self._load("speaker embedder", ("speaker_embedder",), load)
        return self._embedder

    def _embed(self, wave: np.ndarray) -> np.ndarray:
        return np.asarray(self.embedder(wave, SAMPLE_RATE), dtype=np.float64).reshape(-1)

    def _speaker_sim(self, wave: np.ndarray, ref: np.ndarray) -> float:
        a = self._embed(wave)
        cos = float(a @ ref / (np.linalg.norm(a) * np.linalg.norm(ref) + 1e-12))
        if not math.isfinite(cos):
            raise ValueError(f"speaker embedding gave a non-finite similarity {cos}")
        return max(0.0, cos)

    def score_codes(
        self, codes: Sequence[Sequence[int]], texts: Sequence[Any], extra_infos: Sequence[dict | None] | None = None
    ) -> list[dict[str, float]]:
        """One metrics dict (``METRIC_KEYS``, plus ``code_penalties`` with span credit) per sample.
        ``texts`` are the ground truths as the dataset holds them (checked here). A sample that fails
        scores 0 and is counted; raises ``SpeechRewardFailure`` when a model does not load or when more
        than ``max_failed_frac`` of the recent samples failed (see ``_judge``)."""
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
        errors: dict[int, str] = {}
        with self.lock:
            start = time.perf_counter()
            self._score_into(res, codes, texts, extra_infos, errors)
            seconds = (time.perf_counter() - start) / max(n, 1)
            for i, r in enumerate(res):
                r["failed"] = float(i in errors)
                r["score_s"] = seconds
            if errors:
                first = next(iter(errors.values()))
                logger.warning("speech reward: %d of %d samples failed; first: %s", len(errors), n, first)
            self._judge([errors.get(i) for i in range(n)])
        return res

    def _judge(self, outcomes: list[str | None]) -> None:
        """Raise when more than ``max_failed_frac`` of the last ``max_batch`` samples (this batch included,
        and at least ``MIN_JUDGED``) failed: a broken component, not bad samples."""
        c = self.config
        self._recent = (self._recent + outcomes)[-max(c.max_batch, len(outcomes)) :]
        failed = [m for m in self._recent if m is not None]
        judged = len(self._recent)
        if judged < min(MIN_JUDGED, c.max_batch) or len(failed) <= c.max_failed_frac * judged:
            return
        self._recent = []
        counts = ", ".join(f"{k} {sum(m.startswith(k + ':') for m in failed)}" for k in FAILED_KEYS)
        first = " | ".join(list(dict.fromkeys(failed))[:3])
        raise SpeechRewardFailure(
            f"speech reward: {len(failed)} of the last {judged} samples failed ({counts}), more than "
            f"{PREFIX}max_failed_frac={c.max_failed_frac}. First errors: {first}. "
            "A component that fails on most samples stops the run rather than train on zero rewards: fix it, "
            "or set max_failed_frac=1.0 to score failed samples 0 and go on."
        )

    @staticmethod
    def _fail(res: list[dict], i: int, key: str, exc: Exception, errors: dict[int, str]) -> None:
        logger.debug("speech reward: sample %d: %s", i, key, exc_info=exc)
        res[i][key] = 1.0
        res[i]["score"] = 0.0
        errors[i] = f"{key}: {type(exc).__name__}: {exc}"

    def _reference_embedding(self, extra_info: dict | None) -> np.ndarray | None:
        """The speaker reference's embedding (cached per path); None if there is none or it cannot be read."""
        ref = (extra_info if isinstance(extra_info, dict) else {}).get("ref_audio") or self.config.ref_audio
        if not isinstance(ref, str) or not ref:
            return None
        if ref not in self._ref_cache:  # failures cached too: one warning per path
            try:
                wave = load_wave(ref)
            except Exception:
                logger.warning("speech reward: cannot read speaker reference %r", ref, exc_info=True)
                self._ref_cache[ref] = None
            else:
                self._ref_cache[ref] = self._embed(wave)
        return self._ref_cache[ref]

    def _score_into(self, res, codes, texts, extra_infos, errors: dict[int, str]) -> None:
        c = self.config
        todo, refs = [], {}
        for i, seq in enumerate(codes):
            if reference_text(texts[i]) is None:
                res[i]["invalid_reference"] = 1.0
                continue
            if c.w_spk > 0:
                try:
                    refs[i] = self._reference_embedding(extra_infos[i])
                except Exception as exc:  # the embedder failed on the reference clip
                    self._fail(res, i, "error", exc, errors)
                    continue
                if refs[i] is None:
                    res[i]["invalid_ref_audio"] = 1.0
                    continue
            if len(seq) < c.min_codes:
                res[i]["invalid_empty"] = 1.0
            else:
                todo.append(i)
        waves = self._decode(res, codes, todo, errors)
        speech = []
        for i, w in waves.items():
            res[i]["duration_s"] = len(w) / SAMPLE_RATE
            if len(w) == 0 or float(np.sqrt(np.mean(w**2))) < c.min_rms:
                res[i]["invalid_nonspeech"] = 1.0
            else:
                speech.append(i)
        if not speech:
            return
        asr = self.asr
        try:
            clips = [waves[i] for i in speech]
            if c.token_scores or c.word_ids:
                transcripts = asr.transcribe_batch(clips, word_timestamps=True)
            else:
                transcripts = asr.transcribe_batch(clips)
            if len(transcripts) != len(clips):
                raise ValueError(f"the ASR returned {len(transcripts)} transcripts for {len(clips)} clips")
        except Exception as exc:
            for i in speech:
                self._fail(res, i, "error", exc, errors)
            return
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
            except Exception as exc:
                self._fail(res, i, "error", exc, errors)

    def _decode(self, res, codes, todo: list[int], errors: dict[int, str]) -> dict[int, np.ndarray]:
        """Waveforms of the samples ``todo``: one batched call; if it fails, one call per sample, so that
        a sample the codec cannot decode fails alone (``invalid_decode``)."""
        if not todo:
            return {}
        decoder = self.decoder
        try:
            decoded = decoder.decode_batch([codes[i] for i in todo])
            if len(decoded) != len(todo):
                raise ValueError(f"the codec returned {len(decoded)} waves for {len(todo)} code sequences")
            pairs = list(zip(todo, decoded, strict=True))
        except Exception as exc:
            if len(todo) == 1:
                self._fail(res, todo[0], "invalid_decode", exc, errors)
                return {}
            pairs = []
            for i in todo:
                try:
                    pairs.append((i, decoder.decode_batch([codes[i]])[0]))
                except Exception as one:
                    self._fail(res, i, "invalid_decode", one, errors)
        waves = {}
        for i, w in pairs:
            try:
                waves[i] = np.nan_to_num(np.asarray(w, dtype=np.float32).reshape(-1))
            except Exception as exc:
                self._fail(res, i, "invalid_decode", exc, errors)
        return waves

    def _locate_errors(self, r: dict, text: str, words, n_codes: int) -> None:
        if words is None:
            r["untimed"] = 1.0
            return
        spans = error_spans(text, words, n_codes)
        r["error_spans"] = float(len(spans))
        r["code_penalties"] = token_penalties(spans, n_codes, self.config.span_penalty)
