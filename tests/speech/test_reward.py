"""Reward: text normalisation/WER units, real speech through the real ASR with negative controls,
the full reward from token ids (stand-in codec) through verl's reward-manager interface, robustness."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest
import torch

from maspo_verl.speech.codec import HOP, CodecDecoder, FrameTableCodec
from maspo_verl.speech.reward import compute_score, register_scorer
from maspo_verl.speech.scorer import METRIC_KEYS, SpeechScorer, duration_score, wer_reward
from maspo_verl.speech.settings import SpeechRewardConfig
from maspo_verl.speech.text import normalize_text, word_error_rate
from maspo_verl.speech.tokens import LlasaTokenMap, codes_to_text
from tests.speech.conftest import SENTENCES, WRONG_TEXT

RESULTS: dict[str, float] = {}  # printed at the end (pytest -s) for the report


def test_normalize_and_wer_units():
    assert (
        normalize_text("Mr. Smith's 2 dogs-and 1,500 cats!") == "mr smith's two dogs and one thousand five hundred cats"
    )
    assert normalize_text("Café  “quoted”  ‘it’s’ 50%") == "cafe quoted it's fifty percent"
    assert word_error_rate("Hello, world!", "hello world") == 0.0
    assert word_error_rate("a b c d", "a x c") == pytest.approx(0.5)
    assert word_error_rate("", "") == 0.0 and word_error_rate("", "x") == 1.0 and word_error_rate("a b", "") == 1.0
    assert wer_reward(0.0) == 1.0
    assert wer_reward(1.0) == pytest.approx(1 - math.tanh(3.0))
    assert wer_reward(0.2) > wer_reward(0.4) > wer_reward(1.0) > 0
    text = "x" * 140  # 10 s expected at 14 chars/s
    assert duration_score(10.0, text, 14.0, 1.5) == 1.0 and duration_score(14.0, text, 14.0, 1.5) == 1.0
    assert duration_score(30.0, text, 14.0, 1.5) < 0.6 and duration_score(0.0, text, 14.0, 1.5) == 0.0


def test_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"has unknown keys \[.asr_modle.\]"):
        SpeechRewardConfig.from_dict({"asr_modle": "tiny"})


def test_real_speech_real_asr_with_negative_controls(asr, waves):
    """espeak-ng speech -> Whisper tiny.en -> WER -> reward; wrong text, truncation, noise score lower."""
    s0, s1 = SENTENCES
    w0, w1 = waves[s0], waves[s1]
    noise = (np.random.default_rng(0).standard_normal(len(w0)) * 0.1).astype(np.float32)
    trunc = w0[: len(w0) // 3]
    t = time.perf_counter()
    tr = asr.transcribe_batch([w0, w1, trunc, noise])
    RESULTS["asr_batch_of_4_s"] = time.perf_counter() - t
    wer = {
        "correct_0": word_error_rate(s0, tr[0].text),
        "correct_1": word_error_rate(s1, tr[1].text),
        "wrong_text": word_error_rate(WRONG_TEXT, tr[0].text),
        "truncated": word_error_rate(s0, tr[2].text),
        "noise": word_error_rate(s0, tr[3].text),
    }
    for k, v in wer.items():
        RESULTS[f"wer_{k}"] = v
        RESULTS[f"reward_{k}"] = wer_reward(v)
    RESULTS["no_speech_prob_noise"] = tr[3].no_speech_prob
    RESULTS["no_speech_prob_correct_0"] = tr[0].no_speech_prob
    print({k: round(v, 3) for k, v in RESULTS.items()}, [x.text for x in tr])
    assert wer["correct_0"] <= 0.5 and wer["correct_1"] <= 0.5, [x.text for x in tr]
    assert wer["wrong_text"] >= 0.9
    assert wer["truncated"] >= 0.5
    best = min(wer["correct_0"], wer["correct_1"])
    assert best < wer["truncated"] <= wer["wrong_text"] + 1e-9 or best < wer["truncated"]
    assert wer_reward(wer["correct_0"]) > wer_reward(wer["truncated"]) > wer_reward(wer["wrong_text"]) - 1e-9
    # noise: Whisper flags it as non-speech (the scorer turns that into reward 0) or it fails the WER
    assert tr[3].no_speech_prob > 0.6 or wer["noise"] >= 0.9
    assert tr[0].no_speech_prob < 0.6


class CountingCodec:
    """Wraps a decoder and counts batch calls (to check that scoring is batched)."""

    sample_rate = 16000

    def __init__(self, inner: CodecDecoder):
        self.inner, self.calls, self.sizes = inner, 0, []

    def decode_batch(self, codes):
        self.calls += 1
        self.sizes.append(len(codes))
        return self.inner.decode_batch(codes)


class CountingASR:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def transcribe_batch(self, waves):
        self.calls += 1
        return self.inner.transcribe_batch(waves)


def _dataproto(rows: list[list[int]], texts: list[str], pad: int = 0):
    from verl import DataProto

    T = max(len(r) for r in rows) + 3
    prompts = torch.zeros(len(rows), 4, dtype=torch.long)
    responses = torch.full((len(rows), T), pad, dtype=torch.long)
    attn = torch.zeros(len(rows), 4 + T, dtype=torch.long)
    attn[:, :4] = 1
    for i, r in enumerate(rows):
        responses[i, : len(r)] = torch.tensor(r)
        attn[i, 4 : 4 + len(r)] = 1
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": attn},
        non_tensors={
            "reward_model": np.array([{"ground_truth": t, "style": "rule"} for t in texts], dtype=object),
            "data_source": np.array(["tts/test"] * len(rows), dtype=object),
            "extra_info": np.array([{"index": i} for i in range(len(rows))], dtype=object),
        },
    )


def test_full_reward_from_token_ids_through_verl_manager(asr, waves, llasa_tokenizer):
    """ids -> codes -> stand-in codec -> real ASR -> reward, via SpeechRewardManager.run_single as
    verl's reward-loop worker calls it (one task per sample, concurrently) - batched into one call."""
    from omegaconf import OmegaConf

    from maspo_verl.speech.reward_manager import SpeechRewardManager

    s0, s1 = SENTENCES
    codec = FrameTableCodec(seed=0)
    c0, c1 = codec.encode(waves[s0]), codec.encode(waves[s1])
    m = LlasaTokenMap.from_tokenizer(llasa_tokenizer)
    start, end = m.speech_start_id, m.speech_end_id
    junk = llasa_tokenizer.encode("hello", add_special_tokens=False)
    rng = np.random.default_rng(3)
    rows = {
        "correct": [m.token_id(c) for c in c0] + [end],
        "correct_with_text_junk": [start]
        + [m.token_id(c) for c in c1[:20]]
        + junk
        + [m.token_id(c) for c in c1[20:]]
        + [end]
        + junk,
        "truncated": [m.token_id(c) for c in c0[: len(c0) // 3]] + [end],
        "wrong_text": [m.token_id(c) for c in c0] + [end],
        "random_codes": [m.token_id(int(c)) for c in rng.integers(0, 65536, 120)] + [end],
        "empty": [end],
        "text_only": junk + [end],
    }
    texts = {k: s0 for k in rows} | {"correct_with_text_junk": s1, "wrong_text": WRONG_TEXT}
    names = list(rows)
    data = _dataproto([rows[k] for k in names], [texts[k] for k in names])

    settings = {"codec": "frame_table", "asr_model": "bundled:tiny.en", "asr_device": "cpu", "batch_window_s": 0.2}
    config = OmegaConf.create({"reward": {"custom_reward_function": {"reward_kwargs": settings}}})
    mgr = SpeechRewardManager(config, llasa_tokenizer, None)
    assert mgr.token_map.codec_offset == 128264
    codec_c, asr_c = CountingCodec(codec), CountingASR(asr)
    register_scorer(mgr.speech_config, SpeechScorer(mgr.speech_config, decoder=codec_c, asr=asr_c))

    async def worker():  # what verl's RewardLoopWorker.compute_score_batch does
        return await asyncio.gather(*[mgr.run_single(data[i : i + 1]) for i in range(len(data))])

    t = time.perf_counter()
    out = asyncio.run(worker())
    RESULTS["manager_7_samples_s"] = time.perf_counter() - t
    res = dict(zip(names, out, strict=True))
    for k, r in res.items():
        assert set(r["reward_extra_info"]) == set(METRIC_KEYS), k
        RESULTS[f"ids_reward_{k}"] = r["reward_score"]
        RESULTS[f"ids_wer_{k}"] = r["reward_extra_info"]["wer"]
    print({k: round(v, 3) for k, v in RESULTS.items()})
    assert codec_c.calls == 1 and codec_c.sizes == [5], codec_c.sizes  # empty/text-only never decoded
    assert asr_c.calls == 1
    info = {k: r["reward_extra_info"] for k, r in res.items()}
    score = {k: r["reward_score"] for k, r in res.items()}
    assert info["correct"]["n_codes"] == len(c0) and info["correct"]["duration_s"] == len(c0) * HOP / 16000
    assert info["correct_with_text_junk"]["n_codes"] == len(c1)  # text ids ignored, tail after END dropped
    assert score["correct"] > 0.15 and score["correct_with_text_junk"] > 0.15
    assert score["correct"] > score["truncated"] > score["wrong_text"] - 1e-9
    assert score["random_codes"] == 0.0 and info["random_codes"]["invalid_nonspeech"] == 1.0
    for k in ("empty", "text_only"):
        assert score[k] == 0.0 and info[k]["invalid_empty"] == 1.0
    assert all(info[k]["error"] == 0.0 for k in names)


def test_compute_score_string_path_and_per_sample_failures(asr, waves):
    """The naive-manager path (codes parsed from decoded text); a part failing on a sample scores it 0,
    counted (too many of them raise: tests/speech/test_failures.py); bad settings raise."""
    s0 = SENTENCES[0]

    class Broken:
        sample_rate = 16000

        def decode_batch(self, codes):
            raise RuntimeError("codec exploded")

    class BrokenASR:
        def transcribe_batch(self, waves):
            raise RuntimeError("asr exploded")

    cfg = SpeechRewardConfig(codec="frame_table", asr_model="bundled:tiny.en", min_codes=5)
    register_scorer(cfg, SpeechScorer(cfg, decoder=Broken(), asr=asr))
    kw = {"codec": "frame_table", "asr_model": "bundled:tiny.en", "min_codes": 5}
    r = asyncio.run(compute_score("tts", codes_to_text(range(50)), s0, {}, **kw))
    assert r["score"] == 0.0 and r["invalid_decode"] == 1.0
    r = asyncio.run(compute_score("tts", "no codes at all", s0, {}, **kw))
    assert r["score"] == 0.0 and r["invalid_empty"] == 1.0
    with pytest.raises(ValueError, match="asr_modle"):
        asyncio.run(compute_score("tts", codes_to_text(range(50)), s0, {}, asr_modle="typo"))

    codec = FrameTableCodec(seed=1)
    codes = codec.encode(waves[s0])
    scorer = SpeechScorer(cfg, decoder=codec, asr=BrokenASR())
    out = scorer.score_codes([codes, []], [s0, s0])
    assert [o["score"] for o in out] == [0.0, 0.0] and out[0]["error"] == 1.0 and out[1]["invalid_empty"] == 1.0
    assert [o["failed"] for o in out] == [1.0, 0.0]

    # NaN / silent audio from a codec is non-speech, not a crash
    class Silent:
        sample_rate = 16000

        def decode_batch(self, codes):
            return [np.full(len(c) * HOP, np.nan, dtype=np.float32) for c in codes]

    out = SpeechScorer(cfg, decoder=Silent(), asr=BrokenASR()).score_codes([codes], [s0])
    assert out[0]["score"] == 0.0 and out[0]["invalid_nonspeech"] == 1.0


def test_optional_terms(waves, asr):
    s0 = SENTENCES[0]
    codec = FrameTableCodec(seed=2)
    codes = codec.encode(waves[s0])
    import os
    import tempfile

    import soundfile as sf

    with tempfile.TemporaryDirectory() as d:
        ref = os.path.join(d, "ref.wav")
        sf.write(ref, waves[s0], 16000)
        cfg = SpeechRewardConfig(codec="frame_table", w_wer=0.6, w_spk=0.2, w_dur=0.2, ref_audio=ref)
        out = SpeechScorer(cfg, decoder=codec, asr=asr).score_codes([codes], [s0])[0]
    assert out["spk_sim"] == pytest.approx(1.0, abs=1e-6)  # same clip as the reference
    assert 0.0 < out["dur_score"] <= 1.0
    assert out["score"] == pytest.approx(0.6 * out["wer_reward"] + 0.2 * out["spk_sim"] + 0.2 * out["dur_score"])


def test_print_results():
    print("\nSPEECH RESULTS", {k: round(v, 4) for k, v in RESULTS.items()})
