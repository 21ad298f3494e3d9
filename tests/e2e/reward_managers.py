"""Test-only verl reward managers of the e2e runs: one file (loaded by path through
``reward.reward_manager.source=importlib``, ``tests/e2e/conftest.py:manager_overrides``), one base.

- ``HalfSpanRewardManager``: every response scores 0.5 (so GRPO's advantages are all 0) and returns
  per-token scores whose local part is -0.5 on the first half of the response, +0.5 on the second
  (penalty 1 per first-half token, centred), as the speech reward's ``token_scores`` do.
- ``DelimiterCountRewardManager`` (``segment_rule=delimiters``): as the score, the number of segments
  the rule must find in the response, computed from the decoded text alone (so verl's logged
  ``critic/score/mean`` is the expected ``actor/ratio/segments_per_seq``). Each token is decoded on its
  own (special tokens as "", as the rule reads them); a string occurs where it is found in the joined
  text within one token or across two neighbouring tokens. A delimiter's occurrence ends the segment
  after the token holding its first character, a step marker's starts one at that token
  (docs/algorithms.md §3).
- ``KnownWordsRewardManager`` (``segment_rule=words``): word ids that depend on the response tokens,
  and, as the score, the number of segments the words rule must find. A token whose id is a multiple
  of 3 starts a new word; a token whose id is a multiple of 5 is a gap. The first response of each
  group (``session_id`` 0) gets no word ids (an empty list, as a failed speech sample): it takes the
  fallback rule, ``fixed`` with ``segment_window`` = ``WINDOW``.
"""

import math

from maspo_verl.batch import NO_WORD, TOKEN_SCORES_KEY, WORD_IDS_KEY
from maspo_verl.plugin.rewards import RewardManager
from maspo_verl.speech.spans import token_scores

# ---- HalfSpanRewardManager
SCORE = 0.5


class HalfSpanRewardManager(RewardManager):
    async def run_single(self, data):
        _, ids = self.response(data)
        n = len(ids)
        penalties = [-1.0 if t < n // 2 else 0.0 for t in range(n)]
        info = {"score": SCORE, TOKEN_SCORES_KEY: token_scores(SCORE, penalties)}
        return {"reward_score": SCORE, "reward_extra_info": info}


# ---- DelimiterCountRewardManager
# the e2e test's policy_loss.delimiters / step_markers: single bytes of the embedded byte-level model,
# and ". " (two tokens there)
DELIMITERS = ["\n", ".", ". ", ",", ";", ":", "?", "!", "-", "("]
STEP_MARKERS = ["a", "e", "i", "o", "u", "A", "E", "I", "O", "U"]


def occurrences(text: str, s: str) -> list[int]:
    """Start of every occurrence of ``s`` in ``text``, overlapping ones included."""
    found, at = [], text.find(s)
    while at >= 0:
        found.append(at)
        at = text.find(s, at + 1)
    return found


def expected_segments(pieces: list[str]) -> int:
    owner = [t for t, piece in enumerate(pieces) for _ in piece]
    text = "".join(pieces)
    starts = {0} if pieces else set()
    for strings, after in ((DELIMITERS, 1), (STEP_MARKERS, 0)):
        for s in strings:
            for c in occurrences(text, s):
                first, last = owner[c], owner[c + len(s) - 1]
                if last - first <= 1 and first + after < len(pieces):
                    starts.add(first + after)
    return len(starts)


class DelimiterCountRewardManager(RewardManager):
    async def run_single(self, data):
        _, ids = self.response(data)
        pieces = [self.tokenizer.decode([i], skip_special_tokens=True) for i in ids]
        expected = float(expected_segments(pieces))
        return {"reward_score": expected, "reward_extra_info": {"score": expected}}


# ---- KnownWordsRewardManager
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


class KnownWordsRewardManager(RewardManager):
    async def run_single(self, data):
        item, ids = self.response(data)
        if int(item.non_tensor_batch.get("session_id", -1)) == 0:
            words, expected = [], math.ceil(len(ids) / WINDOW)
        else:
            words = known_words(ids)
            expected = runs(words)
        return {"reward_score": float(expected), "reward_extra_info": {"score": float(expected), WORD_IDS_KEY: words}}
