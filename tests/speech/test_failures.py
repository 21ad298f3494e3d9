"""Failures of the speech reward, with real failing parts: what start-up refuses before Ray (a missing ASR
path, a model folder of the wrong kind, a cuda device on a CPU machine, an offline Hub model not in the
cache, a codec that does not import), what raises in the reward worker (a model folder that is there but
broken, a codec that raises on every batch), and what stays a scored, counted sample (1 failed decode of
8); ``max_failed_frac`` at its boundary."""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import pytest
import torch

from maspo_verl.plugin.checks import run_startup_checks
from maspo_verl.plugin.hooks import reward_step_metrics
from maspo_verl.speech.codec import FrameTableCodec
from maspo_verl.speech.reward import compute_score
from maspo_verl.speech.scorer import METRIC_KEYS, SpeechRewardFailure, SpeechScorer
from maspo_verl.speech.settings import SpeechRewardConfig
from maspo_verl.speech.tokens import codes_to_text
from tests.helpers import compose_config
from tests.speech.conftest import SENTENCES

PATH = "reward.custom_reward_function.reward_kwargs"
LOCAL = {"codec": "frame_table", "asr_model": "bundled:tiny.en", "asr_device": "cpu"}
FAILING = "tests.speech.failing_codecs"
REFUSAL_S: dict[str, float] = {}  # seconds from the start-up checks' start to the refusal (printed)


def speech_config(*overrides: str, **settings):
    settings = {**LOCAL, **settings}
    return compose_config(
        "local=cpu",
        "reward.reward_manager.source=importlib",
        "reward.reward_manager.name=SpeechRewardManager",
        "reward.reward_manager.module.path=pkg://maspo_verl.speech.reward_manager",
        *[f"+{PATH}.{k}={v}" for k, v in settings.items() if v is not None],
        *overrides,
    )


def refused(case: str, cfg) -> str:
    """The start-up checks (what ``maspo_verl.main`` runs before Ray) refuse ``cfg``; the error's text."""
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        run_startup_checks(cfg)
    REFUSAL_S[case] = time.perf_counter() - start
    return str(err.value)


def test_the_local_setting_passes():
    issued = run_startup_checks(speech_config())
    assert not [m for m in issued if PATH in m], issued


def test_missing_asr_path(monkeypatch):
    msg = refused("missing ASR path", speech_config(asr_model="/nonexistent/whisper"))
    assert f"{PATH}.asr_model='/nonexistent/whisper': no such folder on this machine" in msg, msg
    # the same value from its variable: the error names the variable
    monkeypatch.setenv("MASPO_SPEECH_ASR_MODEL", "/nonexistent/whisper")
    msg = refused("missing ASR path (variable)", speech_config(asr_model=None))
    assert f"{PATH}.asr_model (set by MASPO_SPEECH_ASR_MODEL)='/nonexistent/whisper': no such folder" in msg, msg


def test_model_folders_of_the_wrong_kind(tmp_path):
    from faster_whisper import WhisperModel
    from transformers import LlamaConfig, WhisperConfig, WhisperForConditionalGeneration

    hf_whisper = tmp_path / "whisper-hf"  # a transformers Whisper checkpoint: faster-whisper cannot load it
    small = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2)
    WhisperForConditionalGeneration(WhisperConfig(encoder_ffn_dim=16, decoder_ffn_dim=16, **small)).save_pretrained(
        hf_whisper
    )
    with pytest.raises(RuntimeError, match="model.bin"):  # the real loader fails on it: refusing it is right
        WhisperModel(str(hf_whisper), device="cpu")
    msg = refused("transformers Whisper as asr_model", speech_config(asr_model=str(hf_whisper)))
    assert f"{PATH}.asr_model='{hf_whisper}': is a transformers Whisper checkpoint, not a CTranslate2 one" in msg
    assert "ct2-transformers-converter --model" in msg, msg

    llama = tmp_path / "llama"
    LlamaConfig().save_pretrained(llama)
    msg = refused("a Llama folder as asr_model", speech_config(asr_model=str(llama)))
    assert f"{PATH}.asr_model='{llama}': is a 'llama' model folder, not a CTranslate2 Whisper model" in msg, msg
    msg = refused("a Whisper folder as codec_model", speech_config(codec="xcodec2", codec_model=str(hf_whisper)))
    assert f"{PATH}.codec_model='{hf_whisper}': is a 'whisper' model folder, not XCodec2" in msg, msg


def test_cuda_device_on_a_cpu_machine():
    cfg = speech_config(asr_device="cuda")
    assert cfg.trainer.device == "cpu"
    if torch.cuda.is_available():  # a GPU machine: cuda is allowed
        run_startup_checks(cfg)
        return
    msg = refused("cuda on a CPU machine", cfg)
    assert f"{PATH}.asr_device='cuda': this machine has no CUDA device" in msg and "allowed cpu or auto" in msg


def test_an_offline_hub_model_must_be_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    msg = refused("offline Hub model not cached", speech_config(asr_model="large-v3"))
    assert f"{PATH}.asr_model='large-v3': Systran/faster-whisper-large-v3 is not in the Hugging Face cache" in msg
    assert "huggingface-cli download Systran/faster-whisper-large-v3` on every node" in msg, msg
    snapshot = tmp_path / "models--Systran--faster-whisper-large-v3" / "snapshots" / "abc"  # the Hub's cache layout
    snapshot.mkdir(parents=True)
    (snapshot / "model.bin").write_bytes(b"")
    (tmp_path / "models--Systran--faster-whisper-large-v3" / "refs").mkdir()
    (tmp_path / "models--Systran--faster-whisper-large-v3" / "refs" / "main").write_text("abc")
    issued = run_startup_checks(speech_config(asr_model="large-v3"))
    assert any("each node running a reward worker needs it there too" in m for m in issued), issued


def test_a_codec_that_does_not_import():
    msg = refused("codec module missing", speech_config(codec="no_such_module:build"))
    assert f"{PATH}.codec='no_such_module:build': cannot be imported here (ModuleNotFoundError" in msg, msg
    msg = refused("codec function missing", speech_config(codec=f"{FAILING}:no_such_factory"))
    assert "cannot be imported here (AttributeError" in msg, msg


def test_the_naive_managers_path_is_checked_too():
    """verl's naive manager with this package's ``compute_score``: the same checks (registered when
    ``maspo_verl.speech.reward`` is imported)."""
    cfg = compose_config(
        "local=cpu",
        "reward.custom_reward_function.path=pkg://maspo_verl.speech.reward",
        "reward.custom_reward_function.name=compute_score",
        f"+{PATH}.codec=frame_table",
        f"+{PATH}.asr_model=/nonexistent/whisper",
    )
    msg = refused("missing ASR path, naive manager", cfg)
    assert f"{PATH}.asr_model='/nonexistent/whisper': no such folder on this machine" in msg, msg


def test_a_dry_run_warns_instead():
    issued = run_startup_checks(speech_config("maspo.dry_run=true", asr_model="/nonexistent/whisper"))
    assert any("no such folder" in m and "(dry run: a real run stops here)" in m for m in issued), issued


def test_preflight_warn_lists_and_off_skips_the_speech_checks():
    issued = run_startup_checks(speech_config("maspo.preflight=warn", asr_model="/nonexistent/whisper"))
    assert any("no such folder" in m and "(maspo.preflight=warn: a real run stops here)" in m for m in issued)
    issued = run_startup_checks(speech_config("maspo.preflight=off", asr_model="/nonexistent/whisper"))
    assert not any("no such folder" in m for m in issued), issued


# ---- in the reward worker ------------------------------------------------------------------------------
def broken_whisper(tmp_path) -> str:
    """The bundled tiny.en with its weights cut short: a folder start-up cannot tell from a good one."""
    from maspo_verl.speech.asr import bundled_model_path

    src, dst = bundled_model_path(), tmp_path / "tiny-broken"
    dst.mkdir()
    for name in os.listdir(src):
        if name != "model.bin":
            shutil.copy(os.path.join(src, name), dst / name)
    with open(os.path.join(src, "model.bin"), "rb") as f:
        (dst / "model.bin").write_bytes(f.read(1 << 20))
    return str(dst)


def test_a_model_that_fails_to_load_raises_in_the_worker(tmp_path, llasa_tokenizer):
    from omegaconf import OmegaConf

    from maspo_verl.speech.reward_manager import SpeechRewardManager
    from tests.speech.test_reward import _dataproto

    folder = broken_whisper(tmp_path)
    settings = {**LOCAL, "asr_model": folder, "batch_window_s": 0.01}
    run_startup_checks(speech_config(asr_model=folder))  # passes: only loading it tells
    mgr = SpeechRewardManager(
        OmegaConf.create({"reward": {"custom_reward_function": {"reward_kwargs": settings}}}), llasa_tokenizer, None
    )
    m = mgr.token_map
    data = _dataproto([[m.token_id(c) for c in range(100)] + [m.speech_end_id]], [SENTENCES[0]])
    for _ in range(2):  # every call raises: nothing is cached or retried behind it
        with pytest.raises(SpeechRewardFailure) as err:
            asyncio.run(mgr.run_single(data[0:1]))
        msg = str(err.value)
        assert "the ASR model failed to load in the reward worker" in msg and f"{PATH}.asr_model='{folder}'" in msg
    with pytest.raises(SpeechRewardFailure, match="the ASR model failed to load"):  # the naive manager's path
        asyncio.run(compute_score("tts", codes_to_text(range(100)), SENTENCES[0], {}, **settings))


def test_a_codec_that_fails_to_load_raises():
    scorer = SpeechScorer(SpeechRewardConfig(codec=f"{FAILING}:unloadable_codec", codec_model="/models/xcodec2"))
    with pytest.raises(SpeechRewardFailure, match=r"the codec failed to load .*OSError: no codec weights at"):
        scorer.score_codes([[1] * 50], [SENTENCES[0]])


def test_a_codec_that_raises_on_every_batch(llasa_tokenizer):
    from omegaconf import OmegaConf

    from maspo_verl.speech.reward_manager import SpeechRewardManager
    from tests.speech.test_reward import _dataproto

    codes, texts = [[k] * 50 for k in range(8)], [SENTENCES[0]] * 8
    scorer = SpeechScorer(SpeechRewardConfig(codec=f"{FAILING}:raising_codec"))
    with pytest.raises(SpeechRewardFailure) as err:
        scorer.score_codes(codes, texts)
    msg = str(err.value)
    assert "8 of the last 8 samples failed (invalid_decode 8, error 0), more than " in msg, msg
    assert f"{PATH}.max_failed_frac=0.5" in msg and msg.count("illegal memory access") == 1, msg
    assert scorer.decoder.calls == 9  # the batch, then each sample alone (to find the ones that fail)

    off = SpeechScorer(SpeechRewardConfig(codec=f"{FAILING}:raising_codec", max_failed_frac=1.0))
    res = off.score_codes(codes, texts)
    assert all(r["score"] == 0.0 and r["invalid_decode"] == 1.0 and r["failed"] == 1.0 for r in res)

    # through verl's reward-loop interface: every concurrent sample of the batch raises
    settings = {"codec": f"{FAILING}:raising_codec", "batch_window_s": 0.2}
    mgr = SpeechRewardManager(
        OmegaConf.create({"reward": {"custom_reward_function": {"reward_kwargs": settings}}}), llasa_tokenizer, None
    )
    data = _dataproto([[mgr.token_map.token_id(c) for c in seq] for seq in codes], texts)

    async def worker():  # what verl's RewardLoopWorker.compute_score_batch does
        return await asyncio.gather(*[mgr.run_single(data[i : i + 1]) for i in range(8)], return_exceptions=True)

    out = asyncio.run(worker())
    assert all(isinstance(o, SpeechRewardFailure) and "8 of the last 8" in str(o) for o in out), out


@pytest.fixture(scope="module")
def clips(waves):
    """7 clips of real speech as frame-table codes (with the codec that decodes them) and their texts."""
    codec = FrameTableCodec(seed=4)
    c0, c1 = (codec.encode(waves[s]) for s in SENTENCES)
    codes = [c0, c1, c0[: len(c0) // 2], c1[: len(c1) // 2], c0, c1, c0[len(c0) // 3 :]]
    return codec, codes, [SENTENCES[k % 2] for k in range(7)]


def bad_code(codec: FrameTableCodec) -> list[int]:
    return [1, 2, codec.codec_size + 5, 3] * 10  # outside the codebook: the codec raises on this sample


def test_one_failed_decode_of_eight_is_scored_and_counted(clips, asr):
    codec, codes, texts = clips
    cfg = SpeechRewardConfig(codec="frame_table")
    res = SpeechScorer(cfg, decoder=codec, asr=asr).score_codes(
        codes[:3] + [bad_code(codec)] + codes[3:], texts[:3] + [texts[0]] + texts[3:]
    )
    alone = SpeechScorer(cfg, decoder=codec, asr=asr).score_codes(codes, texts)  # the 7, without the bad one
    bad = res.pop(3)
    assert bad["score"] == 0.0 and bad["invalid_decode"] == 1.0 and bad["failed"] == 1.0 and bad["error"] == 0.0
    for got, ref in zip(res, alone, strict=True):
        assert {k: got[k] for k in METRIC_KEYS if k != "score_s"} == {k: ref[k] for k in METRIC_KEYS if k != "score_s"}
    assert min(res[0]["score"], res[1]["score"]) > 0.15 and res[0]["score"] > res[2]["score"]  # full > half clip
    metrics = reward_step_metrics(res + [bad])  # what the trainer logs for such a step
    assert metrics["reward/failed/mean"] == 1 / 8 and metrics["reward/invalid_decode/mean"] == 1 / 8
    assert metrics["reward/score_s/mean"] > 0


def test_five_of_eight_raise_by_default_and_pass_when_off(clips, asr):
    codec, codes, texts = clips
    batch, text = [bad_code(codec)] * 5 + codes[:3], [texts[0]] * 5 + texts[:3]
    with pytest.raises(SpeechRewardFailure, match=r"5 of the last 8 samples failed \(invalid_decode 5, error 0\)"):
        SpeechScorer(SpeechRewardConfig(codec="frame_table"), decoder=codec, asr=asr).score_codes(batch, text)
    off = SpeechRewardConfig(codec="frame_table", max_failed_frac=1.0)
    res = SpeechScorer(off, decoder=codec, asr=asr).score_codes(batch, text)
    assert [r["invalid_decode"] for r in res] == [1.0] * 5 + [0.0] * 3
    assert all(r["score"] == 0.0 for r in res[:5]) and min(res[5]["score"], res[6]["score"]) > 0.15, res


def test_the_failed_fraction_is_judged_over_the_recent_samples():
    """verl's streaming reward sends samples as they finish: small batches. The fraction is judged over
    the last max_batch samples, from 8 on; invalid_empty is the sample's content, not a failure."""
    codec = FrameTableCodec()
    scorer = SpeechScorer(SpeechRewardConfig(codec="frame_table"), decoder=codec, asr=None)  # nothing transcribed
    for _ in range(4):
        assert scorer.score_codes([bad_code(codec)], [SENTENCES[0]])[0]["invalid_decode"] == 1.0  # < 8 judged
    res = scorer.score_codes([[]] * 4, [SENTENCES[0]] * 4)  # 4 empty: 4 failed of 8, not more than half
    assert all(r["invalid_empty"] == 1.0 and r["failed"] == 0.0 for r in res)
    with pytest.raises(SpeechRewardFailure, match="5 of the last 9 samples failed"):
        scorer.score_codes([bad_code(codec)], [SENTENCES[0]])


def test_print_refusal_times():
    print("\nSTART-UP REFUSALS (s)", {k: round(v, 2) for k, v in REFUSAL_S.items()})


def test_the_trainer_hooks_install_with_verls_v1_trainer(monkeypatch):
    """The reward's failure reaches verl's v1 trainer, and its metrics the step's log, through two hooks
    installed when verl imports its v1 trainer (not before: that import resolves verl's device)."""
    from verl.trainer.ppo.v1 import replay_buffer, trainer_base

    from maspo_verl.plugin import hooks

    assert hooks.PATCHES["reward_metrics"] is None and hooks.PATCHES["run_failure"] is None
    assert trainer_base.PPOTrainer._compute_metrics.__maspo_original__
    assert replay_buffer.ReplayBuffer.sample.__maspo_original__ and replay_buffer.ReplayBufferAsync.sample
    sample = hooks._stop_on_reported_failure(lambda self, *a: "the batch")
    monkeypatch.setattr(hooks, "reported_run_failure", lambda: None)
    assert sample(None, 1, "train", 16) == "the batch"
    monkeypatch.setattr(hooks, "reported_run_failure", lambda: "speech reward: 8 of the last 8 samples failed")
    with pytest.raises(RuntimeError, match="the run stops: speech reward: 8 of the last 8 samples failed"):
        sample(None, 1, "train", 16)
