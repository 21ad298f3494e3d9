"""Part 5's cost probe (PREREGISTRATION.md, part 5): one short trainer run of the registered command (python -m
maspo_verl.main local=cpu model=smollm2 ..., verl's vLLM rollout and the actor in fp32 by maspo.local_dtype=auto on
this CPU, bypass mode, natural lengths) through the lab's runner (``lab.engine.runs.run_local``: the CPU-s of every
process of the run), with verl's greedy validation on the 128 validation problems at the last step; prints per-step
timings, the diagnostics and the cost. Run from the repository root:
``python docs/results/granularity/real/prep/cost.py --steps 2 --mini-batches 4 --epochs 2 --lr 1e-5 --loss grpo``."""

import argparse
import json
import time
from pathlib import Path

from maspo_verl.lab.engine.runs import run_local

KEYS = (
    "timing_s/step",
    "timing_s/gen",
    "timing_s/update_actor",
    "timing_s/update_weights",
    "timing_s/reward",
    "timing_s/testing",
    "response_length/mean",
    "response_length/max",
    "response_length/clip_ratio",
    "critic/score/mean",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/ratio/vif15",
    "actor/engine_mismatch/rms",
    "val-core/maspo_arith_worked/acc/mean@1",
    "perf/cpu_memory_used_gb",
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="problems a step")
    p.add_argument("--n", type=int, default=4, help="answers a problem")
    p.add_argument("--mini-batches", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", default="1e-5")
    p.add_argument("--loss", default="grpo", help="loss=<preset>; maspo_fixed takes --window")
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--task", default="3/20", help="STEPS/MAX_OPERAND of the worked task")
    p.add_argument("--response", type=int, default=256, help="data.max_response_length")
    p.add_argument("--seed", type=int, default=950)
    p.add_argument("--no-val", action="store_true", help="no validation at the last step")
    p.add_argument("--run-dir", default=None)
    args = p.parse_args()
    steps, top = (int(x) for x in args.task.split("/"))
    mini = args.batch // args.mini_batches
    ov = [
        "model=smollm2",
        f"loss={args.loss}",
        *([f"actor_rollout_ref.actor.policy_loss.segment_window={args.window}"] if args.loss == "maspo_fixed" else []),
        "actor_rollout_ref.rollout.name=vllm",
        "algorithm.rollout_correction.bypass_mode=true",
        "maspo.arith.form=worked",
        f"maspo.arith.steps={steps}",
        f"maspo.arith.max_operand={top}",
        f"data.max_response_length={args.response}",
        "data.max_prompt_length=320",
        f"data.train_batch_size={args.batch}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_epochs={args.epochs}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mini * args.n}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.batch * args.n}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.batch * args.n}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.total_epochs={args.steps}",
        f"trainer.test_freq={-1 if args.no_val else args.steps}",
        f"data.seed={args.seed}",
        f"maspo.local_seed={args.seed}",
        f"actor_rollout_ref.rollout.seed={args.seed}",
        "trainer.experiment_name=part5_cost",
    ]
    run_dir = Path(args.run_dir or f"/tmp/part5_cost_{int(time.time())}").resolve()
    ov.append(f"trainer.rollout_data_dir={run_dir}/rollouts")  # the step's prompts and answers (pairing check)
    t0 = time.time()
    r = run_local(ov, run_dir, timeout_s=580)
    print("COMMAND", " ".join(ov))
    print(
        "RESULT",
        json.dumps(
            {
                **vars(args),
                "rc": r.returncode,
                "wall_s": round(r.wall_s, 1),
                "cpu_s": round(r.cpu_s, 1),
                "milestones": {k: round(v, 1) for k, v in r.milestones.items()},
                "since": round(time.time() - t0, 1),
            }
        ),
    )
    for s, m in sorted(r.steps.items()):
        print("STEP", s, json.dumps({k: round(m[k], 6) for k in KEYS if k in m}))
    if r.returncode:
        print(r.tail(60))
    print("RUN_DIR", run_dir)


if __name__ == "__main__":
    main()
