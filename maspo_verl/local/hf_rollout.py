"""An ``hf`` rollout backend for verl's agent-loop path (0.9.0, 0.9.1, development branch): server,
replica and adapter.

verl sends every rollout through the async agent loop to a rollout *server* (a Ray actor
with ``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput``); only
vllm/sglang/trtllm are registered. This backend is a plain ``transformers`` model on the host:

- ``HFServer``: Ray actor holding the model; samples token by token with a KV cache and returns
  the sampled ids and their log-probs (log-softmax of logits / temperature, as verl's
  ``logprobs_mode=processed_logprobs``), so ``bypass_mode`` gets engine log-probs. A test
  instrument can make them differ from the trainer's in a controlled way (bf16 model, Gaussian
  noise; ``maspo_verl.local.mismatch``, off by default).
- ``HFReplica``: the ``RolloutReplica`` that starts one server per replica (registered as
  ``hf`` in ``RolloutReplicaRegistry``).
- ``HFServerAdapter``: the ``BaseRollout`` living in the hybrid actor worker (registered as
  ``("hf", "async")``); verl's ``naive`` checkpoint engine calls its ``update_weights`` with the
  trainer's full tensors, which it pushes to the server.

Meant for tiny models and smoke tests: requests are served one at a time.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Any

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from maspo_verl.local.mismatch import LogProbMismatch
from maspo_verl.local.watchdog import HF_SERVER_PREFIX

logger = logging.getLogger("maspo_verl.local")

# a folder: the server saves each weight sync it receives there (``sync<k>_step<global_steps>.pt``)
WEIGHTS_DUMP_ENV = "MASPO_VERL_WEIGHTS_DUMP"


def server_name(replica_rank: int, suffix: str = "") -> str:
    return f"{HF_SERVER_PREFIX}{replica_rank}{suffix}"


def sample_tokens(
    model, prompt_ids: list[int], params: dict[str, Any], max_tokens: int, generator, eos_ids: torch.Tensor
) -> tuple[list[int], list[float]]:
    """One response of ``model`` after ``prompt_ids``, token by token with a KV cache, drawing from ``generator``:
    the sampled ids and their log-probs (log-softmax of logits / temperature); what the server returns for a
    request (``lab learn --engine lab`` samples with it too)."""
    temperature = float(params.get("temperature", 1.0) or 0.0)
    top_k = int(params.get("top_k", -1) or -1)
    top_p = float(params.get("top_p", 1.0) or 1.0)
    ignore_eos = bool(params.get("ignore_eos", False))
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    tokens: list[int] = []
    log_probs: list[float] = []
    past = None
    with torch.inference_mode():
        for _ in range(max_tokens):
            out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            if temperature > 0:
                logits = logits / temperature
            logp = torch.log_softmax(logits, dim=-1)
            if temperature <= 0:
                token = int(torch.argmax(logp))
            else:
                masked = logp.clone()
                if 0 < top_k < masked.numel():
                    kth = torch.topk(masked, top_k).values[-1]
                    masked[masked < kth] = -float("inf")
                if top_p < 1.0:
                    sorted_lp, order = torch.sort(masked, descending=True)
                    cum = torch.cumsum(sorted_lp.exp(), dim=-1)
                    drop = cum - sorted_lp.exp() > top_p
                    masked[order[drop]] = -float("inf")
                token = int(torch.multinomial(torch.softmax(masked, -1), 1, generator=generator))
            tokens.append(token)
            log_probs.append(float(logp[token]))
            if not ignore_eos and bool((eos_ids == token).any()):
                break
            input_ids = torch.tensor([[token]], dtype=torch.long)
    return tokens, log_probs


class HFServer:
    """Token-in/token-out generation with a ``transformers`` causal LM on the host."""

    def __init__(self, config, model_config, replica_rank: int = 0) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from verl.utils.config import omega_conf_to_dataclass

        config = omega_conf_to_dataclass(config)
        model_config = omega_conf_to_dataclass(model_config)
        torch.set_num_threads(max(1, int(os.environ.get("MASPO_VERL_HF_THREADS", "1"))))
        self.config = config
        self.replica_rank = replica_rank
        path = model_config.local_path
        trust = bool(getattr(model_config, "trust_remote_code", False))
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
        self.mismatch = LogProbMismatch.from_env()
        dtype = torch.bfloat16 if self.mismatch.logprob_dtype == "bf16" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(
            path, config=hf_config, torch_dtype=dtype, attn_implementation="sdpa", trust_remote_code=trust
        ).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
        eos = set()
        for source in (tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                eos.add(source)
            elif source:
                eos.update(int(x) for x in source)
        self.eos_ids = torch.tensor(sorted(eos), dtype=torch.long)
        seed = int(getattr(config, "seed", 0) or 0) + 1000 * replica_rank
        self.generator = torch.Generator().manual_seed(seed)
        # its own stream: the noise leaves the sampled tokens as they are without it
        self.noise_generator = torch.Generator().manual_seed(seed + 7919)
        if self.mismatch.active:
            logger.warning("maspo_verl local: test instrument on, rollout log-probs: %s", self.mismatch.describe())
        self.stale: collections.deque = collections.deque()  # syncs held back (stale_syncs)
        self.lock = asyncio.Lock()
        self.global_steps = None
        self.weight_version = 0

    # -- weights ---------------------------------------------------------------------------
    def load_weights(self, state: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        if self.mismatch.stale_syncs:  # apply the sync of k syncs ago (none yet: keep the initial weights)
            self.stale.append((state, global_steps))
            if len(self.stale) <= self.mismatch.stale_syncs:
                # verl's staleness tags need a step: the initial weights count as this sync's step
                self.global_steps = global_steps if self.global_steps is None else self.global_steps
                self.weight_version += 1
                return len(state)
            state, global_steps = self.stale.popleft()
        own = self.model.state_dict()
        unknown = [k for k in state if k not in own]
        if unknown:
            raise KeyError(f"HFServer.load_weights: unknown parameter names {unknown[:5]}")
        with torch.no_grad():
            for name, value in state.items():
                own[name].copy_(value.to(own[name].dtype))
        if "lm_head.weight" not in state and getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        self.global_steps = global_steps
        self.weight_version += 1
        dump = os.environ.get(WEIGHTS_DUMP_ENV)
        if dump and self.replica_rank == 0:  # debugging aid: every weight sync as the rollout received it
            os.makedirs(dump, exist_ok=True)
            torch.save(state, os.path.join(dump, f"sync{self.weight_version}_step{global_steps}.pt"))
        return len(state)

    # -- generation ------------------------------------------------------------------------
    def _sample(self, prompt_ids: list[int], params: dict[str, Any], max_tokens: int) -> tuple[list[int], list[float]]:
        tokens, log_probs = sample_tokens(self.model, prompt_ids, params, max_tokens, self.generator, self.eos_ids)
        if self.mismatch.noise_std > 0 and log_probs:
            noise = torch.randn(len(log_probs), generator=self.noise_generator, dtype=torch.float64)
            log_probs = (torch.tensor(log_probs, dtype=torch.float64) + self.mismatch.noise_std * noise).tolist()
        return tokens, log_probs

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data=None,
        video_data=None,
        audio_data=None,
        mm_processor_kwargs=None,
        priority: int = 0,
        **kwargs,
    ) -> TokenOutput:
        if image_data is not None or video_data is not None or audio_data is not None:
            raise NotImplementedError("the local hf rollout serves text-only models")
        params = dict(sampling_params)
        prompt_ids = [int(t) for t in prompt_ids]
        limit = self.config.prompt_length + self.config.response_length - len(prompt_ids)
        max_len = getattr(self.config, "max_model_len", None) or (
            self.config.prompt_length + self.config.response_length
        )
        room = int(max_len) - len(prompt_ids)
        max_tokens = params.pop("max_tokens", None) or params.pop("max_new_tokens", None)
        if max_tokens is None:
            max_tokens = min(self.config.response_length, limit)
        max_tokens = max(1, min(int(max_tokens), max(room, 1)))
        params.setdefault("ignore_eos", bool(getattr(self.config, "ignore_eos", False)))
        want_logprobs = bool(params.pop("logprobs", False))
        async with self.lock:
            tokens, log_probs = await asyncio.to_thread(self._sample, prompt_ids, params, max_tokens)
        finished = tokens and bool((self.eos_ids == tokens[-1]).any())
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs if want_logprobs else None,
            stop_reason="completed" if finished or len(tokens) >= max_tokens else None,
            extra_fields={"global_steps": self.global_steps},
        )

    # -- lifecycle (nothing to free on the host) -------------------------------------------
    async def wake_up(self):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def abort_all_requests(self, reject_request: bool = False):
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        return None

    async def wait_for_requests_to_drain(self):
        async with self.lock:
            return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None

    def ready(self) -> bool:
        return True


class HFReplica(RolloutReplica):
    """One ``HFServer`` per replica; the server address is its Ray actor name."""

    async def launch_servers(self):
        name = server_name(self.replica_rank, self.name_suffix)
        if self.is_reward_model:
            name += "_reward"
        elif self.is_teacher_model:
            name += "_teacher"
        server = (
            ray.remote(HFServer)
            .options(name=name, num_cpus=0, max_concurrency=self.max_concurrency, lifetime=None)
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        )
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"hf://{name}"


class HFServerAdapter(BaseRollout):
    """Lives in the hybrid actor worker; forwards the trainer's weights to this replica's server."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        self.sleep_level = 1
        world = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.replica_rank = rank // world
        self.is_leader = rank % world == 0
        self._server = None

    def _server_handle(self):
        if self._server is None:
            name = server_name(self.replica_rank)
            deadline = time.monotonic() + 120
            while True:
                try:
                    self._server = ray.get_actor(name)
                    break
                except ValueError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the local hf rollout takes full named tensors, not {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("the local hf rollout does not serve LoRA adapters (set model.lora.merge=true)")
        state = {}
        for name, tensor in weights:
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            if self.is_leader:
                state[name] = tensor.detach().to("cpu", copy=True)
        if self.is_leader:
            await self._server_handle().load_weights.remote(state, kwargs.get("global_steps"))

    def generate_sequences(self, prompts):
        raise NotImplementedError("the local hf rollout runs through the agent loop (async mode) only")
