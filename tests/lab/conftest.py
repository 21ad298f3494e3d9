def pytest_configure(config):
    config.addinivalue_line("markers", "slow: lab checks that take more than a few seconds")


def tiny_llama(eos: int = 2, pad: int = 0):
    """A tiny random Llama (vocabulary 40, SiLU-gated MLP, tied embeddings) for the SmolLM2 studies' pieces."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def plain_log_probs(model, ids, attn, resp, masked=()):
    """log pi(resp | prompt) [N, T] by one plain forward (``masked`` ids never sampled)."""
    import math

    import torch

    seq = torch.cat([ids, resp], 1)
    mask = torch.cat([attn, torch.ones_like(resp)], 1)
    logits = model(input_ids=seq, attention_mask=mask).logits[:, ids.shape[1] - 1 : -1].float()
    logits[..., list(masked)] = -math.inf
    return torch.log_softmax(logits, -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)


def fake_learn_runs(monkeypatch, tmp_path, trainer):
    """``lab learn`` with ``trainer`` in place of the local trainer run (``learn.run_local``), its logs folder in
    ``tmp_path`` (not left in /tmp) and no per-seed plots (not what the piece engines' tests test)."""
    import tempfile

    from maspo_verl.lab.studies import learn

    (tmp_path / "tmp").mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(learn, "run_local", trainer)
    monkeypatch.setattr(learn, "plot_steps", lambda *a: None)
    monkeypatch.setattr(learn, "plot_sigma", lambda *a: False)
    return trainer
