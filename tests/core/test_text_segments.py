"""segment_rule=delimiters and segment_rule=surprisal (docs/algorithms.md §3).

Delimiters are resolved on real BPE tokenizers trained here with the ``tokenizers`` library (a
byte-level one with the pre-tokenizer regex of Qwen2 / Llama 3, and a SentencePiece-style one), and a
response's segments are checked against its sentences and steps split from the decoded text by a
regular expression. Surprisal is checked against a float64 loop over the valid tokens of each row.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from maspo_verl import vocab
from maspo_verl.batch import micro_batch_scope
from maspo_verl.config import GranularLossConfig
from maspo_verl.core.segments import compute_segment_ids
from maspo_verl.core.segments.text_tables import text_tables
from maspo_verl.validation import FieldError

# Qwen2's / Llama 3's pre-tokenizer: punctuation keeps the newlines after it (".\n\n" can merge), and a
# word keeps the space before it (". Then" is "." " Then")
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT = ["\n\n", "\n", ". ", "? ", "! "]


def corpus() -> list[str]:
    lines = []
    for i in range(300):
        lines.append(
            f"We add {i} and {i + 1}. The sum is {2 * i + 1}.\n\nThen we double it. Is it {4 * i + 2}? Yes!\n"
            f"Step {i % 9}: so the answer is {i}.\n\nTherefore we stop. Done!\n"
        )
    return lines


def hf(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def bpe():
    """Byte-level BPE with Qwen2's pre-tokenizer, trained on the corpus (well under a second)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    tok.train_from_iterator(corpus(), trainer)
    return hf(tok)


@pytest.fixture(scope="module")
def sentencepiece_bpe():
    """A SentencePiece-style BPE (``▁`` marks a word's leading space; the decoder drops it at the start)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    return hf(tok)


def byte_text(tokenizer, i: int) -> str:
    """A byte-level token's text from its vocabulary string (GPT-2's byte alphabet), not through decode()."""
    from maspo_verl.local.assets import _bytes_to_unicode

    back = {c: b for b, c in _bytes_to_unicode().items()}
    return bytes(back[c] for c in tokenizer.convert_ids_to_tokens(i)).decode("utf-8", errors="replace")


def segments_of(tokenizer, text: str, **fields) -> list[str]:
    """The texts of the segments that segment_rule=delimiters gives ``text``'s tokens: the decoded text up
    to each segment's end, less the text up to its start (decoding a segment alone may drop its first space)."""
    ids = torch.tensor([tokenizer.encode(text)])
    config = GranularLossConfig(loss_mode="maspo", segment_rule="delimiters", **fields)
    with micro_batch_scope({"responses": ids}, tokenizer):
        seg = compute_segment_ids(torch.ones(ids.shape, dtype=torch.bool), config)[0]
    ends = [int((seg <= k).sum()) for k in range(int(seg.max()) + 1)]
    upto = [tokenizer.decode(ids[0, :end].tolist()) for end in [0, *ends]]
    return [b[len(a) :] for a, b in zip(upto, upto[1:], strict=False)]


def test_merged_tokens_holding_a_delimiter_are_found(bpe):
    newline_ids = {i for i in range(len(bpe)) if "\n" in byte_text(bpe, i)}
    merged = {i for i in newline_ids if len(byte_text(bpe, i)) > 1}
    (paragraph_end,) = bpe.encode(".\n\n")  # a merge the corpus teaches
    assert paragraph_end in merged and {byte_text(bpe, i) for i in merged} >= {".\n\n", ".\n", "!\n"}
    tables = text_tables(bpe, DEFAULT, [])
    found = {i for i, flags in enumerate(tables.inside) if flags & vocab.DELIMITER}
    assert found == newline_ids  # every token holding "\n" or "\n\n", and nothing else inside a token
    # a sentence end never lies inside a token: "." and " Then" are split by the pre-tokenizer
    tokens = bpe.convert_ids_to_tokens(bpe.encode("7. Then"))
    assert tokens[:2] == ["7", "."] and tokens[2].startswith("Ġ")
    inside, splits = tables.matches[("delimiters", ". ")]
    ending = sum(byte_text(bpe, i).endswith(".") for i in range(len(bpe)))
    starting = sum(byte_text(bpe, i).startswith(" ") for i in range(len(bpe)))
    assert inside == 0 and splits == [(ending, starting)] and ending >= 1 and starting > 10


TEXT = (
    "We add 3 and 4. The sum is 7.\n\nThen we double it. Is it 14? Yes!\n"
    "Step 2: so the answer is 14.\n\nTherefore we stop. Done!"
)


def split_text(text: str, ends: str, starts: str | None = None) -> list[str]:
    """Sentences and steps from the text alone: cut after each match of ``ends``, before each of ``starts``."""
    cuts = {m.end() for m in re.finditer(ends, text)}
    if starts:
        cuts |= {m.start() for m in re.finditer(starts, text)}
    cuts = sorted(c for c in cuts if 0 < c < len(text))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def test_segments_are_the_sentences_and_steps_of_the_decoded_text(bpe):
    # a sentence ends after ". ", "? " or "! " (before the space); a step after a run of line breaks
    sentences = split_text(TEXT, r"[.?!](?= )|\n+")
    assert sentences[:3] == ["We add 3 and 4.", " The sum is 7.\n\n", "Then we double it."]
    assert segments_of(bpe, TEXT) == sentences
    # step markers start segments: at "Step" and "Therefore" only, or also after line breaks
    markers = ["Step", "Therefore"]
    steps = split_text(TEXT, r"(?!)", r"Step|Therefore")
    assert len(steps) == 3 and segments_of(bpe, TEXT, delimiters=[], step_markers=markers) == steps
    lines = split_text(TEXT, r"\n+", r"Step|Therefore")
    assert len(lines) == 4 and segments_of(bpe, TEXT, delimiters=["\n"], step_markers=markers) == lines


def test_sentencepiece_tokens_keep_their_leading_space(sentencepiece_bpe):
    tok = sentencepiece_bpe
    the = tok.convert_tokens_to_ids("▁The")
    assert tok.decode([the]) == "The"  # the decoder drops the first token's space ...
    texts = vocab.token_texts(tok)
    assert texts[the] == " The"  # ... which the vocabulary text keeps
    text = "We add 3 and 4. The sum is 7. Then we double it. Is it 14? Yes! Done."
    assert segments_of(tok, text) == split_text(text, r"[.?!](?= )")


def test_a_string_that_occurs_nowhere_is_refused_naming_the_field(bpe):
    tables = text_tables(bpe, DEFAULT, ["Step"])
    assert tables.matches[("step_markers", "Step")][0] >= 1
    with pytest.raises(FieldError, match=r"policy_loss.step_markers has 'Lemma'.*occurs in no token") as err:
        text_tables(bpe, DEFAULT, ["Lemma"])
    assert err.value.field == "policy_loss.step_markers"
    with pytest.raises(FieldError, match=r"policy_loss.delimiters has '§§'"):
        text_tables(bpe, ["\n", "§§"], [])  # no token holds "§" whole (two bytes, never merged here)


def test_ids_outside_the_vocabulary_and_padding_match_nothing(bpe):
    """Holes and padding hold delimiter ids: they neither end a segment nor join their neighbours."""
    period, space = bpe.encode("."), bpe.encode(" The")
    ids = torch.tensor([[*bpe.encode("Yes"), *period, 10_000, *space, *period]])
    mask = torch.ones(ids.shape, dtype=torch.bool)
    config = GranularLossConfig(loss_mode="maspo", segment_rule="delimiters")
    with micro_batch_scope({"responses": ids}, bpe):
        # the unknown id between "." and " The" breaks the ". " occurrence: one segment
        assert compute_segment_ids(mask, config).max() == 0
        mask[0, len(bpe.encode("Yes")) + 1] = False  # now "." and " The" are neighbours
        assert compute_segment_ids(mask, config).max() == 1


def test_without_a_tokenizer_in_scope_the_error_says_where_it_comes_from():
    ids = torch.zeros(1, 4, dtype=torch.long)
    config = GranularLossConfig(loss_mode="maspo", segment_rule="delimiters")
    with micro_batch_scope({"responses": ids}), pytest.raises(RuntimeError, match="model_config.tokenizer"):
        compute_segment_ids(torch.ones(1, 4, dtype=torch.bool), config)


@pytest.mark.parametrize(
    "fields,error",
    [
        ({"delimiters": [], "step_markers": []}, "policy_loss.delimiters=.* at least one string"),
        ({"delimiters": ["\n", ""]}, "policy_loss.delimiters=.* a list of non-empty strings"),
        ({"step_markers": "Step"}, "policy_loss.step_markers='Step' is invalid"),
        ({"step_markers": ["x" * 70]}, "policy_loss.step_markers=.* at most 63 characters"),
        ({"surprisal_quantile": 1.5}, r"policy_loss.surprisal_quantile=1.5 is invalid: allowed a finite number >= 0.0"),
    ],
)
def test_bad_text_settings_name_the_field(fields, error):
    with pytest.raises(FieldError, match=error):
        GranularLossConfig(loss_mode="maspo", segment_rule="delimiters", **fields)


# ---- surprisal ------------------------------------------------------------------------------------


def surprisal_reference(old: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """Per row: the floor(q L + 1/2) valid tokens of largest -old (ties: the earlier) start segments."""
    ids = torch.zeros(mask.shape, dtype=torch.long)
    for i in range(mask.shape[0]):
        positions = [t for t in range(mask.shape[1]) if mask[i, t]]
        k = math.floor(q * len(positions) + 0.5)
        ranked = sorted(positions, key=lambda t: (float(old[i, t]), t))  # most surprising first
        starts = set(ranked[:k]) | set(positions[:1])
        seg = -1
        for t in positions:
            seg += t in starts
            ids[i, t] = seg
    return ids


def random_rows(seed: int, B: int = 7, T: int = 23):
    """Old log-probs with ties (rounded to 0.25), masks right- or left-padded or with holes."""
    g = torch.Generator().manual_seed(seed)
    old = (-torch.rand(B, T, generator=g) * 4 / 0.25).round() * 0.25
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[0] = False  # an empty row
    mask[1] = torch.arange(T) >= 5  # left padding
    mask[2] = torch.arange(T) < 9  # right padding
    return old, mask


@pytest.mark.parametrize("q", [0.0, 0.1, 0.2, 0.35, 0.5, 0.999, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_surprisal_matches_the_loop_reference(q, seed):
    old, mask = random_rows(seed)
    config = GranularLossConfig(loss_mode="maspo", segment_rule="surprisal", surprisal_quantile=q)
    ids = compute_segment_ids(mask, config, old_log_prob=old)
    assert torch.equal(ids * mask, surprisal_reference(old, mask, q))


def test_surprisal_ties_go_to_the_earlier_token():
    old = torch.full((1, 10), -1.0)
    config = GranularLossConfig(loss_mode="maspo", segment_rule="surprisal", surprisal_quantile=0.3)
    ids = compute_segment_ids(torch.ones(1, 10, dtype=torch.bool), config, old_log_prob=old)
    assert ids.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 2, 2]]  # 3 starts: tokens 0, 1, 2


def test_surprisal_zero_with_max_length_is_the_fixed_window():
    old, mask = random_rows(3)
    config = GranularLossConfig(loss_mode="maspo", segment_rule="surprisal", surprisal_quantile=0.0, max_segment_len=4)
    fixed = GranularLossConfig(loss_mode="maspo", segment_rule="fixed", segment_window=4)
    assert torch.equal(compute_segment_ids(mask, config, old_log_prob=old), compute_segment_ids(mask, fixed))


def test_surprisal_with_min_length_keeps_the_most_surprising_of_close_starts():
    old = torch.tensor([[-0.1, -3.0, -2.0, -0.1, -0.1, -0.1, -4.0, -0.1]])
    config = GranularLossConfig(
        loss_mode="maspo", segment_rule="surprisal", surprisal_quantile=0.375, min_segment_len=3
    )
    ids = compute_segment_ids(torch.ones(1, 8, dtype=torch.bool), config, old_log_prob=old)
    # k = 3 starts proposed: tokens 6 (4.0), 1 (3.0), 2 (2.0); 1 and 2 lie within 2 tokens of the first
    # token, which always starts a segment (and outranks them): only 6 stays
    assert ids.tolist() == [[0, 0, 0, 0, 0, 0, 1, 1]]


# ---- start-up ------------------------------------------------------------------------------------


def test_start_up_resolves_against_the_actors_tokenizer_and_refuses_a_string_found_nowhere(bpe, tmp_path, capsys):
    from maspo_verl.plugin.checks import run_startup_checks
    from tests.helpers import compose_config

    bpe.save_pretrained(tmp_path)
    model = f"actor_rollout_ref.model.path={tmp_path}"
    assert run_startup_checks(compose_config("loss=maspo_steps", model)) == []
    out = capsys.readouterr().out
    assert f"segment_rule=delimiters on {tmp_path}'s tokenizer ({len(bpe)} ids)" in out
    newline = sum("\n" in byte_text(bpe, i) for i in range(len(bpe)))
    assert f"  delimiter '\\n': {newline} ids\n" in out
    assert "  delimiter '. ': 0 ids; across two tokens: 1 ending '.' x " in out
    markers = "actor_rollout_ref.actor.policy_loss.step_markers=[Step,Lemma]"
    with pytest.raises(FieldError, match="policy_loss.step_markers has 'Lemma'"):
        run_startup_checks(compose_config("loss=maspo_steps", model, markers))
    # a tokenizer the driver cannot load (a remote path verl copies first): a warning, the workers resolve
    issued = run_startup_checks(compose_config("loss=maspo_steps", "actor_rollout_ref.model.path=/nonexistent"))
    assert len(issued) == 1 and "the tokenizer at /nonexistent did not load on the driver" in issued[0]
    # a dry run opens no model: nothing is resolved, nothing refused
    dry = compose_config("loss=maspo_steps", "actor_rollout_ref.model.path=/nonexistent", markers, "maspo.dry_run=true")
    assert run_startup_checks(dry) == []
    assert "resolves its strings against /nonexistent's tokenizer at launch" in capsys.readouterr().out
