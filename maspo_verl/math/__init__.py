"""The math recipe's Python side (recipes/math/ holds only thin shell launchers).

- ``maspo_verl.math.prepare``: ``python -m maspo_verl.math.prepare`` writes GSM8K, MATH, MATH-500,
  DAPO-Math-17k and AIME 2024/2025 in verl's parquet schema (from the hub or local files).
- ``maspo_verl.math.reward``: ``compute_score`` for ``reward.custom_reward_function``
  (``path=pkg://maspo_verl.math.reward``), built on math-verify (the ``math`` extra).

Nothing here is imported by ``import maspo_verl``; math-verify and datasets stay optional.
"""
