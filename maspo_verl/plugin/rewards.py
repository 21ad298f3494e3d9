"""The base of our verl reward managers (the local mode's, the learn tasks', the speech recipe's, the tests'):
verl's ``RewardManagerBase`` built the way verl's reward loop builds a manager, and one sample's valid response."""

from __future__ import annotations

from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase


class RewardManager(RewardManagerBase):
    """verl builds a manager with the reward router's arguments too; ours need none of them."""

    def __init__(self, config, tokenizer, compute_score=None, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)

    @staticmethod
    def response(data):
        """The sample of ``run_single``'s data and its valid response token ids (a list of ints)."""
        item = data[-1:][0]
        responses = item.batch["responses"]
        n = int(item.batch["attention_mask"][-responses.shape[-1] :].sum())
        return item, [int(t) for t in responses[:n].tolist()]
