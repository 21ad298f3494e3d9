"""The math recipe's local fixture files (no hub access), as ``prepare --local`` specs."""

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LOCAL_SPECS = [
    f"gsm8k:train={FIXTURES / 'gsm8k_train.jsonl'}",
    f"gsm8k:test={FIXTURES / 'gsm8k_test.jsonl'}",
    f"math={FIXTURES / 'math_train.jsonl'}",
    f"math500={FIXTURES / 'math500_test.jsonl'}",
    f"dapo17k={FIXTURES / 'dapo17k_train.jsonl'}",
    f"aime24={FIXTURES / 'aime24_test.json'}",
    f"aime25={FIXTURES / 'aime25_test.jsonl'}",
]
