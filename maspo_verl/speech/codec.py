"""Codec decoders: codec codes -> 16 kHz waveforms.

``CodecDecoder`` is the interface the reward uses (``build_decoder``; a codec of your own plugs in as
``codec=module:function``). Two implementations:

- ``XCodec2Decoder``: the real XCodec2 (``XCodec2Model.from_pretrained``), batched decoding on the
  reward worker's device. Needs the ``xcodec2`` package and the model weights (and, because its
  constructor builds w2v-bert, ``facebook/w2v-bert-2.0`` in the HF cache): see
  recipes/speech/README.md, "XCodec2".
- ``FrameTableCodec``: a deterministic stand-in for tests. ``encode`` cuts a waveform into 20 ms
  frames (XCodec2's hop: 320 samples at 16 kHz, 50 codes/s) and gives each frame a code;
  ``decode`` maps known codes back to their frames and unknown codes to deterministic noise. So
  encoded speech decodes to the same speech, truncated codes to truncated speech, and random
  codes to noise - the properties the reward tests need.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

SAMPLE_RATE = 16000
HOP = 320  # samples per code: 50 codes per second
FRAMES_PER_SECOND = SAMPLE_RATE // HOP  # XCodec2 codes per second


@runtime_checkable
class CodecDecoder(Protocol):
    sample_rate: int

    def decode_batch(self, codes: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One float32 mono waveform in [-1, 1] per code sequence (empty input -> empty array)."""
        ...


def pick_device(device: str = "auto") -> str:
    """``auto``: a CUDA device if visible, else CPU. In verl the reward-loop workers are Ray actors
    without a GPU reservation; Ray >= 2.50 leaves CUDA_VISIBLE_DEVICES alone for them, so they see
    all GPUs of their node. ``auto`` spreads workers over those GPUs by the worker's index
    (``reward_loop_worker_<i>`` -> cuda:<i mod n>)."""
    if device != "auto":
        return device
    try:
        import torch

        if not torch.cuda.is_available():
            return "cpu"
        n = torch.cuda.device_count()
        idx = 0
        try:
            import ray

            if ray.is_initialized():
                name = ray.get_runtime_context().get_actor_name() or ""
                tail = name.rsplit("_", 1)[-1]
                idx = int(tail) if tail.isdigit() else 0
        except Exception:
            idx = 0
        return f"cuda:{idx % n}"
    except Exception:
        return "cpu"


class XCodec2Decoder:
    """Real XCodec2 decoding, batched.

    Sequences are sorted by length and decoded in chunks of ``max_batch``, each padded (with its
    own last code) to the chunk's longest and trimmed back to ``len * 320`` samples. XCodec2's
    decoder is non-causal, so padding can colour the last frames slightly; ``exact=True`` decodes
    one sequence at a time instead.
    """

    sample_rate = SAMPLE_RATE

    def __init__(
        self,
        model_path: str = "HKUSTAudio/xcodec2",
        device: str = "auto",
        max_batch: int = 16,
        exact: bool = False,
        dtype: str = "float32",
    ):
        try:
            import torch
            from xcodec2.modeling_xcodec2 import XCodec2Model
        except ImportError as exc:
            raise ImportError(
                "XCodec2Decoder needs the xcodec2 package. It pins torch==2.5.0; install it without its "
                "pins: pip install --no-deps xcodec2==0.1.5 einops==0.8.0 vector-quantize-pytorch==1.17.8 "
                "einx frozendict torchtune torchao (see recipes/speech/README.md, 'XCodec2')"
            ) from exc
        self.torch = torch
        self.device = pick_device(device)
        self.model = XCodec2Model.from_pretrained(model_path).eval().to(self.device)
        if dtype != "float32":
            self.model = self.model.to(getattr(torch, dtype))
        self.max_batch = max_batch
        self.exact = exact

    def decode_batch(self, codes: Sequence[Sequence[int]]) -> list[np.ndarray]:
        torch = self.torch
        out: list[np.ndarray | None] = [None] * len(codes)
        order = sorted((i for i in range(len(codes)) if len(codes[i]) > 0), key=lambda i: len(codes[i]))
        for i in range(len(codes)):
            if len(codes[i]) == 0:
                out[i] = np.zeros(0, dtype=np.float32)
        step = 1 if self.exact else self.max_batch
        for s in range(0, len(order), step):
            chunk = order[s : s + step]
            t_max = max(len(codes[i]) for i in chunk)
            rows = [list(codes[i]) + [codes[i][-1]] * (t_max - len(codes[i])) for i in chunk]
            vq = torch.tensor(rows, dtype=torch.long, device=self.device).unsqueeze(1)  # [B, 1, T]
            with torch.inference_mode():
                wav = self.model.decode_code(vq)  # [B, 1, samples]
            wav = wav.float().reshape(len(chunk), -1).cpu().numpy()
            for row, i in enumerate(chunk):
                out[i] = np.clip(wav[row, : len(codes[i]) * HOP], -1.0, 1.0).astype(np.float32)
        return out  # type: ignore[return-value]


def _noise_frame(code: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(str(code).encode(), digest_size=8).digest(), "little")
    return (np.random.default_rng(seed).standard_normal(HOP) * 0.1).astype(np.float32)


class FrameTableCodec:
    """Deterministic stand-in codec (tests, local CPU runs): 20 ms frames <-> codes.

    ``encode(wave)`` assigns codes to frames. Codes are *persistent* like a real codec's: a frame
    whose spectrum is close to the previous frame's keeps most FSQ digits (only the low digits
    change), a new sound changes high digits too. ``decode`` returns the stored frame for a known
    code and deterministic low-level noise for an unknown one.
    """

    sample_rate = SAMPLE_RATE

    def __init__(self, codec_size: int = 65536, seed: int = 0):
        self.codec_size = codec_size
        self.table: dict[int, np.ndarray] = {}
        self._rng = np.random.default_rng(seed)

    def encode(self, wave: np.ndarray) -> list[int]:
        wave = np.asarray(wave, dtype=np.float32).reshape(-1)
        n = len(wave) // HOP
        codes: list[int] = []
        prev_spec = None
        prev_code = int(self._rng.integers(self.codec_size))
        for k in range(n):
            frame = wave[k * HOP : (k + 1) * HOP]
            spec = np.log1p(np.abs(np.fft.rfft(frame)))
            if prev_spec is None:
                change = 1.0
            else:
                change = float(np.linalg.norm(spec - prev_spec) / (np.linalg.norm(prev_spec) + 1e-6))
            # similar frames flip one low digit (a base-4 digit k < 2), new sounds re-draw the code
            if change < 0.35:
                digit = int(self._rng.integers(2))
                code = prev_code ^ (1 << (2 * digit))
            else:
                code = int(self._rng.integers(self.codec_size))
            # a code already used for another frame gets the nearest free id, so decode is exact
            while code in self.table and not np.array_equal(self.table[code], frame):
                code = (code + 1) % self.codec_size
            self.table[code] = frame.copy()
            codes.append(code)
            prev_code, prev_spec = code, spec
        return codes

    def decode_batch(self, codes: Sequence[Sequence[int]]) -> list[np.ndarray]:
        out = []
        for seq in codes:
            if len(seq) == 0:
                out.append(np.zeros(0, dtype=np.float32))
                continue
            if any(not (0 <= int(c) < self.codec_size) for c in seq):
                raise ValueError("code outside the codebook")
            frames = [self.table.get(int(c)) for c in seq]
            out.append(
                np.concatenate([f if f is not None else _noise_frame(int(c)) for f, c in zip(frames, seq, strict=True)])
            )
        return out


def build_decoder(kind: str, model_path: str, device: str = "auto", max_batch: int = 16) -> CodecDecoder:
    """``xcodec2`` (real), ``frame_table`` (stand-in, ignores the rest), or ``module:function``: a factory
    called as ``function(model_path=, device=, max_batch=)`` that returns a ``CodecDecoder`` at 16 kHz."""
    if kind == "xcodec2":
        return XCodec2Decoder(model_path=model_path, device=device, max_batch=max_batch)
    if kind == "frame_table":
        return FrameTableCodec()
    module, sep, name = kind.partition(":")
    if not sep:
        raise ValueError(f"codec={kind!r} is invalid: allowed xcodec2, frame_table or module:function")
    import importlib

    decoder = getattr(importlib.import_module(module), name)(model_path=model_path, device=device, max_batch=max_batch)
    if not callable(getattr(decoder, "decode_batch", None)) or getattr(decoder, "sample_rate", None) != SAMPLE_RATE:
        raise TypeError(
            f"codec={kind!r} returned {type(decoder).__name__}, not a CodecDecoder: it needs decode_batch(codes) and "
            f"sample_rate == {SAMPLE_RATE}"
        )
    return decoder
