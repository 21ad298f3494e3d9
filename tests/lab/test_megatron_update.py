"""maspo_verl.lab.studies.megatron_update: one actor update of verl's Megatron engine with our loss presets.

The update itself needs megatron-core: on a GPU (marked gpu), and on the CPU through tests/lab/megatron_cpu.py
where megatron-core is installed (CI has none: those tests skip). The pieces below it run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from maspo_verl.lab.studies import megatron_update as mu

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")
needs_megatron = pytest.mark.skipif(not HAS_MEGATRON, reason="needs megatron-core")
HARNESS = Path(__file__).with_name("megatron_cpu.py")
BATCH = mu.GROUPS * mu.N


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return mu.write_model_dir(tmp_path_factory.mktemp("megatron") / "model")


@pytest.mark.parametrize("preset", mu.PRESETS)
def test_actor_config_is_the_presets(preset, model_dir):
    """The Megatron actor gets the preset's loss section as the FSDP trainer composes it, and two micro-batches."""
    from tests.helpers import preset_fields

    actor = mu.actor_config(preset, str(model_dir))
    _, fields = preset_fields(preset)
    assert actor.strategy == "megatron"
    assert {k: actor.policy_loss[k] for k in fields} == fields
    assert BATCH == 2 * actor.ppo_micro_batch_size_per_gpu
    assert actor.model_config.hf_config.architectures == ["Qwen2ForCausalLM"]


def test_batch_layout_is_what_ppo_loss_reads():
    """The batch made as verl's trainer makes it: verl's own ``no_padding_2_padding`` (what ``ppo_loss`` applies to
    the engine's per-token output) takes from a per-position tensor exactly the positions whose next token is a
    response token, in the order of ``responses``; the direct side (``reference_log_probs``) lays its rows out alike
    (``test_reference_log_probs_match_a_batched_forward``)."""
    from verl.workers.utils.padding import no_padding_2_padding

    batch = mu.make_batch()
    data = mu.update_batch(batch, torch.zeros(batch["responses"].shape), seed=0)
    ids = data["input_ids"]
    assert ids.is_nested and len(ids) == BATCH
    keep = batch["attention_mask"].bool()
    for row, mask, full in zip(ids.unbind(), keep, batch["input_ids"], strict=True):
        assert torch.equal(row, full[mask])
    # at position t the engine's log-prob is of token t + 1: the "next token" per position, as a nested tensor
    next_token = torch.nested.nested_tensor_from_jagged(
        torch.cat([torch.cat([row[1:], row.new_zeros(1)]) for row in ids.unbind()]), offsets=ids.offsets()
    )
    got = no_padding_2_padding(next_token, data)
    assert torch.equal(got, batch["responses"] * batch["response_mask"])
    assert torch.equal(data["loss_mask"], data["response_mask"])


def test_reference_log_probs_match_a_batched_forward():
    """The direct side's log-probs, one unpadded sample at a time, equal a plain batched forward of the left-padded
    batch (a transformers Qwen2, float64), response token by response token, and 0 after each response's end."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=264, max_position_embeddings=128, tie_word_embeddings=False, **mu.SHAPE)
    config._attn_implementation = "sdpa"  # eager attention gives NaN on a padded float64 batch (transformers 5)
    model = Qwen2ForCausalLM(config).double().eval()
    batch = mu.make_batch(seed=3)

    def bare(input_ids, position_ids, attention_mask):
        assert attention_mask is None  # causal attention over one unpadded sample
        return model(input_ids=input_ids, position_ids=position_ids).logits

    with torch.no_grad():
        got = mu.reference_log_probs(bare, batch)
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    n_prompt = batch["prompts"].shape[1]
    want = torch.log_softmax(logits[:, n_prompt - 1 : -1].float(), dim=-1)
    want = want.gather(-1, batch["responses"][..., None])[..., 0] * batch["response_mask"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _result(**changes) -> mu.Result:
    """A result that passes ``failures`` by a factor of 10 in every check; ``changes`` move it."""
    tol = mu.TOLERANCES["float32"]
    ref_loss = -0.01
    loss_tol = tol["loss"][0] + tol["loss"][1] * abs(ref_loss)
    ok = mu.Result(
        preset="maspo_fixed",
        loss_mode="maspo",
        dtype="float32",
        loss=ref_loss + loss_tol / 10,
        ref_loss=ref_loss,
        grad_norm=1.0,
        ref_grad_norm=1.0 + tol["grad_norm"] / 10,
        grad_err=tol["grad"] / 10,
        other_loss_gap=loss_tol * 10,
        other_grad_gap=tol["grad"] * 10,
        param_change=1e-3,
        step_s=0.1,
    )
    return replace(ok, **changes)


def test_failures_name_what_fails():
    ok = _result()
    assert mu.failures([ok]) == []
    assert mu.failures([replace(ok, other_loss_gap=float("nan"), other_grad_gap=float("nan"))]) == []  # one preset
    tol = mu.TOLERANCES["float32"]
    cases = {
        "engine loss": dict(loss=ok.ref_loss + 1e-3),
        "gradient error": dict(grad_err=tol["grad"] * 2),
        "grad norm": dict(grad_norm=1.1),
        "left the parameters": dict(param_change=0.0),
        "another preset's direct loss": dict(other_loss_gap=1e-9),
        "another preset's direct gradient": dict(other_grad_gap=tol["grad"] / 2),
    }
    for words, change in cases.items():
        (failure,) = mu.failures([replace(ok, **change)])
        assert failure.startswith("maspo_fixed (float32): ") and words in failure, failure
    assert len(mu.failures([replace(ok, loss=float("nan"), grad_err=float("nan"))])) == 2  # NaN never passes


def _harness(tmp_path, *args) -> tuple[subprocess.CompletedProcess, list[mu.Result]]:
    out = tmp_path / "results.json"
    run = subprocess.run(
        [sys.executable, str(HARNESS), "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parents[2],
    )
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    return run, [mu.Result(**row) for row in json.loads(out.read_text())]


@needs_megatron
def test_engine_update_on_cpu(tmp_path):
    """The whole update through verl's Megatron engine (gloo, megatron-core's CUDA assumptions mapped to the CPU):
    every preset x dtype equals its direct loss and gradient, and no other preset's."""
    run, results = _harness(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [(r.preset, r.dtype) for r in results] == [(p, d) for d in mu.DTYPES for p in mu.PRESETS]
    assert mu.failures(results) == []
    assert {r.loss_mode for r in results} == {"vanilla", "maspo"}


@needs_megatron
def test_engine_update_on_cpu_catches_a_wrong_loss(tmp_path):
    """verl's registry answering ``maspo`` with ``vanilla``: the maspo_fixed update fails its check, grpo's passes."""
    run, results = _harness(tmp_path, "--plant-wrong-loss", "--dtypes", "float32")
    assert run.returncode == 1
    failed = mu.failures(results)
    assert failed and all(line.startswith("maspo_fixed (float32)") for line in failed)
    assert any("engine loss" in line for line in failed) and any("gradient error" in line for line in failed)


@pytest.mark.gpu
@needs_megatron
def test_engine_update_on_gpu(tmp_path):
    """The update on a CUDA GPU (NCCL, megatron-core's CUDA kernels), in this process."""
    out = tmp_path / "results.json"
    assert mu.main(["--json", str(out)]) == 0
    results = [mu.Result(**row) for row in json.loads(out.read_text())]
    assert len(results) == len(mu.PRESETS) * len(mu.DTYPES) and mu.failures(results) == []
