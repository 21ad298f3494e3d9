"""The offset arm of part 2's H2 (docs/results/granularity/PREREGISTRATION.md): on the warm speech model every word
lasts exactly L / 4 frames, so the aligned arm is a fixed window of L / 4 and its control the same window with its
boundaries moved by N frames. ``lab learn --losses maspo_words~offset12`` runs ``maspo_words`` fed the frame grid's
word ids shifted by N (token t is in word (t + N) // (L / 4)) instead of the decoded words: at N = 0 that is the
window of L / 4 exactly (tested), at N = 12 and L = 96 the segments are 12, 24, 24, 24, 12 frames."""

from __future__ import annotations

from maspo_verl.local.learn_tasks import SPEECH_WORDS, LearnRewardManager, reward_manager_overrides

SEP = "~offset"  # PRESET~offsetN
PRESET = "maspo_words"  # the one preset that reads word ids
KWARG = "word_grid_offset"  # reward.reward_kwargs.<KWARG>: N, read by the reward manager below


def split(loss: str) -> tuple[str, int | None]:
    """``maspo_words~offsetN`` -> (``maspo_words``, N); a name without the suffix -> (name, None)."""
    name, sep, offset = loss.partition(SEP)
    if not sep:
        return loss, None
    if name != PRESET or not offset.isdigit():
        raise SystemExit(f"--losses {loss!r}: allowed {PRESET}{SEP}N with N a whole number of frames >= 0")
    return name, int(offset)


def grid_word_ids(n: int, offset: int) -> list[int]:
    """Per token of a response of ``n`` frames, its word of the frame grid shifted by ``offset`` frames."""
    frames = max(n // SPEECH_WORDS, 1)
    return [(t + offset) // frames for t in range(n)]


def reward_overrides(offset: int) -> list[str]:
    """The trainer's reward settings of the offset arm: the learn tasks' reward, the grid's word ids."""
    return [*reward_manager_overrides(GridWordsRewardManager), f"++reward.reward_kwargs.{KWARG}={offset}"]


class GridWordsRewardManager(LearnRewardManager):
    """The learn tasks' reward and per-token scores; word ids of the frame grid shifted by ``KWARG``."""

    async def run_single(self, data) -> dict:
        from maspo_verl.batch import WORD_IDS_KEY

        out = await super().run_single(data)
        _, ids = self.response(data)
        offset = (self.config.get("reward", {}).get("reward_kwargs", {}) or {}).get(KWARG)
        if offset is None:
            raise ValueError(f"{type(self).__name__} needs reward.reward_kwargs.{KWARG} (frames; lab learn sets it)")
        out["reward_extra_info"][WORD_IDS_KEY] = grid_word_ids(len(ids), int(offset))
        return out
