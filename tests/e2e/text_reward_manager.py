"""Test-only verl reward manager for ``segment_rule=delimiters``: as the score, the number of segments the
rule must find in the response, computed from the decoded text alone (so verl's logged
``critic/score/mean`` is the expected ``actor/ratio/segments_per_seq``).

Each token is decoded on its own (special tokens as "", as the rule reads them); a string occurs where
it is found in the joined text within one token or across two neighbouring tokens. A delimiter's
occurrence ends the segment after the token holding its first character, a step marker's starts one
at that token (docs/algorithms.md §3)."""

from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

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


class DelimiterCountRewardManager(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)

    async def run_single(self, data):
        item = data[-1:][0]
        responses = item.batch["responses"]
        n = int(item.batch["attention_mask"][-responses.shape[-1] :].sum())
        pieces = [self.tokenizer.decode([i], skip_special_tokens=True) for i in responses[:n].tolist()]
        expected = float(expected_segments(pieces))
        return {"reward_score": expected, "reward_extra_info": {"score": expected}}
