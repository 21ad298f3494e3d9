"""Word ids for MASPO's segment_rule=words on the speech side: the reward manager turns them on when the
loss needs them and places each code's word id at the code's position in the response (real espeak-ng
speech through the stand-in codec and the bundled Whisper); verl's agent-loop output carries them as a
tensor field; start-up checks."""

from __future__ import annotations

import asyncio

import pytest
import torch
from omegaconf import OmegaConf

from maspo_verl.batch import NO_WORD, TOKEN_SCORES_KEY, WORD_IDS_KEY
from maspo_verl.config import GranularLossConfig
from maspo_verl.plugin.checks import run_startup_checks
from maspo_verl.speech.codec import FrameTableCodec
from maspo_verl.speech.reward import register_scorer
from maspo_verl.speech.scorer import SpeechScorer
from maspo_verl.speech.settings import SpeechRewardConfig
from maspo_verl.speech.spans import word_token_ids
from maspo_verl.speech.tokens import LlasaTokenMap
from tests.helpers import compose_config
from tests.speech.test_reward import _dataproto

REF = "Please bring me a glass of cold water."
SETTINGS = {"codec": "frame_table", "asr_model": "bundled:tiny.en", "asr_device": "cpu", "batch_window_s": 0.2}


class RecordingASR:
    """The real ASR, remembering the transcripts it returned."""

    def __init__(self, inner):
        self.inner = inner
        self.seen = []

    def transcribe_batch(self, waves, word_timestamps=False):
        out = self.inner.transcribe_batch(waves, word_timestamps=word_timestamps)
        self.seen += out
        return out


def manager_config(segment_rule: str):
    """A trainer config's reward settings and a complete MASPO policy-loss config (the dataclass defaults)."""
    policy_loss = OmegaConf.structured(GranularLossConfig(loss_mode="maspo", segment_rule=segment_rule))
    return OmegaConf.create(
        {
            "reward": {"custom_reward_function": {"reward_kwargs": dict(SETTINGS)}},
            "actor_rollout_ref": {"actor": {"policy_loss": policy_loss}},
        }
    )


def test_manager_places_word_ids_at_the_codes_positions(asr, llasa_tokenizer):
    from maspo_verl.speech.reward_manager import SpeechRewardManager
    from maspo_verl.speech.testing import espeak

    assert SpeechRewardManager(manager_config("tokenval"), llasa_tokenizer, None).speech_config.word_ids is False
    mgr = SpeechRewardManager(manager_config("words"), llasa_tokenizer, None)
    assert mgr.speech_config.word_ids is True and mgr.speech_config.token_scores is False
    codec = FrameTableCodec(seed=3)
    recorder = RecordingASR(asr)
    register_scorer(mgr.speech_config, SpeechScorer(mgr.speech_config, decoder=codec, asr=recorder))
    m = LlasaTokenMap.from_tokenizer(llasa_tokenizer)
    junk = llasa_tokenizer.encode("hi", add_special_tokens=False)
    codes = codec.encode(espeak(REF))
    rows = [
        [m.speech_start_id] + [m.token_id(c) for c in codes[:40]] + junk + [m.token_id(c) for c in codes[40:]],
        [m.speech_end_id],  # no codes: invalid_empty, no words
    ]
    data = _dataproto(rows + [rows[0] + [m.speech_end_id]], [REF] * 3)

    async def worker():
        return await asyncio.gather(*[mgr.run_single(data[i : i + 1]) for i in range(len(data))])

    speech, empty, _ = asyncio.run(worker())
    words = speech["reward_extra_info"][WORD_IDS_KEY]
    assert TOKEN_SCORES_KEY not in speech["reward_extra_info"]
    assert len(words) == len(rows[0])
    # one batch with the two speech samples, in sample order: the first transcript is sample 0's
    assert len(recorder.seen) == 2 and recorder.seen[0].words
    expected = word_token_ids(recorder.seen[0].words, len(codes))
    positions = list(range(1, 41)) + list(range(41 + len(junk), len(rows[0])))
    assert [words[p] for p in positions] == expected
    assert words[0] == NO_WORD and all(words[41 + k] == NO_WORD for k in range(len(junk)))  # text tokens
    assert len({w for w in words if w != NO_WORD}) >= len(REF.split()) - 1  # Whisper heard the sentence
    assert empty["reward_extra_info"][WORD_IDS_KEY] == [NO_WORD]


def test_agent_loop_output_carries_word_ids_as_a_tensor_field():
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    info = {"score": 0.5, WORD_IDS_KEY: [NO_WORD, 0, 0, 1]}

    def output(n, extra=info):
        return AgentLoopOutput(
            prompt_ids=[1, 2],
            response_ids=list(range(n)),
            response_mask=[1] * n,
            reward_score=0.5,
            metrics=AgentLoopMetrics(),
            extra_fields={"reward_extra_info": extra},
        )

    out = output(4).as_dict()
    assert torch.equal(out[WORD_IDS_KEY], torch.tensor([NO_WORD, 0, 0, 1]))
    assert out[WORD_IDS_KEY].dtype == torch.int64
    assert WORD_IDS_KEY not in out["extra_fields"]["reward_extra_info"] and WORD_IDS_KEY in info
    assert torch.equal(out["rm_scores"], torch.tensor([0.0, 0.0, 0.0, 0.5]))  # no per-token scores
    with pytest.warns(UserWarning, match="word ids do not match the response length"):
        short = output(3).as_dict()
    assert torch.equal(short[WORD_IDS_KEY], torch.full((3,), NO_WORD))
    assert torch.equal(output(2, {"score": 0.5, WORD_IDS_KEY: []}).as_dict()[WORD_IDS_KEY], torch.full((2,), NO_WORD))
    assert WORD_IDS_KEY not in output(2, {"score": 0.5}).as_dict()


def speech_config(*overrides):
    rk = "+reward.custom_reward_function.reward_kwargs"
    return compose_config(
        "reward.reward_manager.source=importlib",
        "reward.reward_manager.name=SpeechRewardManager",
        "reward.reward_manager.module.path=pkg://maspo_verl.speech.reward_manager",
        f"{rk}.codec=frame_table",
        f"{rk}.asr_model=bundled:tiny.en",
        f"{rk}.asr_device=cpu",
        *overrides,
    )


def test_startup_checks_for_word_segments():
    assert run_startup_checks(speech_config("loss=maspo_words")) == []
    with pytest.raises(ValueError, match="segment_rule='words' needs trainer.use_v1=true"):
        run_startup_checks(speech_config("loss=maspo_words", "trainer.use_v1=false"))
    issued = run_startup_checks(compose_config("loss=maspo_words"))  # verl's own reward manager: no word ids
    assert any("every sample takes policy_loss.words_fallback_rule" in m for m in issued)
    assert SpeechRewardConfig.from_dict({"word_ids": True}).word_ids is True
