"""Test-only verl reward manager for ``segment_rule=words``: word ids that depend on the response tokens,
and, as the score, the number of segments the words rule must find in the response (so verl's logged
``critic/score/mean`` is the expected ``actor/ratio/segments_per_seq``).

A token whose id is a multiple of 3 starts a new word; a token whose id is a multiple of 5 is a gap.
The first response of each group (``session_id`` 0) gets no word ids (an empty list, as a failed
speech sample): it takes the fallback rule, ``fixed`` with ``segment_window`` = ``WINDOW``."""

import math

from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from maspo_verl.batch import NO_WORD, WORD_IDS_KEY

WINDOW = 8


def known_words(ids: list[int]) -> list[int]:
    out, word = [], -1
    for t, tok in enumerate(ids):
        if t == 0 or tok % 3 == 0:
            word += 1
        out.append(NO_WORD if tok % 5 == 0 else word)
    return out


def runs(values: list[int]) -> int:
    return sum(1 for t, v in enumerate(values) if t == 0 or v != values[t - 1])


class KnownWordsRewardManager(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)

    async def run_single(self, data):
        item = data[-1:][0]
        responses = item.batch["responses"]
        n = int(item.batch["attention_mask"][-responses.shape[-1] :].sum())
        if int(item.non_tensor_batch.get("session_id", -1)) == 0:
            words, expected = [], math.ceil(n / WINDOW)
        else:
            words = known_words(responses[:n].tolist())
            expected = runs(words)
        return {"reward_score": float(expected), "reward_extra_info": {"score": float(expected), WORD_IDS_KEY: words}}
