"""Estimator lab and benchmarks: ``python -m maspo_verl.lab <command>`` (``--help`` lists them).

- ``estimators``: exact bias/variance of every importance-ratio estimator by enumerating the whole
  sequence space of tiny autoregressive policies (:mod:`maspo_verl.lab.estimators`).
- ``race``: a CPU-sized GRPO race of verl's and our policy losses (:mod:`maspo_verl.lab.race`).
- ``regimes``: the race's engine grown into a grid: every loss preset as shipped x response length (up to 384
  tokens) x a real rollout mismatch (bf16, stale) x updates per batch, seeds as a batch dimension
  (:mod:`maspo_verl.lab.regimes`); the source of ``docs/choosing.md`` (:mod:`maspo_verl.choosing`).
- ``credit``: span credit (``maspo_span_grpo``) vs GRPO advantages on per-span-error tasks: gradient
  variance against the exact gradient, and the race (:mod:`maspo_verl.lab.credit`).
- ``bench``: time, peak memory and host syncs of each loss against verl's ``vanilla`` and ``gspo``
  (:mod:`maspo_verl.lab.bench`); with `--mode update`, the loss's share of an actor update.

(and ``steptime`` and ``learn``, which run verl's trainer in the local CPU mode). Each command writes
its tables and plots to ``outputs/lab/<command>/`` (``--out DIR`` elsewhere, ``--update-docs`` the
committed ``docs/results/<command>/``) with a ``COMMAND.txt`` recording the exact command line that
made them.
"""
