"""Codecs that fail, loaded by the reward as ``codec=tests.speech.failing_codecs:<factory>`` (the way a
codec of one's own plugs in): one that raises on every batch, one that cannot load."""

from __future__ import annotations

from maspo_verl.speech.codec import SAMPLE_RATE


class RaisingCodec:
    """Loads, then fails on every batch (as a codec whose GPU context broke would)."""

    sample_rate = SAMPLE_RATE

    def __init__(self):
        self.calls = 0

    def decode_batch(self, codes):
        self.calls += 1
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def raising_codec(model_path: str, device: str, max_batch: int) -> RaisingCodec:
    return RaisingCodec()


def unloadable_codec(model_path: str, device: str, max_batch: int):
    raise OSError(f"no codec weights at {model_path!r}")
