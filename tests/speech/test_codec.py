"""Codec decoders: the stand-in's round trip, and XCodec2Decoder's batching against a fake
``xcodec2`` module with XCodec2's decode_code contract ([B, 1, T] codes -> [B, 1, T * 320] audio)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from maspo_verl.speech.codec import HOP, CodecDecoder, FrameTableCodec, XCodec2Decoder, build_decoder


def test_frame_table_round_trip_and_noise():
    rng = np.random.default_rng(0)
    wave = (rng.standard_normal(HOP * 20) * 0.3).astype(np.float32)
    codec = FrameTableCodec(seed=0)
    codes = codec.encode(wave)
    assert len(codes) == 20 and all(0 <= c < 65536 for c in codes)
    out = codec.decode_batch([codes, codes[:5], []])
    np.testing.assert_array_equal(out[0], wave)
    np.testing.assert_array_equal(out[1], wave[: 5 * HOP])
    assert out[2].size == 0
    unknown = [c for c in range(65536) if c not in codec.table][:10]
    noise = codec.decode_batch([unknown])[0]
    assert noise.shape == (10 * HOP,) and 0.05 < noise.std() < 0.2
    np.testing.assert_array_equal(noise, codec.decode_batch([unknown])[0])  # deterministic
    with pytest.raises(ValueError):
        codec.decode_batch([[70000]])
    assert isinstance(codec, CodecDecoder)


class _FakeXCodec2:
    calls: list[tuple[int, ...]] = []

    @classmethod
    def from_pretrained(cls, path):
        assert path == "HKUSTAudio/xcodec2"
        return cls()

    def eval(self):
        return self

    def to(self, device):
        return self

    def decode_code(self, vq):
        assert vq.dim() == 3 and vq.shape[1] == 1 and vq.dtype == torch.long
        _FakeXCodec2.calls.append(tuple(vq.shape))
        # each code becomes HOP samples of value code / 65536 (so trimming is checkable)
        return (vq.float() / 65536.0).repeat_interleave(HOP, dim=-1)


@pytest.fixture
def fake_xcodec2(monkeypatch):
    pkg = types.ModuleType("xcodec2")
    mod = types.ModuleType("xcodec2.modeling_xcodec2")
    mod.XCodec2Model = _FakeXCodec2
    monkeypatch.setitem(sys.modules, "xcodec2", pkg)
    monkeypatch.setitem(sys.modules, "xcodec2.modeling_xcodec2", mod)
    _FakeXCodec2.calls = []
    return _FakeXCodec2


def test_xcodec2_decoder_batches_pads_and_trims(fake_xcodec2):
    dec = build_decoder("xcodec2", model_path="HKUSTAudio/xcodec2", device="cpu", max_batch=2)
    seqs = [[100] * 7, [], [200] * 3, [300] * 5]
    out = dec.decode_batch(seqs)
    assert [len(o) for o in out] == [7 * HOP, 0, 3 * HOP, 5 * HOP]
    for o, s in zip(out, seqs, strict=True):
        if s:
            np.testing.assert_allclose(o, s[0] / 65536.0)
    # sorted by length, chunks of 2: (3, 5) then (7,); empty never decoded
    assert fake_xcodec2.calls == [(2, 1, 5), (1, 1, 7)]
    exact = XCodec2Decoder(device="cpu", exact=True)
    fake_xcodec2.calls = []
    exact.decode_batch(seqs)
    assert fake_xcodec2.calls == [(1, 1, 3), (1, 1, 5), (1, 1, 7)]


def test_xcodec2_missing_package_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "xcodec2", None)
    monkeypatch.setitem(sys.modules, "xcodec2.modeling_xcodec2", None)
    with pytest.raises(ImportError, match="--no-deps xcodec2"):
        XCodec2Decoder(device="cpu")
