"""Data preparation on local fixture files: verl's schema, answers, prompts, concatenation."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from maspo_verl.math import prepare
from tests.math.fixtures import FIXTURES

EXPECTED = {  # output file -> ground truths, in order
    "gsm8k_train.parquet": ["7", "2000"],  # "#### 2,000" -> 2000; the row without #### is dropped
    "gsm8k_test.parquet": ["42"],
    "math_train.parquet": ["\\frac{3}{4}", "\\left( 3, \\frac{\\pi}{2} \\right)"],  # last \boxed{}; no box: dropped
    "math500_test.parquet": ["4", "\\frac{3}{4}"],
    "dapo17k_train.parquet": ["1024", "4"],  # duplicate problem removed
    "aime24_test.parquet": ["24", "1001"],  # "024" -> 24
    "aime25_test.parquet": ["243"],
}


def _rows(path):
    return pq.read_table(path).to_pylist()


def test_every_file_written(prepared_dir):
    assert sorted(p.name for p in prepared_dir.glob("*.parquet")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_verl_schema_and_answers(prepared_dir, name):
    rows = _rows(prepared_dir / name)
    assert [r["reward_model"]["ground_truth"] for r in rows] == EXPECTED[name]
    data_source = name.rsplit("_", 1)[0]
    for i, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == data_source
        assert row["ability"] == "math"
        assert row["reward_model"]["style"] == "rule"
        (message,) = row["prompt"]
        assert message["role"] == "user"
        assert message["content"].endswith(prepare.BOXED_INSTRUCTION)
        assert row["extra_info"]["problem"] in message["content"]
        assert row["extra_info"]["index"] == i
        assert row["extra_info"]["answer"] == row["reward_model"]["ground_truth"]
        assert row["extra_info"]["split"] == name.rsplit("_", 1)[1].removesuffix(".parquet")


def test_dapo_instruction_unwrapped(prepared_dir):
    rows = _rows(prepared_dir / "dapo17k_train.parquet")
    content = rows[0]["prompt"][0]["content"]
    assert content == f"What is $2^{{10}}$?\n{prepare.BOXED_INSTRUCTION}"
    assert "Answer:" not in content


def test_meta_kept(prepared_dir):
    rows = _rows(prepared_dir / "math_train.parquet")
    assert rows[0]["extra_info"]["level"] == "Level 1"
    assert rows[0]["extra_info"]["subject"] == "Prealgebra"
    assert _rows(prepared_dir / "math500_test.parquet")[1]["extra_info"]["level"] == "2"  # int -> str


def test_files_concatenate_like_verl(prepared_dir):
    """verl's RLHFDataset loads each file with `datasets` and concatenates them: schemas must match."""
    import datasets

    parts = [
        datasets.load_dataset("parquet", data_files=str(p))["train"] for p in sorted(prepared_dir.glob("*.parquet"))
    ]
    merged = datasets.concatenate_datasets(parts)
    assert len(merged) == sum(len(v) for v in EXPECTED.values())


def test_parquet_input_and_system_prompt_and_limit(tmp_path):
    import pyarrow as pa

    raw = prepare.read_local(str(FIXTURES / "math500_test.jsonl"))
    src = tmp_path / "math500.parquet"
    pq.write_table(pa.Table.from_pylist(raw), src)
    assert prepare.read_local(str(src)) == raw
    rows = prepare.to_verl_rows("math500", "test", prepare.read_local(str(src)), system_prompt=True, limit=1)
    assert len(rows) == 1
    assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user"]
    assert rows[0]["prompt"][0]["content"] == prepare.BOXED_INSTRUCTION
    assert rows[0]["prompt"][1]["content"] == raw[0]["problem"]


def test_json_list_and_jsonl_both_read(tmp_path):
    data = [{"problem": "p", "answer": "1"}]
    (tmp_path / "a.json").write_text(json.dumps(data))
    (tmp_path / "b.jsonl").write_text(json.dumps(data[0]) + "\n")
    assert prepare.read_local(str(tmp_path / "a.json")) == prepare.read_local(str(tmp_path / "b.jsonl")) == data


def test_last_boxed_nested():
    assert prepare.last_boxed("x \\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert prepare.last_boxed("no box") is None
    assert prepare.last_boxed("\\boxed{open") is None


@pytest.mark.parametrize(
    "spec, message",
    [
        (["gsm8k=x.jsonl"], "say which"),
        (["nope=x.jsonl"], "expected NAME"),
        (["math:test=x.jsonl"], "has splits"),
    ],
)
def test_bad_local_specs(spec, message):
    with pytest.raises(SystemExit, match=message):
        prepare.parse_local(spec)


def test_missing_local_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        prepare.main(["--out-dir", str(tmp_path), "--only-local", "--local", "aime25=/nonexistent.jsonl"])


def test_file_without_usable_rows_is_an_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"unrelated": 1}) + "\n")
    with pytest.raises(ValueError, match="no usable rows"):
        prepare.main(["--out-dir", str(tmp_path), "--only-local", "--local", f"aime25={bad}"])


@pytest.mark.parametrize("how", ["unreachable", "offline"])
def test_without_the_hub_one_line_points_to_local_files(tmp_path, how):
    """No Hub (a closed port, or offline mode with nothing cached): within seconds, one line naming
    ``--local ... --only-local``, no traceback, nothing written."""
    import os
    import subprocess
    import sys
    import time

    from tests.helpers import REPO

    env = {k: v for k, v in os.environ.items() if "PROXY" not in k.upper()}
    env.update(PYTHONPATH=str(REPO), HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9")
    if how == "offline":
        env["HF_HUB_OFFLINE"] = "1"
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "maspo_verl.math.prepare", "--out-dir", str(tmp_path / "out"), "--datasets", "math500"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert time.monotonic() - start < 60
    assert out.returncode == 1 and out.stdout == "", out
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("python -m maspo_verl.math.prepare: math500 comes from the Hugging Face Hub ")
    assert line.endswith("--local math500:test=FILE ... --only-local"), line
    assert ("http://127.0.0.1:9 is not reachable" if how == "unreachable" else "offline mode is set") in line
    assert not (tmp_path / "out").exists()
