"""Data preparation from local fixture files (no hub access) and the chat-template CLI."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from maspo_verl.speech import prepare

FIX = Path(__file__).resolve().parent / "fixtures"


def test_prepare_local_files(tmp_path):
    out = tmp_path / "data"
    argv = [
        "data",
        "--files",
        str(FIX / "texts.txt"),
        str(FIX / "texts.jsonl"),
        str(FIX / "texts.csv"),
        "--out-dir",
        str(out),
        "--val-size",
        "2",
        "--max-chars",
        "200",
        "--ref-audio",
        "/refs/spk.wav",
    ]
    assert prepare.main(argv) == 0
    train, test = pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "test.parquet")
    assert len(test) == 2
    texts = sorted(
        list(train["reward_model"].map(lambda r: r["ground_truth"]))
        + list(test["reward_model"].map(lambda r: r["ground_truth"]))
    )
    # "Hi." too short, the blank line dropped, the lower-case duplicate dropped, the long one > 200 chars
    assert texts == sorted(
        [
            "The quick brown fox jumps over the lazy dog.",
            "I would like a cup of hot tea with milk.",
            "Please call Stella and ask her to bring these things.",
            "It is 5 o'clock and the bus is late again.",
            "A rainbow is a division of white light, seen in the sky.",
            "Numbers like 1,500 are read out in words.",
        ]
    )
    row = train.iloc[0]
    assert set(train.columns) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == "tts/local" and row["ability"] == "tts"
    prompt = list(row["prompt"])
    assert len(prompt) == 1 and prompt[0]["role"] == "user"
    gt = row["reward_model"]["ground_truth"]
    assert (
        prompt[0]["content"] == f"Convert the text to speech:<|TEXT_UNDERSTANDING_START|>{gt}<|TEXT_UNDERSTANDING_END|>"
    )
    assert row["extra_info"]["text"] == gt and row["extra_info"]["ref_audio"] == "/refs/spk.wav"
    assert row["extra_info"]["split"] == "train" and test.iloc[0]["extra_info"]["split"] == "test"


def test_prepare_no_input(tmp_path):
    assert prepare.main(["data", "--out-dir", str(tmp_path)]) == 2


def test_chat_template_cli(llasa_tokenizer, tmp_path, capsys):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from maspo_verl.speech.tokens import speech_chat_template

    path = llasa_tokenizer.name_or_path
    assert prepare.main(["chat-template", "--tokenizer", str(path), "--hydra"]) == 0
    line = capsys.readouterr().out.strip()
    o = OverridesParser.create().parse_override(line)
    assert o.key_or_group == "actor_rollout_ref.model.custom_chat_template"
    assert o.value() == speech_chat_template(llasa_tokenizer)


def test_stop_token_cli(llasa_tokenizer, tmp_path):
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(llasa_tokenizer.name_or_path, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 128001}))
    assert prepare.main(["stop-token", "--model", str(model)]) == 1
    assert prepare.main(["stop-token", "--model", str(model), "--write"]) == 0
    assert json.loads((model / "generation_config.json").read_text())["eos_token_id"] == [128001, 128261]


REMOTE_TOKENIZER = """import os
from transformers import PreTrainedTokenizerFast
open(os.environ["MASPO_TEST_REMOTE_CODE_RAN"], "w").close()
class MarkTokenizer(PreTrainedTokenizerFast):
    pass
"""


def test_chat_template_runs_no_tokenizer_code_unless_asked(llasa_tokenizer, tmp_path, monkeypatch, capsys):
    """A tokenizer folder that ships its own class (``auto_map``): its code does not run by default
    (transformers loads the built-in class it names), and runs with ``--trust-remote-code``."""
    import json
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(llasa_tokenizer.name_or_path, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "mark_tokenizer.MarkTokenizer"]}
    config_path.write_text(json.dumps(config))
    (folder / "mark_tokenizer.py").write_text(REMOTE_TOKENIZER)
    marker = tmp_path / "ran"
    monkeypatch.setenv("MASPO_TEST_REMOTE_CODE_RAN", str(marker))
    assert prepare.main(["chat-template", "--tokenizer", str(folder), "--hydra"]) == 0
    assert not marker.exists()
    assert prepare.main(["chat-template", "--tokenizer", str(folder), "--hydra", "--trust-remote-code"]) == 0
    assert marker.exists() and "custom_chat_template=" in capsys.readouterr().out
