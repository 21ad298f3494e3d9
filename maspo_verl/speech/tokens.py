"""Llasa / XCodec2 token handling (docs/algorithms.md §3 for the codec facts).

Llasa-1B's vocabulary is Llama-3.2's 128256 ids, eight specials (128256..128263), then
``<|s_0|>..<|s_65535|>``: code = token_id - 128264 for 128264 <= id < 193800. The map is derived
from a tokenizer when one is given (so a re-based vocabulary still works) and falls back to those
defaults otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_CODEC_OFFSET = 128264
DEFAULT_CODEC_SIZE = 65536
SPECIALS = (
    "<|TEXT_GENERATION_START|>",
    "<|TEXT_GENERATION_END|>",
    "<|TEXT_UNDERSTANDING_START|>",
    "<|TEXT_UNDERSTANDING_END|>",
    "<|SPEECH_GENERATION_START|>",
    "<|SPEECH_GENERATION_END|>",
    "<|SPEECH_UNDERSTANDING_START|>",
    "<|SPEECH_UNDERSTANDING_END|>",
)
DEFAULT_SPECIAL_IDS = {name: 128256 + i for i, name in enumerate(SPECIALS)}
SPEECH_START = "<|SPEECH_GENERATION_START|>"
SPEECH_END = "<|SPEECH_GENERATION_END|>"
TEXT_START = "<|TEXT_UNDERSTANDING_START|>"
TEXT_END = "<|TEXT_UNDERSTANDING_END|>"
USER_TEMPLATE = "Convert the text to speech:" + TEXT_START + "{text}" + TEXT_END
CODE_TOKEN = "<|s_{}|>"
_CODE_RE = re.compile(r"<\|s_(\d+)\|>")


def tts_messages(text: str) -> list[dict[str, str]]:
    """Llasa's chat prompt: the user turn and the assistant prefix ``<|SPEECH_GENERATION_START|>``.

    With verl the assistant prefix cannot be a chat message (verl appends the generation prompt
    itself), so the prepared data carries only the user turn and ``speech_prefix`` below is added by
    the chat template's generation prompt - see ``prompt_for_verl``.
    """
    return [
        {"role": "user", "content": USER_TEMPLATE.format(text=text)},
        {"role": "assistant", "content": SPEECH_START},
    ]


def prompt_for_verl(text: str) -> list[dict[str, str]]:
    """The verl ``prompt`` column: the user turn only (see recipes/speech/README.md, "Prompt")."""
    return [{"role": "user", "content": USER_TEMPLATE.format(text=text)}]


def render_prompt(tokenizer: Any, text: str) -> str:
    """Prompt string exactly as Llasa's inference code builds it: chat template with the assistant
    prefix ``<|SPEECH_GENERATION_START|>`` continued (not closed)."""
    msgs = tts_messages(text)
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    return rendered


GENERATION_PREFIX_JINJA = "{% if add_generation_prompt %}" + SPEECH_START + "{% endif %}"


def speech_chat_template(tokenizer: Any) -> str:
    """The tokenizer's own chat template with ``<|SPEECH_GENERATION_START|>`` appended to the
    generation prompt. verl renders prompts with ``add_generation_prompt=True``, so with this as
    ``actor_rollout_ref.model.custom_chat_template`` the rollout prompt equals Llasa's
    ``render_prompt`` (assistant turn opened with the speech-start token)."""
    base = tokenizer.chat_template
    if not isinstance(base, str) or not base:
        raise ValueError("tokenizer has no chat template (Llasa ships Llama-3's)")
    return base + GENERATION_PREFIX_JINJA


def hydra_quote(value: str) -> str:
    """Quote a string as one Hydra override value: single quotes; backslash runs that precede a
    quote or end the string are doubled (Hydra's escaping rule), everything else is verbatim."""
    if "${" in value:
        raise ValueError("value contains '${', which OmegaConf would interpolate")
    s = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    s = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, s)
    return "'" + s + "'"


@dataclass(frozen=True)
class LlasaTokenMap:
    """Where codec tokens live in the vocabulary, and the speech start/end ids."""

    codec_offset: int = DEFAULT_CODEC_OFFSET
    codec_size: int = DEFAULT_CODEC_SIZE
    speech_start_id: int = DEFAULT_SPECIAL_IDS[SPEECH_START]
    speech_end_id: int = DEFAULT_SPECIAL_IDS[SPEECH_END]
    source: str = "defaults"

    @classmethod
    def from_tokenizer(cls, tokenizer: Any | None, codec_size: int = DEFAULT_CODEC_SIZE) -> LlasaTokenMap:
        """Derive the map from a HF tokenizer (``convert_tokens_to_ids``); defaults without one.

        Checks that ``<|s_0|>`` .. ``<|s_{codec_size-1}|>`` are consecutive ids (probing the ends
        and a few interior codes) and that the specials exist; raises ValueError when the tokenizer
        has codec tokens that are not a contiguous block, so a wrong offset cannot go unnoticed.
        """
        if tokenizer is None:
            return cls(codec_size=codec_size)
        unk = getattr(tokenizer, "unk_token_id", None)

        def tid(tok: str) -> int | None:
            i = tokenizer.convert_tokens_to_ids(tok)
            if i is None or (unk is not None and i == unk) or (isinstance(i, int) and i < 0):
                return None
            return int(i)

        first = tid(CODE_TOKEN.format(0))
        if first is None:
            raise ValueError(
                f"tokenizer has no {CODE_TOKEN.format(0)} token: not a Llasa/XCodec2 tokenizer "
                "(pass tokenizer=None to use the documented defaults)"
            )
        for code in sorted({1, 2, codec_size // 2, codec_size - 1}):
            got = tid(CODE_TOKEN.format(code))
            if got != first + code:
                raise ValueError(
                    f"codec tokens are not contiguous: {CODE_TOKEN.format(code)} has id {got}, "
                    f"expected {first + code} (= id of <|s_0|> + {code})"
                )
        start, end = tid(SPEECH_START), tid(SPEECH_END)
        if start is None or end is None:
            raise ValueError(f"tokenizer lacks {SPEECH_START} or {SPEECH_END}")
        return cls(first, codec_size, start, end, source=type(tokenizer).__name__)

    def token_id(self, code: int) -> int:
        return self.codec_offset + int(code)

    def codes_from_ids(self, ids: Iterable[int], stop_at_end: bool = True) -> list[int]:
        """Codec codes of a generated id sequence; ids outside the codec range are ignored.

        Generation ends at ``<|SPEECH_GENERATION_END|>``: with ``stop_at_end`` anything after the
        first END id is dropped (vLLM stops there anyway; this guards against over-long samples).
        """
        return self.codes_and_positions(ids, stop_at_end)[0]

    def codes_and_positions(self, ids: Iterable[int], stop_at_end: bool = True) -> tuple[list[int], list[int]]:
        """``codes_from_ids`` and, for each code, the index of its id in ``ids``."""
        codes: list[int] = []
        positions: list[int] = []
        lo, hi = self.codec_offset, self.codec_offset + self.codec_size
        for k, i in enumerate(ids):
            i = int(i)
            if stop_at_end and i == self.speech_end_id:
                break
            if lo <= i < hi:
                codes.append(i - lo)
                positions.append(k)
        return codes, positions

    def codes_from_text(self, text: str) -> list[int]:
        """Codes from decoded text (``<|s_N|>`` pieces), for reward paths that only see strings.

        Text after ``<|SPEECH_GENERATION_END|>`` is dropped; N outside [0, codec_size) is ignored.
        """
        text = text.split(SPEECH_END, 1)[0]
        codes = (int(m) for m in _CODE_RE.findall(text))
        return [c for c in codes if 0 <= c < self.codec_size]


def codes_to_text(codes: Sequence[int]) -> str:
    return "".join(CODE_TOKEN.format(int(c)) for c in codes)
