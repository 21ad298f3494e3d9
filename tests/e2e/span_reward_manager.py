"""Test-only verl reward manager: every response scores 0.5 (so GRPO's advantages are all 0) and
returns per-token scores whose local part is -0.5 on the first half of the response, +0.5 on the
second (penalty 1 per first-half token, centred), as the speech reward's ``token_scores`` do."""

from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from maspo_verl.batch import TOKEN_SCORES_KEY
from maspo_verl.speech.spans import token_scores

SCORE = 0.5


class HalfSpanRewardManager(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)

    async def run_single(self, data):
        item = data[-1:][0]
        responses = item.batch["responses"]
        n = int(item.batch["attention_mask"][-responses.shape[-1] :].sum())
        penalties = [-1.0 if t < n // 2 else 0.0 for t in range(n)]
        info = {"score": SCORE, TOKEN_SCORES_KEY: token_scores(SCORE, penalties)}
        return {"reward_score": SCORE, "reward_extra_info": info}
