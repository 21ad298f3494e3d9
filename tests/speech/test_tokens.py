"""Llasa token map, prompt, chat template, and tokenval segmentation on realistic ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from maspo_verl.config import GranularLossConfig
from maspo_verl.core.segments import compute_boundaries, compute_segment_ids
from maspo_verl.fsq import digits_distance as fsq_digits_distance
from maspo_verl.speech.tokens import (
    DEFAULT_CODEC_OFFSET,
    LlasaTokenMap,
    codes_to_text,
    hydra_quote,
    prompt_for_verl,
    render_prompt,
    speech_chat_template,
    tts_messages,
)


def test_defaults_match_spec():
    m = LlasaTokenMap.from_tokenizer(None)
    assert (m.codec_offset, m.codec_size, m.speech_start_id, m.speech_end_id) == (128264, 65536, 128260, 128261)


def test_derived_from_llasa_shaped_tokenizer(llasa_tokenizer, small_llasa_tokenizer):
    m = LlasaTokenMap.from_tokenizer(llasa_tokenizer)
    assert (m.codec_offset, m.speech_start_id, m.speech_end_id) == (128264, 128260, 128261)
    assert len(llasa_tokenizer) == 193800
    small = LlasaTokenMap.from_tokenizer(small_llasa_tokenizer)
    assert (small.codec_offset, small.speech_start_id, small.speech_end_id) == (1008, 1004, 1005)
    assert small_llasa_tokenizer.convert_tokens_to_ids("<|s_65535|>") == small.token_id(65535)


def test_rejects_non_llasa_tokenizer():
    class Plain:
        unk_token_id = 0

        def convert_tokens_to_ids(self, tok):
            return 0

    with pytest.raises(ValueError, match="not a Llasa"):
        LlasaTokenMap.from_tokenizer(Plain())

    class Gappy:
        unk_token_id = None

        def convert_tokens_to_ids(self, tok):
            if tok.startswith("<|s_"):
                n = int(tok[4:-2])
                return 500 + n + (1 if n > 100 else 0)
            return 7

    with pytest.raises(ValueError, match="not contiguous"):
        LlasaTokenMap.from_tokenizer(Gappy())


def test_codes_from_ids_ignores_outside_and_stops_at_end(llasa_tokenizer):
    m = LlasaTokenMap.from_tokenizer(llasa_tokenizer)
    text = (
        "<|SPEECH_GENERATION_START|><|s_0|>ab<|s_17|><|TEXT_UNDERSTANDING_END|><|s_65535|>"
        "<|SPEECH_GENERATION_END|><|s_9|>"
    )
    ids = llasa_tokenizer.encode(text, add_special_tokens=False)
    assert m.codes_from_ids(ids) == [0, 17, 65535]
    assert m.codes_from_ids(ids, stop_at_end=False) == [0, 17, 65535, 9]
    assert m.codes_from_ids([193800, -1, 5, 128263]) == []
    # the string path (naive reward manager) agrees when codec tokens survive decoding
    decoded = llasa_tokenizer.decode(ids, skip_special_tokens=True)
    assert m.codes_from_text(decoded) == [0, 17, 65535, 9]  # END is special: stripped, cannot stop there
    assert m.codes_from_text(codes_to_text([3, 4]) + "<|SPEECH_GENERATION_END|><|s_5|><|s_70000|>") == [3, 4]


def test_prompt_format_and_verl_chat_template(llasa_tokenizer):
    text = "Hello there, it's 5 o'clock."
    assert tts_messages(text)[0]["content"] == (
        "Convert the text to speech:<|TEXT_UNDERSTANDING_START|>" + text + "<|TEXT_UNDERSTANDING_END|>"
    )
    llasa = render_prompt(llasa_tokenizer, text)
    assert llasa.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n<|SPEECH_GENERATION_START|>")
    # what verl renders: the prepared user turn + add_generation_prompt with our template
    verl_prompt = llasa_tokenizer.apply_chat_template(
        prompt_for_verl(text),
        tokenize=False,
        add_generation_prompt=True,
        chat_template=speech_chat_template(llasa_tokenizer),
    )
    assert verl_prompt == llasa
    ids = llasa_tokenizer.apply_chat_template(
        prompt_for_verl(text),
        tokenize=True,
        add_generation_prompt=True,
        chat_template=speech_chat_template(llasa_tokenizer),
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[-1] == 128260


@pytest.mark.parametrize("value", ["a'b", "x\\ny", "end\\", "q\\'z", "{% if a %}'x'{% endif %}\n", "a,b [c] {d: e}"])
def test_hydra_quote_round_trip(value, llasa_tokenizer):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    assert parser.parse_override("k=" + hydra_quote(value)).value() == value
    template = speech_chat_template(llasa_tokenizer)
    assert parser.parse_override("+a.b=" + hydra_quote(template)).value() == template


def _persistent_codes(n: int, rng: np.random.Generator, p_jump: float = 0.05) -> np.ndarray:
    """Codes that mostly keep their FSQ digits (a low digit moves by one level), with rare jumps."""
    codes = [int(rng.integers(65536))]
    for _ in range(n - 1):
        c = codes[-1]
        if rng.random() < p_jump:
            c = int(rng.integers(65536))
        else:
            k = int(rng.integers(3))
            d = (c >> (2 * k)) & 3
            nd = d + 1 if d < 3 and (d == 0 or rng.random() < 0.5) else d - 1
            c = c - (d << (2 * k)) + (nd << (2 * k))
        codes.append(c)
    return np.array(codes)


def test_adjacent_distance_histogram_persistent_vs_random():
    rng = np.random.default_rng(0)
    n = 4000
    pers = torch.tensor(_persistent_codes(n, rng))
    rand = torch.tensor(rng.integers(0, 65536, n))
    levels = [4] * 8
    d_pers = fsq_digits_distance(pers[1:], pers[:-1], levels, "fsq_l1")
    d_rand = fsq_digits_distance(rand[1:], rand[:-1], levels, "fsq_l1")
    h_pers = torch.bincount(d_pers, minlength=25)[:25].double() / (n - 1)
    h_rand = torch.bincount(d_rand, minlength=25)[:25].double() / (n - 1)
    # random codes: 8 digits, E|d - d'| = 1.25 per uniform 4-level digit -> mean 10
    assert abs(d_rand.double().mean().item() - 10.0) < 0.3
    assert h_pers[:2].sum() > 0.9 and h_rand[:2].sum() < 0.01
    assert h_pers[9:].sum() < 0.06 and h_rand[9:].sum() > 0.5
    # Hamming: persistent neighbours differ in one digit; random ones in ~6 of 8 (1 - 1/4 each)
    ham = fsq_digits_distance(rand[1:], rand[:-1], levels, "fsq_hamming").double().mean().item()
    assert abs(ham - 6.0) < 0.2
    # raw id distance is dominated by the top digit: a one-level change there is >= 16384
    assert (pers[1:] - pers[:-1]).abs().double().median() < 64


def test_tokenval_segments_on_realistic_ids(llasa_tokenizer):
    """A Llasa response: codes of three 'sounds' (persistent runs), then END, right-padded."""
    m = LlasaTokenMap.from_tokenizer(llasa_tokenizer)
    rng = np.random.default_rng(1)
    runs = [_persistent_codes(12, rng, p_jump=0.0) for _ in range(3)]
    # make run starts far from the previous run's end (FSQ L1 > 8)
    for r in range(1, 3):
        while fsq_digits_distance(torch.tensor(runs[r][0]), torch.tensor(runs[r - 1][-1]), [4] * 8, "fsq_l1") <= 8:
            runs[r] = _persistent_codes(12, rng, p_jump=0.0)
    codes = np.concatenate(runs)
    ids = [m.token_id(c) for c in codes] + [m.speech_end_id]
    T = len(ids) + 4
    tok = torch.tensor([ids + [0] * 4])
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, : len(ids)] = True
    config = GranularLossConfig(
        segment_rule="tokenval",
        tokenval_threshold=8.0,
        tokenval_distance="fsq_l1",
        codec_offset=m.codec_offset,
        codec_size=m.codec_size,
    )
    b = compute_boundaries(mask, config, token_ids=tok)
    starts = torch.nonzero(b[0]).flatten().tolist()
    assert starts == [0, 12, 24, 36], starts  # three sound segments + END on its own
    seg = compute_segment_ids(mask, config, token_ids=tok)[0]
    assert seg[:36].tolist() == [0] * 12 + [1] * 12 + [2] * 12 and seg[36].item() == 3
    # with the small-base tokenizer the same codes sit elsewhere; the rule follows the derived offset
    assert DEFAULT_CODEC_OFFSET == m.codec_offset
