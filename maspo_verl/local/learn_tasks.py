"""Toy tasks for ``python -m maspo_verl.lab learn``: verl datasets, their reward and per-token scores.

Both tasks use the local mode's embedded byte-level model (ids 0..255 are bytes, which the local
``tokenval`` rule treats as 4-digit FSQ codes) and fixed-length responses (``RESPONSE_TOKENS`` by
default, ``length`` in ``write_dataset``; EOS ignored). Word k of a 4-word vocabulary is the id block
``[64 k, 64 k + 64)``. Each run has one sentence (drawn from the seed), which every prompt asks for
("Say: ka mi ..."): a tiny random model can learn to say it within a few dozen steps, while reading
the prompt would take far longer. The response is decoded into words:

- ``text``: every response token is one word (neighbouring tokens independent); the sentence has
  ``length`` words;
- ``speech``: a maximal run of tokens in the same block is one word (a word is "held" over several
  frames, so neighbouring tokens are tied, as codec frames are); the sentence has ``SPEECH_WORDS``
  words, no word twice in a row, so a word lasts ``length / SPEECH_WORDS`` frames (3 at the default
  length; longer responses are a higher frame rate, as a codec's, for the same content).

``speechwarm`` is ``speech`` (its decoding, reward and sentences) on a policy that has learned speech: the
embedded model warm-started on the task's unit sequences (``maspo_verl.local.speechwarm``, one per seed and
length, built into the local cache on first use), so its responses already hold about ``SPEECH_WORDS``
words and the reward starts above 0.2 with a spread within each group; the run's sentence is left to RL.

A third family, ``turns<N>`` (``turns2``, ``turns8``, ``turns24``, ...), is the local mode's multi-turn toy
environment (``task=turns``, maspo_verl/local/turns.py): N assistant turns of ``length`` tokens with
masked environment observations between them, the reward the mean of the turns' scores. Its data,
agent loop and reward come with that task inside the trainer run (``write_dataset`` only returns the
overrides that select it), so the environment's code has one place.

``smollm2`` is the local mode's pretrained model (``model=smollm2``: SmolLM2-135M-Instruct on the arithmetic
problems of ``maspo_verl.pretrained.arith``, generated from ``maspo.local_seed``, graded by math-verify): its data,
model and reward come with that model config inside the trainer run, as ``turns<N>``'s do; its answers end at EOS.

Special tokens (ids >= 256) decode to nothing. The reward is sequence level:
``1 - edit_distance(hyp, ref) / max(|hyp|, |ref|)`` (a WER normalised by the longer word sequence, so
it stays in [0, 1] and ranks a group of responses from the start). The word spans are known, so the
reward manager also returns per-token scores (``maspo_verl.speech.spans``: each substituted or
inserted word's tokens, each deleted word's neighbours, penalised; centred; plus the score on the
last token), which ``credit=span`` turns into per-token advantages inside verl.
"""

from __future__ import annotations

import random
from pathlib import Path

# the local mode's pretrained model and its task (hydra_configs/model/smollm2.yaml)
from maspo_verl.pretrained.smollm2 import NAME as PRETRAINED

WORDS = ("ka", "lo", "mi", "nu")
BLOCK = 64  # ids per word
NUM_CODES = 256
RESPONSE_TOKENS = 12
SPEECH_WORDS = 4  # words of the speech-like sentence, at any length: longer responses hold each word longer
FRAMES_PER_WORD = RESPONSE_TOKENS // SPEECH_WORDS  # at the default length
WARM = "speechwarm"  # the speech task on the warm-started model (maspo_verl.local.speechwarm)
TASKS = ("text", "speech", WARM)
DATA_SOURCE = "maspo_learn_{task}"
TURNS = "turns"  # turns<N>: the local mode's multi-turn task with N turns


def turns_of(task: str) -> int | None:
    """N of a multi-turn task ``turns<N>`` (N >= 1), else None."""
    rest = task.removeprefix(TURNS)
    return int(rest) if rest != task and rest.isdigit() and int(rest) >= 1 else None


def known(task: str) -> bool:
    return task in TASKS or task == PRETRAINED or turns_of(task) is not None


def decode(task: str, ids: list[int]) -> list[tuple[str, int, int]]:
    """(word, first token, one past the last token) of each decoded word."""
    if task not in TASKS:
        raise ValueError(f"task={task!r}: allowed {TASKS}")
    words: list[tuple[str, int, int]] = []
    for t, token in enumerate(ids):
        if not 0 <= token < NUM_CODES:
            continue
        word = WORDS[token // BLOCK]
        if task != "text" and words and words[-1][0] == word and words[-1][2] == t:
            words[-1] = (word, words[-1][1], t + 1)
        else:
            words.append((word, t, t + 1))
    return words


def word_ids(words: list[tuple[str, int, int]], n: int) -> list[int]:
    """Per token, the index of the decoded word it belongs to (-1 outside words): the words' spans
    stand in for an ASR's word times in ``segment_rule=words``."""
    from maspo_verl.batch import NO_WORD

    ids = [NO_WORD] * n
    for k, (_, start, end) in enumerate(words):
        ids[start:end] = [k] * (end - start)
    return ids


def edit_distance(a: list[str], b: list[str]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def score(task: str, ids: list[int], reference: str) -> tuple[float, list[tuple[str, int, int]]]:
    words = decode(task, ids)
    hyp, ref = [w for w, _, _ in words], reference.split()
    return 1.0 - edit_distance(hyp, ref) / max(len(hyp), len(ref), 1), words


def token_scores_of(task: str, ids: list[int], reference: str) -> tuple[float, list[float]]:
    """The sequence score and the per-token scores (summing to it) over the response's tokens."""
    from maspo_verl.speech.asr import TimedWord
    from maspo_verl.speech.spans import error_spans, token_penalties, token_scores

    value, words = score(task, ids, reference)
    timed = [TimedWord(w, float(a), float(b)) for w, a, b in words]
    spans = error_spans(reference, timed, len(ids), rate=1.0)
    return value, token_scores(value, token_penalties(spans, len(ids)))


def sentence(task: str, rng: random.Random, length: int = RESPONSE_TOKENS) -> str:
    """The run's sentence for responses of ``length`` tokens."""
    if task == "text":
        return " ".join(rng.choice(WORDS) for _ in range(length))
    words = [rng.choice(WORDS)]
    while len(words) < SPEECH_WORDS:
        words.append(rng.choice([w for w in WORDS if w != words[-1]]))
    return " ".join(words)


def rows(task: str, n: int, target: str, split: str) -> list[dict]:
    return [
        {
            "data_source": DATA_SOURCE.format(task=task),
            "prompt": [{"role": "user", "content": f"Say: {target}"}],
            "ability": task,
            "reward_model": {"style": "rule", "ground_truth": target},
            "extra_info": {"split": split, "index": i, "task": task},
        }
        for i in range(n)
    ]


def write_dataset(
    folder: str | Path,
    task: str,
    seed: int = 0,
    n_train: int = 256,
    n_val: int = 16,
    length: int = RESPONSE_TOKENS,
) -> dict:
    """The task's train and val parquet in ``folder`` (paths and the run's sentence); for ``turns<N>``
    nothing is written: the overrides that select the local mode's task, with ``length`` tokens a turn (the
    warm-started model of ``speechwarm``: ``maspo_verl.local.speechwarm.ensure_model``); for ``smollm2`` the
    overrides that select the model config, answers of at most ``length`` tokens, verl's vLLM rollout, and
    ``pretrained`` (natural lengths: EOS ends an answer; verl's greedy validation at the last step)."""
    if task == PRETRAINED:
        # verl's vLLM rollout, the local mode's engine (the lab runner pins the transformers one for the toy tasks)
        overrides = [f"model={task}", f"data.max_response_length={length}", "actor_rollout_ref.rollout.name=vllm"]
        return {"overrides": overrides, "pretrained": True}
    n_turns = turns_of(task)
    if n_turns is not None:
        return {"overrides": [f"task={TURNS}", f"maspo.turns={n_turns}", f"maspo.turn_tokens={length}"]}
    import pandas as pd

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = sentence(task, random.Random(f"{task}-{seed}"), length)
    paths = {"sentence": target}
    for split, n in (("train", n_train), ("val", n_val)):
        paths[split] = str(folder / f"{task}_{split}.parquet")
        pd.DataFrame(rows(task, n, target, split)).to_parquet(paths[split], index=False)
    return paths


try:  # the reward manager runs in verl's reward workers; the rest of this module needs no verl
    from maspo_verl.plugin.rewards import RewardManager
except ImportError:  # pragma: no cover
    RewardManager = object


def reward_manager_overrides(manager: type) -> list[str]:
    """The trainer's overrides that load ``manager`` (a reward manager class) from its module's file."""
    import sys

    return [
        "reward.reward_manager.source=importlib",
        f"reward.reward_manager.name={manager.__name__}",
        f"reward.reward_manager.module.path={sys.modules[manager.__module__].__file__}",
    ]


class LearnRewardManager(RewardManager):
    """verl reward manager of the learn tasks: the score, and per-token scores for span credit."""

    async def run_single(self, data) -> dict:
        from maspo_verl.batch import TOKEN_SCORES_KEY, WORD_IDS_KEY

        item, ids = self.response(data)
        reference = str(item.non_tensor_batch["reward_model"]["ground_truth"])
        task = str(item.non_tensor_batch["data_source"]).removeprefix("maspo_learn_")
        value, per_token = token_scores_of(task, ids, reference)
        words = decode(task, ids)
        info = {"score": value, "words": float(len(words)), TOKEN_SCORES_KEY: per_token}
        info[WORD_IDS_KEY] = word_ids(words, len(ids))
        return {"reward_score": value, "reward_extra_info": info}
