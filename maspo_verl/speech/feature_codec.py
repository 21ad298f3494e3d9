"""A deterministic stand-in for a speech codec's FSQ quantiser, and a corpus of real speech as codes.

``FeatureFSQ.encode(wave)`` maps each 20 ms frame (320 samples at 16 kHz: XCodec2's 50 codes/s) to
an FSQ code with XCodec2's layout (``levels`` [4]*8, digit k = (code >> 2k) & 3): the frame's
log-mel spectrum (40 ms Hann window centred on the frame, ``N_MELS`` bands) -> its first
``len(levels)`` cepstral coefficients (DCT-II; coefficient 0 is the log energy) -> each standardised
over the utterance and cut at the normal quantiles into ``level`` bins, one FSQ digit each. Frames of
one sound have near cepstra, so neighbouring codes differ in few digits, by one step; a new sound
moves several. It is a function of the waveform (no training, no randomness), not a codec: nothing
decodes it.

``python -m maspo_verl.speech.feature_codec --n 300 --out codes.jsonl`` writes the corpus that
``python -m maspo_verl.lab segments`` reads: ``n`` sentences made from a fixed vocabulary (seeded),
spoken by espeak-ng, their words timed by Whisper tiny.en (``bundled:tiny.en``, the word times the
speech reward uses), and encoded by ``FeatureFSQ``; one JSON line per utterance with ``codes``,
``word_times`` ([[start_s, end_s], ...]), ``words``, ``text``. Utterances Whisper found no word in
are left out (counted on stderr). Beside it, ``<out>.COMMAND.txt`` records the command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from collections.abc import Sequence

import numpy as np

from maspo_verl.speech.codec import HOP, SAMPLE_RATE

N_MELS = 24
WINDOW = 2 * HOP  # 40 ms analysis window per 20 ms frame


def _mel_filters(n_fft: int, n_mels: int, sample_rate: int) -> np.ndarray:
    mel = lambda f: 2595.0 * np.log10(1.0 + f / 700.0)  # noqa: E731
    edges = 700.0 * (10 ** (np.linspace(mel(60.0), mel(sample_rate / 2), n_mels + 2) / 2595.0) - 1.0)
    bins = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    rise = (bins[None] - edges[:-2, None]) / (edges[1:-1, None] - edges[:-2, None])
    fall = (edges[2:, None] - bins[None]) / (edges[2:, None] - edges[1:-1, None])
    return np.maximum(0.0, np.minimum(rise, fall))


def _normal_quantiles(level: int) -> np.ndarray:
    """Cut points splitting a standard normal into ``level`` equally likely bins."""
    from statistics import NormalDist

    return np.array([NormalDist().inv_cdf(i / level) for i in range(1, level)])


class FeatureFSQ:
    """20 ms frames of audio -> FSQ codes by quantised cepstra (see the module docstring)."""

    def __init__(self, levels: Sequence[int] = (4,) * 8, sample_rate: int = SAMPLE_RATE):
        if sample_rate != SAMPLE_RATE:
            raise ValueError(f"FeatureFSQ takes {SAMPLE_RATE} Hz audio (got {sample_rate})")
        self.levels = list(levels)
        self.codec_size = math.prod(self.levels)
        self.filters = _mel_filters(WINDOW, N_MELS, sample_rate)
        k, n = np.arange(len(self.levels))[:, None], np.arange(N_MELS)[None]
        self.dct = np.cos(np.pi / N_MELS * (n + 0.5) * k)  # DCT-II rows 0..len(levels)-1
        self.cuts = [_normal_quantiles(level) for level in self.levels]
        self.radix = np.cumprod([1] + self.levels[:-1])

    def cepstra(self, wave: np.ndarray) -> np.ndarray:
        """[frames, len(levels)] cepstral coefficients, one row per 20 ms frame."""
        wave = np.asarray(wave, dtype=np.float64).reshape(-1)
        frames = len(wave) // HOP
        padded = np.pad(wave, (WINDOW // 2 - HOP // 2, WINDOW))
        windows = np.lib.stride_tricks.sliding_window_view(padded, WINDOW)[::HOP][:frames] * np.hanning(WINDOW)
        power = np.abs(np.fft.rfft(windows, axis=-1)) ** 2
        logmel = np.log(power @ self.filters.T + 1e-10)
        return logmel @ self.dct.T

    def encode(self, wave: np.ndarray) -> list[int]:
        """One code per 20 ms frame."""
        c = self.cepstra(wave)
        if not len(c):
            return []
        z = (c - c.mean(0)) / np.maximum(c.std(0), 1e-6)
        digits = np.stack([np.searchsorted(cuts, z[:, k]) for k, cuts in enumerate(self.cuts)], axis=1)
        return [int(x) for x in digits @ self.radix]


# ------------------------------------------------------------------ the corpus
SUBJECTS = (
    "the old man", "a young girl", "my brother", "the teacher", "our neighbour", "the small dog", "a tired farmer",
    "the captain", "her mother", "the children", "a quiet student", "the baker", "his friend", "the doctor",
)  # fmt: skip
VERBS = (
    "found", "painted", "carried", "opened", "watched", "cleaned", "remembered", "borrowed", "followed", "sold",
    "visited", "dropped", "fixed", "described", "ordered", "packed",
)  # fmt: skip
OBJECTS = (
    "a yellow basket", "the broken window", "seven green apples", "the heavy box", "a long letter", "the wooden door",
    "two silver coins", "the morning paper", "a warm blanket", "the river boat", "an empty bottle", "the garden gate",
)  # fmt: skip
PLACES = (
    "near the station", "after dinner", "in the kitchen", "before sunrise", "behind the school", "on a rainy day",
    "at the market", "under the bridge", "during the storm", "by the lake", "last winter", "in the city",
)  # fmt: skip
CLAUSES = (
    "and then went home", "because it was late", "while the radio played", "but nobody noticed",
    "and smiled at everyone", "so we waited outside",
)  # fmt: skip


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct sentences from the fixed vocabulary above (seeded)."""
    rng = np.random.default_rng(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        if rng.random() < 0.7:
            s += f" {rng.choice(PLACES)}"
        if rng.random() < 0.4:
            s += f" {rng.choice(CLAUSES)}"
        s = s[0].upper() + s[1:] + "."
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def corpus(n: int, seed: int = 0, batch_size: int = 16, threads: int = 2) -> tuple[list[dict], int]:
    """The rows of ``main``'s JSONL and the number of utterances left out (no word found)."""
    from maspo_verl.speech.asr import WhisperASR
    from maspo_verl.speech.testing import espeak

    asr = WhisperASR("bundled:tiny.en", device="cpu", compute_type="int8", cpu_threads=threads, batch_size=batch_size)
    quantiser = FeatureFSQ()
    rows, dropped = [], 0
    texts = sentences(n, seed)
    for start in range(0, n, batch_size):
        batch = texts[start : start + batch_size]
        waves = [espeak(t) for t in batch]
        for text, wave, tr in zip(batch, waves, asr.transcribe_batch(waves, word_timestamps=True), strict=True):
            if not tr.words:
                dropped += 1
                continue
            rows.append(
                {
                    "id": len(rows),
                    "text": text,
                    "codes": quantiser.encode(wave),
                    "word_times": [[round(w.start, 3), round(w.end, 3)] for w in tr.words],
                    "words": [w.word.strip() for w in tr.words],
                }
            )
        print(f"feature_codec: {min(start + batch_size, n)}/{n} utterances", file=sys.stderr, flush=True)
    return rows, dropped


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m maspo_verl.speech.feature_codec", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=300, help="utterances")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.add_argument("--threads", type=int, default=2, help="Whisper CPU threads")
    args = p.parse_args(argv)
    rows, dropped = corpus(args.n, args.seed, threads=args.threads)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    command = "python -m maspo_verl.speech.feature_codec " + " ".join(shlex.quote(a) for a in argv)
    with open(args.out + ".COMMAND.txt", "w") as f:
        f.write(command + "\n")
    print(
        f"feature_codec: wrote {len(rows)} utterances to {args.out} ({dropped} without words left out)", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
