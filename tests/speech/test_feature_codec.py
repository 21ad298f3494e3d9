"""The stand-in FSQ quantiser of the segmentation example (maspo_verl.speech.feature_codec)."""

import numpy as np

from maspo_verl.speech.feature_codec import FeatureFSQ, sentences


def digits(code: int) -> list[int]:
    return [(code >> (2 * k)) & 3 for k in range(8)]


def test_one_code_per_20ms_frame_steady_sounds_keep_their_code_a_new_sound_jumps():
    """Two steady sounds (a 200 Hz and a 2.5 kHz tone, 0.5 s each): one code per 320 samples, in the
    [4]*8 codebook, the same code inside each sound away from the switch, and the two sounds' codes
    differing in several digits; the same wave gives the same codes."""
    t = np.arange(8000) / 16000
    wave = np.concatenate([0.5 * np.sin(2 * np.pi * 200 * t), 0.5 * np.sin(2 * np.pi * 2500 * t)]).astype(np.float32)
    q = FeatureFSQ()
    codes = q.encode(wave)
    assert len(codes) == len(wave) // 320 == 50
    assert all(0 <= c < 65536 for c in codes)
    assert len(set(codes[2:23])) == 1 and len(set(codes[27:48])) == 1
    moved = sum(a != b for a, b in zip(digits(codes[10]), digits(codes[40]), strict=True))
    assert moved >= 3
    assert q.encode(wave) == codes


def test_sentences_are_distinct_and_seeded():
    a, b = sentences(50, seed=0), sentences(50, seed=0)
    assert a == b and len(set(a)) == 50 and sentences(50, seed=1) != a
