"""Span credit on the speech side: word alignment -> token spans (hand-made word lists, then real
espeak-ng speech with a word deliberately changed, through the bundled Whisper), per-token scores from
the reward manager, and verl's agent-loop output carrying them into rm_scores."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from maspo_verl.batch import TOKEN_SCORES_KEY
from maspo_verl.plugin.hooks import patch_problem
from maspo_verl.speech.asr import TimedWord
from maspo_verl.speech.codec import HOP, FrameTableCodec
from maspo_verl.speech.reward import register_scorer
from maspo_verl.speech.scorer import SpeechScorer
from maspo_verl.speech.settings import SpeechRewardConfig
from maspo_verl.speech.spans import error_spans, normalised_words, token_penalties, token_range, token_scores
from maspo_verl.speech.tokens import LlasaTokenMap
from tests.speech.test_reward import _dataproto

REF = "Please bring me a glass of cold water."


def timed(text: str, step: float = 0.4) -> list[TimedWord]:
    return [TimedWord(" " + w, k * step, (k + 1) * step) for k, w in enumerate(text.split())]


def kinds(spans):
    return [(s.kind, s.start, s.end, s.ref, s.hyp) for s in spans]


def test_token_range_is_floor_ceil_at_50_hz_clipped_and_never_empty():
    assert token_range(0.31, 0.62, 100) == (15, 31)
    assert token_range(0.3, 0.3, 100) == (15, 16)  # zero-length word: one token
    assert token_range(1.9, 2.5, 100) == (95, 100)  # clipped to the utterance
    assert token_range(2.5, 3.0, 100) == (99, 100)
    assert token_range(-0.1, 0.02, 100) == (0, 1)
    assert token_range(0.0, 1.0, 0) == (0, 0)


def test_known_alignments_substitution_insertion_and_deletions_at_start_middle_end():
    n = 200  # 4 s at 50 Hz; words are 0.4 s = 20 tokens each
    assert error_spans(REF, timed("please bring me a glass of cold water"), n) == []
    assert kinds(error_spans(REF, timed("please bring me a glass of hot water"), n)) == [
        ("substitute", 120, 140, "cold", "hot")
    ]
    assert kinds(error_spans(REF, timed("simply bring me a glass of cold water"), n)) == [
        ("substitute", 0, 20, "please", "simply")
    ]
    assert kinds(error_spans(REF, timed("please bring me a big glass of cold water"), n)) == [
        ("insert", 80, 100, "", "big")
    ]
    # deletion in the middle: the previous word plus the gap up to the next one
    words = timed("please bring me a glass of water")
    words[-1] = TimedWord(" water", 2.6, 3.0)  # a 0.2 s gap where "cold" was
    assert kinds(error_spans(REF, words, n)) == [("delete", 100, 130, "cold", "")]
    # at the start: up to the end of the first recognised word; at the end: last word to the end
    assert kinds(error_spans(REF, timed("bring me a glass of cold water"), n)) == [("delete", 0, 20, "please", "")]
    assert kinds(error_spans(REF, timed("please bring me a glass of cold"), n)) == [("delete", 120, 200, "water", "")]
    # several deleted words at one place give one span each there; nothing recognised: the whole utterance
    assert kinds(error_spans(REF, timed("please bring me a glass"), n)) == [
        ("delete", 80, 200, "of", ""),
        ("delete", 80, 200, "cold", ""),
        ("delete", 80, 200, "water", ""),
    ]
    assert {s.kind for s in error_spans(REF, [], n)} == {"delete"} and error_spans(REF, [], n)[0].end == n
    assert kinds(error_spans("", timed("hello"), n)) == [("insert", 0, 20, "", "hello")]
    assert error_spans("", [], n) == []


def test_words_are_normalised_like_the_wer():
    words = [
        TimedWord(" I", 0.0, 0.2),
        TimedWord(" have", 0.2, 0.4),
        TimedWord(" 25", 0.4, 1.0),
        TimedWord(".", 1.0, 1.1),
    ]
    assert [(w.word, w.start) for w in normalised_words(words)] == [
        ("i", 0.0),
        ("have", 0.2),
        ("twenty", 0.4),
        ("five", 0.4),
    ]
    assert error_spans("I have twenty-five.", words, 60) == []


def test_penalties_spread_per_error_and_scores_sum_to_the_utterance_score():
    spans = error_spans(REF, timed("please bring me a big glass of hot water"), 200)
    pen = token_penalties(spans, 200, penalty=0.5)
    assert sum(pen) == pytest.approx(-0.5 * len(spans)) and len(spans) == 2
    assert pen[85] == pytest.approx(-0.5 / 20) and pen[10] == 0.0
    scores = token_scores(0.42, pen)
    assert sum(scores) == pytest.approx(0.42)
    assert scores[85] < scores[10] and token_scores(0.3, []) == []


# ---- real speech: espeak-ng, the bundled Whisper tiny.en, a word deliberately changed --------------------
CHANGED = {
    # spoken text, kind, reference word, the spoken words before the change (their duration locates it)
    "substitute_middle": ("Please bring me a glass of hot water.", "substitute", "cold", "Please bring me a glass of"),
    "substitute_start": ("Simply bring me a glass of cold water.", "substitute", "please", ""),
    "substitute_end": (
        "Please bring me a glass of cold milk.",
        "substitute",
        "water",
        "Please bring me a glass of cold",
    ),
    "delete_middle": ("Please bring me a glass of water.", "delete", "cold", "Please bring me a glass of"),
    "delete_start": ("bring me a glass of cold water.", "delete", "please", ""),
    "insert_middle": ("Please bring me a big glass of cold water.", "insert", "", "Please bring me a"),
}


@pytest.fixture(scope="module")
def spoken(asr):
    from maspo_verl.speech.testing import espeak

    waves = {k: espeak(v[0]) for k, v in CHANGED.items()} | {"correct": espeak(REF)}
    trs = asr.transcribe_batch(list(waves.values()), word_timestamps=True)
    return {k: (w, tr) for (k, w), tr in zip(waves.items(), trs, strict=True)}


def test_real_asr_word_times_are_ordered_and_inside_the_clip(spoken):
    wave, tr = spoken["correct"]
    assert [w.word.strip(" .") for w in tr.words][:8] == REF.rstrip(".").split()
    starts = [w.start for w in tr.words]
    assert starts == sorted(starts) and all(w.start <= w.end <= len(wave) / 16000 + 0.1 for w in tr.words)
    assert error_spans(REF, tr.words, len(wave) // HOP) == []


@pytest.mark.parametrize("case", CHANGED)
def test_real_asr_locates_the_changed_word(case, spoken):
    from maspo_verl.speech.testing import espeak

    text, kind, ref_word, before = CHANGED[case]
    wave, tr = spoken[case]
    n = len(wave) // HOP
    spans = error_spans(REF, tr.words, n)
    hits = [s for s in spans if s.kind == kind and s.ref == ref_word]
    assert len(hits) == 1, (tr.text, kinds(spans))
    s = hits[0]
    assert 0 <= s.start < s.end <= n
    # independent location: espeak's own duration of the words before the change (it adds ~0.2-0.3 s
    # of trailing silence, so the change starts a little before that)
    t0 = len(espeak(before)) / 16000 if before else 0.0
    if kind == "delete":  # attached to the word before: starts before t0, reaches at least to it
        assert s.start / 50 <= t0 + 0.1 and s.end / 50 >= t0 - 0.6, (t0, kinds(spans))
    else:
        assert abs(s.start / 50 - t0) < 0.6, (t0, kinds(spans))
    if before == "":
        assert s.start == 0
    assert len(spans) <= 2, kinds(spans)  # the change, at most one ASR slip beside it


# ---- reward manager -> per-token scores -> verl's agent-loop output ----------------------------------------
def test_manager_returns_per_token_scores_aligned_with_the_response(asr, spoken, llasa_tokenizer):
    from omegaconf import OmegaConf

    from maspo_verl.speech.reward_manager import SpeechRewardManager

    codec = FrameTableCodec(seed=1)
    m = LlasaTokenMap.from_tokenizer(llasa_tokenizer)
    junk = llasa_tokenizer.encode("hi", add_special_tokens=False)
    c_ok, c_bad = codec.encode(spoken["correct"][0]), codec.encode(spoken["substitute_middle"][0])
    rows = [
        [m.speech_start_id] + [m.token_id(c) for c in c_ok] + [m.speech_end_id],
        [m.token_id(c) for c in c_bad[:30]] + junk + [m.token_id(c) for c in c_bad[30:]] + [m.speech_end_id],
        [m.speech_end_id],
    ]
    settings = {
        "codec": "frame_table",
        "asr_model": "bundled:tiny.en",
        "asr_device": "cpu",
        "batch_window_s": 0.2,
        "token_scores": True,
        "span_penalty": 0.5,
    }
    config = OmegaConf.create({"reward": {"custom_reward_function": {"reward_kwargs": settings}}})
    mgr = SpeechRewardManager(config, llasa_tokenizer, None)
    register_scorer(mgr.speech_config, SpeechScorer(mgr.speech_config, decoder=codec, asr=asr))
    data = _dataproto(rows, [REF] * 3)

    async def worker():
        return await asyncio.gather(*[mgr.run_single(data[i : i + 1]) for i in range(len(data))])

    ok, bad, empty = asyncio.run(worker())
    for r, ids in zip((ok, bad, empty), rows, strict=True):
        scores = r["reward_extra_info"][TOKEN_SCORES_KEY]
        assert len(scores) == len(ids)
        assert sum(scores) == pytest.approx(r["reward_score"], abs=1e-9)
    assert ok["reward_extra_info"]["error_spans"] == 0 and np.ptp(ok["reward_extra_info"][TOKEN_SCORES_KEY][:-1]) == 0
    info = bad["reward_extra_info"]
    assert info["error_spans"] == 1 and info["untimed"] == 0
    scores = np.array(info[TOKEN_SCORES_KEY])
    low = np.flatnonzero(scores[:-1] < scores[:-1].max() - 1e-12)
    # the penalised tokens are codec tokens of the spoken "hot" (after the 3-token text junk at 30)
    assert len(low) > 0 and low.min() > 30 + len(junk)
    spans = error_spans(REF, spoken["substitute_middle"][1].words, len(c_bad))
    a, b = spans[0].start, spans[0].end
    assert list(low) == [k + len(junk) for k in range(a, b)]
    assert empty["reward_score"] == 0.0 and empty["reward_extra_info"][TOKEN_SCORES_KEY] == [0.0]


class NoTimesASR:
    def __init__(self, inner):
        self.inner = inner

    def transcribe_batch(self, waves, word_timestamps=False):
        out = self.inner.transcribe_batch(waves)
        for t in out:
            t.words = None
        return out


def test_asr_without_timestamps_scores_the_utterance_only(asr, spoken):
    config = SpeechRewardConfig(codec="frame_table", token_scores=True)
    codec = FrameTableCodec(seed=2)
    codes = codec.encode(spoken["substitute_middle"][0])
    res = SpeechScorer(config, decoder=codec, asr=NoTimesASR(asr)).score_codes([codes], [REF])[0]
    assert res["untimed"] == 1.0 and res["error_spans"] == 0.0 and res["wer"] > 0
    assert res["code_penalties"] == [0.0] * len(codes) and res["score"] > 0


def test_agent_loop_output_carries_token_scores_into_rm_scores():
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    assert patch_problem("token_scores") is None
    scores = [0.1, -0.2, 0.05, 0.7]
    info = {"score": 0.65, "wer": 0.1, TOKEN_SCORES_KEY: scores}

    def output(n):
        return AgentLoopOutput(
            prompt_ids=[1, 2],
            response_ids=list(range(n)),
            response_mask=[1] * n,
            reward_score=0.65,
            metrics=AgentLoopMetrics(),
            extra_fields={"reward_extra_info": info},
        )

    out = output(4).as_dict()
    assert torch.equal(out["rm_scores"], torch.tensor(scores))
    assert TOKEN_SCORES_KEY not in out["extra_fields"]["reward_extra_info"]
    assert out["extra_fields"]["reward_extra_info"]["wer"] == 0.1
    assert TOKEN_SCORES_KEY in info  # the shared dict is untouched (earlier turns of a session reuse it)
    with pytest.warns(UserWarning, match="do not match the response length"):
        short = output(3).as_dict()
    assert torch.equal(short["rm_scores"], torch.tensor([0.0, 0.0, 0.65]))


def test_span_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("MASPO_SPEECH_TOKEN_SCORES", "false")
    assert SpeechRewardConfig.from_env().token_scores is False  # not bool("false")
    monkeypatch.setenv("MASPO_SPEECH_TOKEN_SCORES", "1")
    monkeypatch.setenv("MASPO_SPEECH_SPAN_PENALTY", "0.25")
    config = SpeechRewardConfig.from_env()
    assert config.token_scores is True and config.span_penalty == 0.25
    monkeypatch.setenv("MASPO_SPEECH_TOKEN_SCORES", "maybe")
    with pytest.raises(ValueError, match="allowed true/false"):
        SpeechRewardConfig.from_env()
