"""One actor update of verl's Megatron engine with a loss preset of ours, checked against the loss called directly.

``python -m maspo_verl.lab.studies.megatron_update [--presets grpo maspo_fixed] [--dtypes float32 bfloat16]`` on a CUDA
machine with megatron-core (TransformerEngine and apex not needed); it prints a table and exits 1 if a check fails.

What runs is verl's own Megatron actor path, world size 1: ``TrainingWorker.train_mini_batch`` (unbound, on a
worker holding only what it reads; Ray is not involved) -> ``MegatronEngineWithLMHead.train_batch`` ->
megatron-core's ``forward_backward`` schedule -> verl's ``forward_step`` and ``gptmodel_forward_model_engine``
(bshd) -> ``verl.workers.utils.losses.ppo_loss`` (through our plugin's hooks) -> the loss ``policy_loss.loss_mode``
names in verl's registry -> megatron's DDP grad buffers and optimizer (torch's Adam where apex and TE are absent).
The actor config is our ``maspo_megatron_trainer`` composed with ``loss=<preset>``; the batch is made as verl's
trainer makes it (``left_right_2_no_padding``), two micro-batches, one optimizer step.

Not verl's: the model. verl builds it through a bridge (mbridge or Megatron-Bridge) or its ``DenseModel``
initializer, all with TransformerEngine's layer spec (``use_transformer_engine=True``). ``local_spec_engine_cls``
overrides two methods of verl's engine to build the same megatron-core ``GPTModel`` (verl's HF->mcore config
converter, verl's initializer and ``get_model``) from a tiny random Qwen2 config with megatron-core's local layer
spec, and converts the attention mask verl's bshd forward hands the model (``local_attention_mask``).

The independent check: the same batch through the unwrapped ``GPTModel`` one sample at a time (no padding, no verl
forward code), ``log_softmax`` in float32, and the preset's loss function called directly on the whole batch. Its
loss and its gradient (every parameter) must equal the engine's (``TOLERANCES``), and the engine's must differ from
the other presets' direct losses and gradients by more than that: a run with the wrong ``loss_mode`` would fail.
float32 is the precise check (verl's config accepts only bfloat16 and float16: the float32 engine sets its dtype
itself); bfloat16 is verl's default, checked to bfloat16 precision.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PRESETS = ("grpo", "maspo_fixed")
DTYPES = {"float32": torch.float32, "bfloat16": None}  # None: the config's (verl's default, bfloat16)
# GROUPS prompts x N responses; prompts of 6..12 tokens, responses of 20..48 (maspo_fixed's windows of 15: 2-4
# segments); micro-batches of MICRO samples (two), one mini-batch (one optimizer step)
GROUPS, N, MICRO = 2, 4, 4
PROMPT, RESPONSE = (6, 12), (20, 48)
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LR = 1e-4
# (loss: atol, rtol; gradient: max error over all entries / max |entry|; grad norm: relative). Seen on CPU: float32
# 5e-9 / 3e-7 / 5e-6, bfloat16 8e-9 / 5e-3 / 6e-5. What differs between the two sides is the kernels' shapes (the
# engine pads a micro-batch, the direct side runs one unpadded sample) and so their rounding: reduction order in
# float32, bfloat16 activations in bfloat16. The loss barely sees it: at the first step the old log-probs are the
# model's own plus fixed noise, so the ratios are that noise whatever the precision.
TOLERANCES = {
    "float32": dict(loss=(1e-6, 1e-4), grad=1e-3, grad_norm=1e-4),
    "bfloat16": dict(loss=(1e-5, 1e-2), grad=3e-2, grad_norm=1e-2),
}


@dataclass
class Result:
    preset: str
    loss_mode: str
    dtype: str
    loss: float  # the engine's (sum over micro-batches, as verl's TrainingWorker reports it)
    ref_loss: float  # the preset's loss called directly
    grad_norm: float  # megatron's optimizer's, before clipping
    ref_grad_norm: float
    grad_err: float  # max |engine - direct| over every gradient entry, / max |direct|
    other_loss_gap: float  # min over the other presets of |engine loss - their direct loss|
    other_grad_gap: float  # min over the other presets of max |engine grad - their direct grad| / max |direct|
    param_change: float  # norm of the optimizer step
    step_s: float

    @property
    def loss_err(self) -> float:
        return abs(self.loss - self.ref_loss)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: str) -> bool:
    """World size 1: NCCL on a GPU, gloo on CPU; False where a process group exists already."""
    if torch.distributed.is_initialized():
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if device == "cuda":
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    return True


def write_model_dir(path: Path) -> Path:
    """A tiny Qwen2 config (no weights: megatron initialises them) and the local mode's byte-level tokenizer."""
    from transformers import Qwen2Config

    from maspo_verl.local.assets import MODEL_VOCAB, NUM_BYTES, SPECIAL_TOKENS, write_tokenizer

    write_tokenizer(path)
    Qwen2Config(
        vocab_size=MODEL_VOCAB,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        max_position_embeddings=256,
        eos_token_id=NUM_BYTES + SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=NUM_BYTES + SPECIAL_TOKENS.index("<|endoftext|>"),
        architectures=["Qwen2ForCausalLM"],
        **SHAPE,
    ).save_pretrained(path)
    return path


def actor_config(preset: str, model_path: str):
    """The actor section of our Megatron trainer config with ``loss=<preset>``, as verl's engine worker turns it
    into the actor's config (with its model config)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig

    from maspo_verl.reference import compose_config

    overrides = [
        f"loss={preset}",
        f"actor_rollout_ref.model.path={model_path}",
        # no bridge (the model is built by megatron-core): checkpoints in its own dist_checkpointing format
        "actor_rollout_ref.actor.megatron.use_dist_checkpointing=True",
        f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.optim.total_training_steps=1",  # the trainer sets it from the data
        "actor_rollout_ref.actor.use_dynamic_bsz=False",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={GROUPS}",
        f"actor_rollout_ref.rollout.n={N}",
    ]
    cfg = compose_config(*overrides, config_name="maspo_megatron_trainer")
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor.model_config = HFModelConfig(path=model_path, use_remove_padding=False)
    return actor


def local_attention_mask(module, args, kwargs):
    """verl's bshd forward hands the model a [batch, seq] mask of valid tokens, the form TransformerEngine's
    attention takes; megatron-core's local attention takes [batch, 1, sq, sk], True where masked (causal and
    padding), the form verl builds for NPUs: convert with verl's own builder."""
    from verl.models.mcore.util import _build_npu_attn_mask

    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        kwargs["attention_mask"] = _build_npu_attn_mask(mask.bool())
    return args, kwargs


def local_spec_engine_cls(param_dtype: torch.dtype | None = None):
    """verl's Megatron LM engine, building its model with megatron-core's local layer spec (see the module doc).

    ``param_dtype``: None keeps the config's (``megatron.dtype``: verl accepts bfloat16 and float16 only);
    torch.float32 trains in float32 (megatron's FP32 optimizer), for a check to float32 precision."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnBackend
    from verl.models.mcore.model_initializer import DenseModel
    from verl.models.mcore.registry import hf_to_mcore_config
    from verl.utils.device import get_device_name
    from verl.utils.megatron_utils import get_model
    from verl.utils.torch_dtypes import PrecisionType
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    class LocalSpecModel(DenseModel):
        def get_transformer_layer_spec(self, vp_stage=None):
            return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=False)

        def initialize(self, **kwargs):
            model = super().initialize(**kwargs)
            model.register_forward_pre_hook(local_attention_mask, with_kwargs=True)
            return model

    class LocalSpecEngine(MegatronEngineWithLMHead):
        def _build_tf_config(self):
            self.is_value_model = False
            self.share_embeddings_and_output_weights = self.model_config.share_embeddings_and_output_weights
            self.param_dtype = param_dtype or PrecisionType.to_dtype(self.engine_config.dtype)
            self.dtype = self.param_dtype
            overrides = {
                **self.engine_config.override_transformer_config,
                # fusions that need apex or TransformerEngine
                "apply_rope_fusion": False,
                "bias_activation_fusion": False,
                "masked_softmax_fusion": False,
                "gradient_accumulation_fusion": False,
                "persist_layer_norm": False,
                "bias_dropout_fusion": False,
                "attention_backend": AttnBackend.local,
                "use_cpu_initialization": get_device_name() == "cpu",
            }
            self.tf_config = hf_to_mcore_config(self.model_config.hf_config, self.dtype, **overrides)
            self.bridge = self.provider = self.peft_cls = None
            self.vanilla_bridge = False

        def _build_megatron_module(self):
            tf_config, hf_config = self.tf_config, self.model_config.hf_config
            share = self.share_embeddings_and_output_weights

            def provider(pre_process, post_process, vp_stage=None):
                model = LocalSpecModel(tf_config, hf_config).initialize(
                    pre_process=pre_process, post_process=post_process, share_embeddings_and_output_weights=share
                )
                return model.to(get_device_name())

            return get_model(
                provider,
                wrap_with_ddp=True,
                use_distributed_optimizer=self.engine_config.use_distributed_optimizer,
                override_ddp_config=self._resolve_override_ddp_config(),
            )

    return LocalSpecEngine


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """A rollout batch as verl's trainer hands it to the actor: left-padded prompts, right-padded responses,
    advantages constant per response (GRPO-like, random), old log-probs filled in later."""
    from maspo_verl.local.assets import NUM_BYTES

    g = torch.Generator().manual_seed(seed)
    B = GROUPS * N
    P, R = PROMPT[1], RESPONSE[1]
    p_len = torch.randint(PROMPT[0], PROMPT[1] + 1, (GROUPS,), generator=g).repeat_interleave(N)
    r_len = torch.randint(RESPONSE[0], RESPONSE[1] + 1, (B,), generator=g)
    ids = torch.randint(0, NUM_BYTES, (B, P + R), generator=g)
    prompt_mask = torch.arange(P)[None, :] >= (P - p_len)[:, None]
    response_mask = torch.arange(R)[None, :] < r_len[:, None]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    ids = ids * attention_mask
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    score = torch.randn(B, generator=g)
    grouped = score.view(GROUPS, N)
    adv = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).view(B)
    return {
        "input_ids": ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "prompts": ids[:, :P],
        "responses": ids[:, P:],
        "response_mask": response_mask.long(),
        "advantages": adv[:, None] * response_mask,
        "prompt_len": p_len,
    }


def reference_log_probs(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, R] float32 log-probs of the response tokens (0 after a response's end): ``model`` (a bare GPTModel, or
    anything called alike) on one unpadded sample at a time, causal attention, positions from 0."""
    n_prompt = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    width = batch["responses"].shape[1]
    rows = []
    masks = batch["attention_mask"].bool(), batch["input_ids"], batch["response_mask"]
    for keep, ids, response in zip(*masks, strict=True):
        seq = ids[keep][None]
        positions = torch.arange(seq.shape[1], device=seq.device)[None]
        logits = model(input_ids=seq, position_ids=positions, attention_mask=None)
        lp = torch.log_softmax(logits.float()[0, :-1], dim=-1).gather(-1, seq[0, 1:, None])[:, 0]
        start = int(keep[:n_prompt].sum()) - 1  # the logits of the last prompt token give the first response token
        n = int(response.sum())
        rows.append(torch.nn.functional.pad(lp[start : start + n], (0, width - n)))
    return torch.stack(rows)


def direct_loss_fn(loss_mode: str):
    """The preset's loss as a function, not through verl's registry: ours from ``maspo_verl.core.losses``,
    verl's own as verl ships it (without the plugin's metrics wrapper)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from maspo_verl.core.losses import verl_loss_fn
    from maspo_verl.core.token_sets import TOKEN_SETS

    if loss_mode in TOKEN_SETS:
        return verl_loss_fn(loss_mode)
    fn = get_policy_loss_fn(loss_mode)
    return getattr(fn, "__maspo_original__", fn)


def direct_loss(actor, log_prob, old_log_prob, batch) -> torch.Tensor:
    """The whole batch at once, normalised over it as verl normalises each micro-batch's share."""
    mask = batch["response_mask"].bool()
    actor.global_batch_info.update(
        dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0], loss_scale_factor=None
    )
    fn = direct_loss_fn(actor.policy_loss.loss_mode)
    loss, _ = fn(old_log_prob, log_prob, batch["advantages"], mask, actor.loss_agg_mode, actor)
    return loss


def worker_for(engine, actor, model_config):
    """verl's ``TrainingWorker`` without Ray: the attributes its ``train_mini_batch`` and ``train_batch`` read."""
    from functools import partial

    from verl.utils.device import get_device_name
    from verl.utils.profiler import DistProfiler
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    worker = TrainingWorker.__new__(TrainingWorker)
    worker.engine, worker.engine_config, worker.model_config = engine, engine.engine_config, model_config
    worker.device_name = get_device_name()
    worker.flops_counter = None
    worker.profiler = DistProfiler(rank=0, config=None, tool_config=None)
    worker.loss_fn = partial(ppo_loss, config=actor)
    return worker


def build_engine(actor, model_config, dtype: torch.dtype | None):
    engine_config = actor.engine
    # what verl's engine worker copies from the actor config
    engine_config.use_dynamic_bsz = actor.use_dynamic_bsz
    engine_config.micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    engine_config.max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    engine_config.use_remove_padding = False  # bshd: megatron-core's local attention takes no packed sequences
    engine = local_spec_engine_cls(dtype)(model_config, engine_config, actor.optim, actor.checkpoint)
    engine.initialize()
    return engine


def update_batch(batch: dict, old_log_prob: torch.Tensor, seed: int):
    """The actor's input, as verl's trainer makes it (``RayPPOTrainer._update_actor``): no-padding TensorDict."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    B = len(old_log_prob)
    data = TensorDict(
        {**batch, "old_log_probs": old_log_prob, "temperature": torch.ones(B, device=old_log_prob.device)},
        batch_size=B,
    ).cpu()
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(
        data,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=B,
        mini_batch_size=B,
        epochs=1,
        seed=seed,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    return data


def _grads(model) -> torch.Tensor:
    return torch.cat([p.main_grad.detach().flatten() for p in model.parameters()]).clone()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def run_preset(preset: str, presets, model_dir: Path, batch: dict, dtype: torch.dtype | None, seed: int = 0) -> Result:
    """One actor update with ``preset``; the direct losses of every preset in ``presets`` on the same weights."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.megatron_utils import unwrap_model

    actors = {p: actor_config(p, str(model_dir)) for p in presets}
    actor = actors[preset]
    engine = build_engine(actor, actor.model_config, dtype)
    model = unwrap_model(engine.module[0])
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}

    # old log-probs: the model's own, shifted per token (a stale policy: ratios off 1, some of them clipped)
    with torch.no_grad():
        current = reference_log_probs(model, batch)
    noise = 0.3 * torch.randn(current.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    old = (current + noise) * batch["response_mask"]

    # direct: loss and gradient of every parameter through the same module (megatron's DDP hooks fill main_grad)
    direct = {}
    for name, a in actors.items():
        engine.optimizer_zero_grad()
        loss = direct_loss(a, reference_log_probs(model, batch), old, batch)
        loss.backward()
        direct[name] = float(loss), _grads(model)
    engine.optimizer_zero_grad()

    # the engine's gradient, read as its optimizer step begins
    seen = []
    step = engine.optimizer_step

    def optimizer_step():
        seen.append(_grads(model))
        return step()

    engine.optimizer_step = optimizer_step
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    worker = worker_for(engine, actor, actor.model_config)
    data = update_batch(batch, old, seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    metrics = tu.get(worker.train_mini_batch(data), "metrics")
    sync()
    step_s = time.perf_counter() - t0
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    (got,) = seen  # one mini-batch: one optimizer step
    (loss,) = metrics["loss"]
    (grad_norm,) = metrics["grad_norm"]
    ref_loss, ref_grad = direct[preset]
    others = [v for k, v in direct.items() if k != preset]
    return Result(
        preset=preset,
        loss_mode=actor.policy_loss.loss_mode,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        loss=float(loss),
        ref_loss=ref_loss,
        grad_norm=float(grad_norm),
        ref_grad_norm=float(ref_grad.norm()),
        grad_err=_rel(got, ref_grad),
        other_loss_gap=min((abs(float(loss) - v[0]) for v in others), default=float("nan")),
        other_grad_gap=min((_rel(got, v[1]) for v in others), default=float("nan")),
        param_change=float((after - before).norm()),
        step_s=step_s,
    )


def table(results: list[Result]) -> str:
    lines = [
        "| preset | loss_mode | dtype | engine loss | direct loss | abs err | gap to other presets | "
        "grad norm (engine / direct) | grad err | gap to others' grad | param change | step s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.preset} | {r.loss_mode} | {r.dtype} | {r.loss:.8f} | {r.ref_loss:.8f} | {r.loss_err:.1e} | "
            f"{r.other_loss_gap:.1e} | {r.grad_norm:.6f} / {r.ref_grad_norm:.6f} | {r.grad_err:.1e} | "
            f"{r.other_grad_gap:.1e} | {r.param_change:.2e} | {r.step_s:.3f} |"
        )
    return "\n".join(lines)


def run(presets=PRESETS, dtypes=tuple(DTYPES), seed: int = 0) -> list[Result]:
    """Every preset x dtype: a fresh engine each (megatron's model-parallel state is set up once per process)."""
    results = []
    with tempfile.TemporaryDirectory(prefix="maspo_megatron_") as tmp:
        model_dir = write_model_dir(Path(tmp) / "model")
        batch = make_batch(seed)
        for dtype in dtypes:
            for preset in presets:
                results.append(run_preset(preset, presets, model_dir, batch, DTYPES[dtype], seed))
    return results


def failures(results: list[Result]) -> list[str]:
    """What each result fails of ``TOLERANCES``; with more than one preset, each engine loss and gradient must also
    be further from every other preset's direct one than the tolerance (else the check could not tell them apart)."""
    out = []
    for r in results:
        tol = TOLERANCES[r.dtype]
        atol, rtol = tol["loss"]
        loss_tol = atol + rtol * abs(r.ref_loss)
        name = f"{r.preset} ({r.dtype})"
        if not r.loss_err <= loss_tol:
            out.append(f"{name}: engine loss {r.loss:.8g} != direct {r.ref_loss:.8g} (tolerance {loss_tol:.1e})")
        if not r.grad_err <= tol["grad"]:
            out.append(f"{name}: gradient error {r.grad_err:.1e} > {tol['grad']:.0e}")
        if not abs(r.grad_norm - r.ref_grad_norm) <= tol["grad_norm"] * r.ref_grad_norm:
            out.append(f"{name}: grad norm {r.grad_norm:.6g} != direct {r.ref_grad_norm:.6g}")
        if not r.param_change > 0:
            out.append(f"{name}: the optimizer step left the parameters as they were")
        if not (r.other_loss_gap > loss_tol or r.other_loss_gap != r.other_loss_gap):  # nan: one preset only
            out.append(f"{name}: another preset's direct loss is within tolerance ({r.other_loss_gap:.1e})")
        if not (r.other_grad_gap > tol["grad"] or r.other_grad_gap != r.other_grad_gap):
            out.append(f"{name}: another preset's direct gradient is within tolerance ({r.other_grad_gap:.1e})")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    from verl.utils.device import get_device_name

    import maspo_verl.plugin  # noqa: F401  (what `import verl` does through the entry point)

    t0 = time.perf_counter()
    owned = init_distributed(get_device_name())
    try:
        results = run(args.presets, args.dtypes)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if owned:
            torch.distributed.destroy_process_group()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    failed = failures(results)
    for line in failed:
        print(f"FAIL {line}", file=sys.stderr)
    print(f"{'FAILED' if failed else 'passed'}: {len(results)} updates in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
