"""Speech reward settings are checked when the config is built (every field: type and range, the
error naming reward.custom_reward_function.reward_kwargs.<field> and the allowed values), also on
the trainer's start-up path; a missing ground truth or speaker reference is flagged per sample and
scores 0 (never scored against the text "None")."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import pickle

import numpy as np
import pytest

from maspo_verl.speech.asr import Transcript
from maspo_verl.speech.codec import HOP
from maspo_verl.speech.reward import compute_score, register_scorer
from maspo_verl.speech.scorer import METRIC_KEYS, SpeechScorer, wer_reward
from maspo_verl.speech.settings import SpeechRewardConfig
from maspo_verl.speech.tokens import codes_to_text
from tests.helpers import compose_config

PATH = "reward.custom_reward_function.reward_kwargs"
NAN, INF = float("nan"), float("inf")

# (field, bad value, the allowed values the error must name); every field appears at least once
BAD = [
    ("codec", "encodec", "xcodec2, frame_table or module:function"),
    ("codec_model", "", "a non-empty string"),
    ("codec_device", "gpu", "auto, cpu, cuda or cuda:<index>"),
    ("codec_batch", 0, "an integer >= 1"),
    ("codec_batch", "16", "an integer >= 1"),
    ("asr_model", None, "a non-empty string"),
    ("asr_device", "cuda:x", "auto, cpu, cuda or cuda:<index>"),
    ("asr_compute_type", "fp16", "one of default, auto, int8"),
    ("asr_batch", 2.0, "an integer >= 1"),
    ("asr_beam", True, "an integer >= 1"),
    ("language", "english", "a Whisper language code"),
    ("wer_scale", NAN, "a finite number > 0.0"),
    ("wer_scale", 0, "a finite number > 0.0"),
    ("w_wer", INF, "a finite number >= 0.0"),
    ("w_wer", "1", "a finite number >= 0.0"),
    ("w_spk", -0.1, "a finite number >= 0.0"),
    ("w_dur", True, "a finite number >= 0.0"),
    ("speaker_embedder", "my_embedder", "logmel or module:function"),
    ("ref_audio", "/nonexistent/speaker.wav", "the path of an existing sound file"),
    ("chars_per_second", 0, "a finite number > 0.0"),
    ("duration_tolerance", 0, "a finite number >= 1.0"),
    ("token_scores", "false", "true or false"),
    ("span_penalty", -1, "a finite number >= 0.0"),
    ("word_ids", 1, "true or false"),
    ("min_rms", NAN, "a finite number >= 0.0"),
    ("no_speech_threshold", 1.5, "a finite number >= 0.0 and <= 1.0"),
    ("min_codes", 0, "an integer >= 1"),
    ("batch_window_s", -0.01, "a finite number >= 0.0 and <= 60.0"),
    ("max_batch", 0.5, "an integer >= 1"),
    ("max_failed_frac", 1.5, "a finite number >= 0.0 and <= 1.0"),
]


def test_every_field_has_a_bad_value_case():
    assert {f for f, _, _ in BAD} == {f.name for f in dataclasses.fields(SpeechRewardConfig)}


@pytest.mark.parametrize("field,value,allowed", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_setting_names_the_field_path_and_the_allowed_values(field, value, allowed):
    for build in (lambda: SpeechRewardConfig.from_dict({field: value}), lambda: SpeechRewardConfig(**{field: value})):
        with pytest.raises(ValueError) as err:
            build()
        msg = str(err.value)
        assert msg.startswith(f"{PATH}.{field}={value!r} is invalid: allowed "), msg
        assert allowed in msg, msg
        assert str(pickle.loads(pickle.dumps(err.value))) == msg  # crosses process boundaries (Ray) intact


def test_good_settings_pass_and_numbers_become_floats(tmp_path):
    import soundfile as sf

    ref = tmp_path / "ref.wav"
    sf.write(ref, np.zeros(1600, np.float32), 16000)
    c = SpeechRewardConfig.from_dict(
        {
            "wer_scale": 3,
            "w_wer": 0,
            "w_spk": 1,
            "ref_audio": str(ref),
            "duration_tolerance": 1,
            "no_speech_threshold": 1,
            "batch_window_s": 0,
            "asr_device": "cuda:1",
            "speaker_embedder": "my_pkg.spk:embed",
            "language": "de",
            "asr_compute_type": "int8_float16",
        }
    )
    assert c.wer_scale == 3.0 and isinstance(c.wer_scale, float) and isinstance(c.w_spk, float)
    assert SpeechRewardConfig(w_spk=0.5).ref_audio == ""  # references may come per sample (extra_info)


def test_all_weights_zero_is_rejected():
    with pytest.raises(ValueError, match=rf"{PATH}\.w_wer/w_spk/w_dur are all 0.*at least one > 0"):
        SpeechRewardConfig.from_dict({"w_wer": 0.0})


def test_unknown_setting_lists_the_allowed_ones():
    match = rf"(?s){PATH} has unknown keys \['wer_scael'\]: did you mean `wer_scale`\?.*allowed keys:.*wer_scale"
    with pytest.raises(ValueError, match=match):
        SpeechRewardConfig.from_dict({"wer_scael": 3.0})


def test_environment_settings_name_the_variable(monkeypatch):
    monkeypatch.setenv("MASPO_SPEECH_WER_SCALE", "nan")
    with pytest.raises(ValueError, match=rf"{PATH}\.wer_scale=nan is invalid.*\(set by MASPO_SPEECH_WER_SCALE\)"):
        SpeechRewardConfig.from_env()
    assert SpeechRewardConfig.from_env({"wer_scale": 2.0}).wer_scale == 2.0  # an override wins
    monkeypatch.setenv("MASPO_SPEECH_CODEC_BATCH", "sixteen")
    with pytest.raises(ValueError, match=rf"MASPO_SPEECH_CODEC_BATCH='sixteen' \({PATH}\.codec_batch\).*an integer"):
        SpeechRewardConfig.from_env({"wer_scale": 2.0})


@pytest.mark.parametrize(
    "override,field",
    [("wer_scale=nan", "wer_scale"), ("w_wer=inf", "w_wer"), ("chars_per_second=0", "chars_per_second")],
)
def test_start_up_fails_before_ray(override, field):
    """The trainer entry point (dry run: start-up checks, no Ray) rejects the setting, naming it."""
    from maspo_verl.main import run

    cfg = compose_config("recipe=speech", "maspo.dry_run=true", f"+{PATH}.{override}")
    with pytest.raises(ValueError, match=rf"{PATH}\.{field}=.* is invalid: allowed a finite number"):
        run(cfg)


# ---- per sample: ground truth and speaker reference --------------------------------------------------
class EchoASR:
    """Hears exactly the text registered for a clip (keyed by its length): WER 0 on the right text."""

    def __init__(self, heard: dict[int, str]):
        self.heard, self.calls = heard, 0

    def transcribe_batch(self, waves, word_timestamps=False):
        self.calls += 1
        return [Transcript(self.heard[len(w)], 0.01, -0.1, None) for w in waves]


class ToneCodec:
    """Codes -> a tone of len(codes) frames (speech-level RMS); counts decoded clips."""

    sample_rate = 16000

    def __init__(self):
        self.decoded = 0

    def decode_batch(self, codes):
        self.decoded += len(codes)
        return [0.1 * np.sin(np.arange(len(c) * HOP, dtype=np.float32) * 0.05) for c in codes]


TEXT = "Please bring me a glass of cold water."


def test_missing_ground_truth_is_its_own_error_never_the_text_none():
    texts = [None, "", "  ...  ", 42, ["a", "list"], TEXT, "None"]
    codes = [[1] * (20 + k) for k in range(len(texts))]  # distinct lengths: EchoASR tells them apart
    heard = {len(c) * HOP: "None" for c in codes}  # a TTS that literally said "None"
    heard[len(codes[5]) * HOP] = TEXT
    codec, asr = ToneCodec(), EchoASR(heard)
    res = SpeechScorer(SpeechRewardConfig(), decoder=codec, asr=asr).score_codes(codes, texts)
    for r in res[:5]:
        assert r["invalid_reference"] == 1.0 and r["score"] == 0.0 and r["error"] == 0.0, r
    assert res[5]["score"] == 1.0 and res[5]["wer"] == 0.0 and res[5]["invalid_reference"] == 0.0
    assert res[6]["score"] == 1.0  # the word "None" as a real ground truth is scored like any text
    assert codec.decoded == 2 and asr.calls == 1  # flagged samples are never decoded or transcribed
    assert all(set(r) == set(METRIC_KEYS) for r in res)


def test_missing_ground_truth_through_verl_entry_points(llasa_tokenizer):
    """compute_score (naive manager) and SpeechRewardManager (no ground_truth key) flag it too."""
    from omegaconf import OmegaConf

    from maspo_verl.speech.reward_manager import SpeechRewardManager
    from tests.speech.test_reward import _dataproto

    settings = {"codec": "frame_table", "batch_window_s": 0.01}
    config = SpeechRewardConfig.from_dict(settings)
    register_scorer(config, SpeechScorer(config, decoder=ToneCodec(), asr=EchoASR({})))
    r = asyncio.run(compute_score("tts", codes_to_text(range(50)), None, {}, **settings))
    assert r["invalid_reference"] == 1.0 and r["score"] == 0.0 and r["error"] == 0.0

    cfg = OmegaConf.create({"reward": {"custom_reward_function": {"reward_kwargs": settings}}})
    mgr = SpeechRewardManager(cfg, llasa_tokenizer, None)
    m = mgr.token_map
    data = _dataproto([[m.token_id(c) for c in range(50)] + [m.speech_end_id]], [TEXT])
    data.non_tensor_batch["reward_model"][0] = {"style": "rule"}  # no ground_truth key
    out = asyncio.run(mgr.run_single(data[0:1]))
    assert out["reward_score"] == 0.0 and out["reward_extra_info"]["invalid_reference"] == 1.0
    assert out["reward_extra_info"]["error"] == 0.0


def test_speaker_reference_checked_per_sample(tmp_path):
    import soundfile as sf

    ref = tmp_path / "ref.wav"
    sf.write(ref, 0.1 * np.sin(np.arange(16000, dtype=np.float32) * 0.05), 16000)
    codes = [[1] * 30, [1] * 31, [1] * 32, [1] * 33]
    extra = [None, {"ref_audio": str(ref)}, {"ref_audio": str(tmp_path / "gone.wav")}, {"ref_audio": ""}]
    asr = EchoASR({len(c) * HOP: TEXT for c in codes})
    config = SpeechRewardConfig(w_wer=0.5, w_spk=0.5)  # no ref_audio: each sample must bring one
    res = SpeechScorer(config, decoder=ToneCodec(), asr=asr).score_codes(codes, [TEXT] * 4, extra)
    for k in (0, 2, 3):
        assert res[k]["invalid_ref_audio"] == 1.0 and res[k]["score"] == 0.0 and res[k]["error"] == 0.0, k
    assert res[1]["invalid_ref_audio"] == 0.0 and res[1]["spk_sim"] > 0.9  # the same tone
    assert res[1]["score"] == pytest.approx(0.5 * wer_reward(0.0) + 0.5 * res[1]["spk_sim"])
    # a configured reference serves every sample without its own
    config = SpeechRewardConfig(w_wer=0.5, w_spk=0.5, ref_audio=str(ref))
    res = SpeechScorer(config, decoder=ToneCodec(), asr=asr).score_codes(codes[:1], [TEXT], [None])
    assert res[0]["invalid_ref_audio"] == 0.0 and res[0]["spk_sim"] > 0.9


def nan_embedder(wave, sample_rate):
    return np.full(8, np.nan)


def test_non_finite_score_is_an_error_not_a_silent_zero(tmp_path):
    import soundfile as sf

    ref = tmp_path / "ref.wav"
    sf.write(ref, np.ones(1600, np.float32) * 0.1, 16000)
    config = SpeechRewardConfig(w_spk=0.5, ref_audio=str(ref), speaker_embedder=f"{__name__}:nan_embedder")
    codes = [[1] * 30]
    res = SpeechScorer(config, decoder=ToneCodec(), asr=EchoASR({30 * HOP: TEXT})).score_codes(codes, [TEXT])
    assert res[0]["error"] == 1.0 and res[0]["score"] == 0.0 and not math.isnan(res[0]["spk_sim"])
